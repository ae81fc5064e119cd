"""DeepSeek-V3's tool-call markup: how its chat template writes the tools, the model's calls and the
tools' outputs, and how a reply's calls are read back (as vLLM's deepseek_v3 tool parser reads them).

A reply that calls tools is `content<｜tool▁calls▁begin｜>` then, per call,
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGUMENTS\\n```<｜tool▁call▁end｜>`, then
`<｜tool▁calls▁end｜>`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from moelaunch.text.content_spans import Part, joined

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
_CALL = re.compile(
    re.escape(CALL_BEGIN) + r"(?P<type>.*?)" + re.escape(SEP)
    + r"(?P<name>.*?)\n```json\n(?P<arguments>.*?)\n```" + re.escape(CALL_END), re.S,
)  # fmt: skip


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def render_tools(tools: list[dict[str, Any]]) -> str:
    """The system text that offers `tools` (OpenAI's function definitions) in DeepSeek-V3's format,
    for a chat template that does not render tools itself."""
    lines = ["## Tools", "You have the following functions available:"]
    for tool in tools:
        f = tool["function"]
        schema = json.dumps(f.get("parameters") or {}, separators=(",", ":"))
        lines += [f"- `{f['name']}`: {f.get('description') or ''}", f"```json\n{schema}\n```"]
    return "\n".join(lines)


def render_calls(calls: list[dict[str, Any]]) -> str:
    """An assistant message's tool calls (OpenAI's shape) as the model writes them."""
    return joined(calls_parts(calls))


def calls_parts(calls: list[dict[str, Any]]) -> list[Part]:
    """render_calls' text in parts: the markup, and the client's names and arguments between it."""
    parts: list[Part] = [(CALLS_BEGIN, True)]
    for c in calls:
        f = c["function"]
        parts += [(CALL_BEGIN, True), (c.get("type", "function"), False), (SEP, True)]
        parts += [(f"{f['name']}\n```json\n{f.get('arguments', '{}')}\n```", False), (CALL_END, True)]
    return [*parts, (CALLS_END, True)]


def output_parts(content: str) -> list[Part]:
    """A tool's result as the model reads it back, in parts: the markup, and the client's result."""
    return [(OUTPUTS_BEGIN + OUTPUT_BEGIN, True), (content, False), (OUTPUT_END + OUTPUTS_END, True)]


def parse_calls(text: str) -> tuple[str, list[ParsedCall]]:
    """(content before the calls, the calls) of a whole reply; no markup: (text, [])."""
    content, sep, rest = text.partition(CALLS_BEGIN)
    if not sep:
        return text, []
    return content, [ParsedCall(m["name"].strip(), m["arguments"]) for m in _CALL.finditer(rest)]


class StreamedCalls:
    """A streamed reply's content and calls: content goes out until the calls begin (a possible start
    of the markup is held back), then each call goes out whole as its end marker arrives."""

    def __init__(self) -> None:
        self.text = ""
        self._content_sent = 0
        self._calls_sent = 0

    def feed(self, delta: str, finished: bool = False) -> tuple[str, list[ParsedCall]]:
        """(new content, newly completed calls) after `delta`."""
        self.text += delta
        content, calls = parse_calls(self.text)
        if CALLS_BEGIN not in self.text and not finished:
            content = _without_partial_marker(content, CALLS_BEGIN)
        new_content = content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(content))
        new_calls = calls[self._calls_sent :]
        self._calls_sent = len(calls)
        return new_content, new_calls

    @property
    def called(self) -> bool:
        return self._calls_sent > 0


def _without_partial_marker(text: str, marker: str) -> str:
    """`text` less a tail that could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size]
    return text
