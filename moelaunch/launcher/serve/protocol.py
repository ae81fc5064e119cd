"""The OpenAI request bodies the server accepts, validated into the engine's SamplingParams.

The sampling fields are SamplingParams' own (OpenAI's names and defaults, with vLLM's extensions:
top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, bad_words,
allowed_token_ids, structured_outputs); max_tokens and logprobs are mapped from their OpenAI forms
here, and response_format, vLLM's guided_* fields and tool_choice become structured_outputs. Every
other OpenAI and vLLM field is declared too: acted on, accepted as a no-op, or refused with a reason
(unsupported.py). A null value means the field's default, as clients send it. Unknown fields are kept
aside (`unknown_fields`) for the handler to log or refuse.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from moelaunch.engine.sampling_params import SamplingParams, sampling_fields
from moelaunch.launcher.serve import unsupported
from moelaunch.launcher.serve.tools import NamedToolChoice, Tool, tool_call_schema


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Request(BaseModel):
    """What every request body has besides its sampling fields."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    best_of: int | None = Field(None, ge=1)
    modalities: list[str] | None = None
    user: str | None = None  # the client: its requests queue behind each other, not behind others'

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, body: Any) -> Any:
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        sampling = self.model_dump(include=set(_WIRE_SAMPLING), by_alias=True)
        # min_tokens is capped by the max_tokens that the context leaves, not refused.
        sampling["min_tokens"] = min(sampling["min_tokens"], max_tokens)
        sampling["structured_outputs"] = self.structured()
        return SamplingParams(**sampling, max_tokens=max_tokens, logprobs=logprobs)

    def structured(self) -> dict[str, Any] | None:
        """The one structured-output constraint asked for, in SamplingParams' form; ValueError when
        several are given."""
        asked = {}
        if self.structured_outputs is not None:
            asked["structured_outputs"] = self.structured_outputs.model_dump(
                by_alias=True, exclude_defaults=True
            )
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}  # fmt: skip
        for kind, value in guided.items():
            if value is not None:
                asked[f"guided_{kind}"] = {kind: value}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked["response_format"] = {"json_object": True}
        if fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.json_schema if fmt.json_schema else None
            asked["response_format"] = {"json": schema} if schema is not None else {"json_object": True}
        asked.update(self._tool_structure())
        if len(asked) > 1:
            raise ValueError(f"give one output constraint, not {' and '.join(asked)}")
        return next(iter(asked.values()), None)

    def _tool_structure(self) -> dict[str, Any]:
        return {}

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for the first field whose value asks for something this server cannot do."""
        for name in (*unsupported.REFUSED_UNLESS, "modalities"):
            why = unsupported.refusal(name, getattr(self, name, None))
            if why is not None:
                return name, why
        if self.best_of is not None and self.best_of != self.n:
            rule = (
                "must be >= n"
                if self.best_of < self.n
                else "> n is not implemented (it ranks by log-probability)"
            )
            return "best_of", f"best_of: {rule} (given best_of {self.best_of}, n {self.n}); leave it out"
        return None

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# SamplingParams' fields, with OpenAI's bounds on temperature and n; max_tokens and logprobs have their
# OpenAI names and forms in each request type.
_WIRE_SAMPLING = sampling_fields(exclude={"max_tokens", "logprobs"}, temperature=Field(le=2), n=Field(le=16))
_DECLARED = {name: (Any, None) for name in (*unsupported.NO_OPS, *unsupported.REFUSED_UNLESS)}
_Sampling = create_model("_Sampling", __base__=_Request, **_DECLARED, **_WIRE_SAMPLING)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "input_text", "refusal"]
    text: str = ""
    refusal: str = ""


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str = ""
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id...: passed to the chat template
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_text", "refusal"):
                raise ValueError(f"the model reads text only; a content part of type {kind!r} is refused")
        return value

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text or p.refusal for p in content)
        message = {**(self.model_extra or {}), "role": self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return message


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)

    def texts(self) -> list[tuple[str, str]]:
        """(field, text) of every message's content, for the checks on the text itself."""
        return [
            (f"messages.{i}.content", m.as_template_input()["content"]) for i, m in enumerate(self.messages)
        ]

    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None  # OpenAI's deprecated spelling of tools
    function_call: Literal["none", "auto"] | dict[str, str] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tools_from_functions(self) -> ChatCompletionRequest:
        if self.functions is not None and self.tools is None:
            self.tools = [Tool.model_validate({"type": "function", "function": f}) for f in self.functions]
        if self.function_call is not None and self.tool_choice is None:
            fc = self.function_call
            self.tool_choice = (
                fc
                if isinstance(fc, str)
                else NamedToolChoice.model_validate({"type": "function", "function": fc})
            )
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {self.tool_choice.function.name!r}, not one of the tools {names}"
                )
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    @property
    def tool_mode(self) -> str:
        """none (tools not offered), auto, required or named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def _tool_structure(self) -> dict[str, Any]:
        # required and named are kept by a grammar, so even a model never trained for tools calls one.
        if self.tool_mode not in ("required", "named"):
            return {}
        named = self.tool_choice.function.name if self.tool_mode == "named" else None
        return {"tool_choice": {"json": tool_call_schema(self.tools, named, self.parallel_tool_calls)}}

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Prompt) -> Prompt:
        if value == "" or value == [] or any(v in ("", []) for v in value if isinstance(v, (str, list))):
            raise ValueError("a prompt must not be empty")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs

    def texts(self) -> list[tuple[str, str]]:
        """(field, text) of every text the request carries, for the checks on the text itself."""
        return [("prompt", p) for p in self.prompts() if isinstance(p, str)]

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)
