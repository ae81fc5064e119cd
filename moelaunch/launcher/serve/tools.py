"""Tool calling in the chat API: the tools and tool_choice fields, the messages as the chat template
takes them, and a reply's tool calls in OpenAI's shape.

tool_choice auto: the tools are offered through the template and the model's DeepSeek-V3 markup is
parsed into calls. required and named: a grammar makes the reply a JSON call (vLLM's forms: named, the
function's arguments; required, a list of {"name", "parameters"}), so any model calls a tool.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from moelaunch.text.content_spans import CONTENT_PARTS, joined
from moelaunch.text.tokenizer import Tokenizer
from moelaunch.text.tool_markup import (
    ParsedCall,
    StreamedCalls,
    calls_parts,
    output_parts,
    parse_calls,
    render_tools,
)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _Named(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"] = "function"
    function: _Named


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def tool_call_schema(tools: list[Tool], named: str | None, parallel: bool) -> dict[str, Any]:
    """The reply's JSON schema when a call is required: the named tool's arguments, else a list of
    {"name", "parameters"} (one item unless parallel calls are allowed)."""
    if named is not None:
        return _parameters(next(t for t in tools if t.function.name == named))
    calls = [
        {"type": "object", "properties": {"name": {"enum": [t.function.name]}, "parameters": _parameters(t)},
         "required": ["name", "parameters"]}
        for t in tools
    ]  # fmt: skip
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return schema if parallel else {**schema, "maxItems": 1}


def calls_from_json(text: str, named: str | None) -> list[ParsedCall]:
    """The calls in a reply the grammar of tool_call_schema made (a reply cut short parses to none)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if named is not None:
        return [ParsedCall(named, json.dumps(value))]
    return [ParsedCall(c["name"], json.dumps(c["parameters"])) for c in value]


def api_calls(calls: list[ParsedCall], first_index: int | None = None) -> list[dict[str, Any]]:
    """OpenAI's tool_calls entries; a stream's deltas carry their index, counted from first_index."""
    entries = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]
    if first_index is not None:
        entries = [{"index": first_index + i, **e} for i, e in enumerate(entries)]
    return entries


def template_messages(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[Tool] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. What the template renders itself (tools, calls, tool
    results) it gets as it is; what it does not is written into the messages in DeepSeek-V3's markup:
    the tools as a system message, calls into the assistant's content, tool results as user turns."""
    offered = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    out = messages if tokenizer.template_mentions("tool_calls") else _in_markup(messages)
    if offered and not tokenizer.template_mentions("tools"):  # DeepSeek-V3's own template does not
        out = [{"role": "system", "content": render_tools(offered)}, *out]
    return out, offered


def _in_markup(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        # The parts tell the markup written here (control tokens) from the client's text inside it.
        if m["role"] == "tool":
            parts = output_parts(m["content"])
            m = {"role": "user", "content": joined(parts), CONTENT_PARTS: parts}
        elif m.get("tool_calls"):
            parts = [(m["content"], False), *calls_parts(m["tool_calls"])]
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m.update({"content": joined(parts), CONTENT_PARTS: parts})
        out.append(m)
    return out


class ChoiceCalls:
    """One choice's tool calls, read from its whole reply or as its text streams in."""

    def __init__(self, req: Any) -> None:
        self.mode = req.tool_mode  # auto, required or named
        self.named = req.tool_choice.function.name if self.mode == "named" else None
        self._stream = StreamedCalls()
        self._held = ""  # required/named: the JSON, read when finished
        self.sent = 0

    def _calls_of_json(self, text: str) -> list[ParsedCall]:
        return calls_from_json(text, self.named)

    def whole(self, content: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The message fields (content, tool_calls) and finish reason of a finished reply."""
        if self.mode == "auto":
            content, calls = parse_calls(content)
        else:
            content, calls = "", self._calls_of_json(content)
        return self._fields(content, api_calls(calls)), self._finish(finish, bool(calls))

    def delta(self, content: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A stream chunk's fields for `content`, the reply's new text, and its finish reason."""
        if self.mode == "auto":
            content, calls = self._stream.feed(content, finish is not None)
        else:
            self._held += content
            content, calls = "", self._calls_of_json(self._held) if finish is not None else []
        fields = self._fields(content, api_calls(calls, self.sent))
        self.sent += len(calls)
        return fields, self._finish(finish, self.sent > 0)

    @staticmethod
    def _fields(content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        fields: dict[str, Any] = {"content": content or None} if calls else {"content": content}
        if calls:
            fields["tool_calls"] = calls
        return fields

    def _finish(self, finish: str | None, called: bool) -> str | None:
        # OpenAI ends a named call with "stop" and other calls with "tool_calls".
        return "tool_calls" if finish == "stop" and called and self.mode != "named" else finish
