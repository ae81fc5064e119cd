"""Per-request sampling settings, in the vLLM spelling, checked when made.

Penalties follow OpenAI and vLLM: presence and frequency over the generated tokens (subtracted from
the logits), repetition over prompt and generated tokens (positive logits divided, negative multiplied).

This is the one declaration of the sampling fields (type, default, allowed values, meaning): the server's
request bodies, a batch file's lines and a deployment file's job section take theirs from
`SamplingParams.model_fields` (sampling_fields), so a new field is added here only.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

# Seeds key the draws as int64 tensors (moelaunch.model.sampling.uniform): non-negative signed 64-bit.
MAX_SEED = 2**63 - 1


def _stop_strings(value: Any) -> Any:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return _listed(value, "a string or a list of strings")


def _token_ids(value: Any) -> Any:
    return _listed(value, "a list of token ids")


def _listed_or_none(value: Any) -> Any:
    return None if value is None else _listed(value, "a list")


def _listed(value: Any, allowed: str) -> Any:
    # JSON and YAML give lists; the params keep tuples (frozen, hashable).
    if isinstance(value, list):
        return tuple(value)
    if not isinstance(value, tuple):
        raise ValueError(f"must be {allowed}")
    return value


def _logit_bias(value: Any) -> Any:
    """{token id: bias} (JSON writes the ids as strings) to sorted (id, bias) pairs, biases clamped to
    [-100, 100] as OpenAI does."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, dict) else value
    if not isinstance(items, (list, tuple)) and not isinstance(value, dict):
        raise ValueError("must be a mapping of token id to bias")
    pairs = []
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError("must be a mapping of token id to bias")
        token, bias = item
        if isinstance(token, str) and token.isdigit():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"token id {token!r} is not a non-negative integer")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or bias != bias:
            raise ValueError(f"the bias of token {token} must be a number")
        pairs.append((token, float(min(max(bias, -100.0), 100.0))))
    return tuple(sorted(pairs))


def _json_text(value: Any) -> Any:
    # A schema given as an object or as JSON text is kept as canonical text (the params stay hashable).
    if isinstance(value, (dict, bool)):
        return json.dumps(value)
    if isinstance(value, str):
        try:
            return json.dumps(json.loads(value))
        except json.JSONDecodeError as e:
            raise ValueError(f"is not valid JSON: {e}") from None
    return value


class StructuredOutputs(BaseModel):
    """What the output must be (vLLM's structured_outputs): exactly one of these."""

    # json is the wire name; json_schema the attribute (BaseModel has a json method).
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    json_schema: Annotated[str | None, BeforeValidator(_json_text)] = Field(
        None, alias="json", description="a JSON schema the output validates against"
    )
    json_object: bool = Field(False, description="any JSON object")
    regex: str | None = Field(None, min_length=1, description="a regular expression the output matches")
    choice: Annotated[tuple[str, ...] | None, BeforeValidator(_listed_or_none)] = Field(
        None, min_length=1, description="the output is one of these strings"
    )
    grammar: str | None = Field(None, min_length=1, description="an EBNF grammar (GBNF/Lark-like)")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of json, json_object, regex, choice, grammar (given: {given or 'none'})"
            )
        return self

    def spec(self) -> tuple[str, str]:
        """(kind, text) as moelaunch.text.grammar compiles it; a choice's options joined by NUL."""
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", "\0".join(self.choice)
        kind = next(k for k in ("json_schema", "regex", "grammar") if getattr(self, k) is not None)
        return kind, getattr(self, kind)


def _top_k(value: int) -> int:
    if value < -1:
        raise ValueError("must be -1 or 0 (no limit) or a count >= 1")
    return value


class SamplingParams(BaseModel):
    # strict: true is not 1 and 1.5 tokens is not a count; frozen: one request's settings, shared by
    # its samples and sent to every rank.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    temperature: float = Field(1.0, ge=0, allow_inf_nan=False, description="randomness; 0 means greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="sample from the smallest set of tokens this likely")
    top_k: Annotated[int, AfterValidator(_top_k)] = Field(
        -1, description="sample from the k likeliest tokens; -1 or 0: no limit"
    )
    max_tokens: int = Field(16, ge=1, description="most tokens to generate")
    min_tokens: int = Field(0, ge=0, description="tokens before a stop token or EOS may end the output")
    stop: Annotated[tuple[Annotated[str, Field(min_length=1)], ...], BeforeValidator(_stop_strings)] = Field(
        (), description="strings that end the output (not included)"
    )
    stop_token_ids: Annotated[tuple[Annotated[int, Field(ge=0)], ...], BeforeValidator(_token_ids)] = Field(
        (), description="tokens that end the output (included)"
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="the draws' seed; None: unseeded")
    ignore_eos: bool = Field(False, description="generate past EOS up to max_tokens")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="how many top log-probabilities to return per token"
    )
    n: int = Field(1, ge=1, description="samples of the same prompt")
    presence_penalty: float = Field(
        0.0, ge=-2, le=2, description="subtracted from the logit of every token generated so far"
    )
    frequency_penalty: float = Field(
        0.0, ge=-2, le=2, description="subtracted from a token's logit once per time it was generated"
    )
    repetition_penalty: float = Field(
        1.0, gt=0, le=10, allow_inf_nan=False,
        description="a prompt or generated token's logit divided by it (multiplied when negative)",
    )  # fmt: skip
    logit_bias: Annotated[tuple[tuple[int, float], ...], BeforeValidator(_logit_bias)] = Field(
        (), description="added to the logits of these token ids ({id: bias}, bias in [-100, 100])"
    )
    min_p: float = Field(0.0, ge=0, le=1, description="drop tokens less likely than min_p * the likeliest")
    bad_words: Annotated[tuple[Annotated[str, Field(min_length=1)], ...], BeforeValidator(_stop_strings)] = (
        Field((), description="words never generated (their last token is banned after the others)")
    )
    allowed_token_ids: Annotated[
        tuple[Annotated[int, Field(ge=0)], ...] | None, BeforeValidator(_listed_or_none)
    ] = Field(None, min_length=1, description="only these tokens may be generated")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="a JSON schema, JSON object, regex, choice or grammar the output follows"
    )

    def __init__(self, **values: Any) -> None:
        # numpy scalars (a temperature from np.linspace, a count from an array) are numbers to a user;
        # strict validation would refuse them, so they become Python's own first.
        values = {k: v.item() if isinstance(v, np.generic) else v for k, v in values.items()}
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ValueError(_explain(e.errors(include_url=False)[0], values)) from None

    # Across fields, so a model made of sampling_fields leaves it to the SamplingParams it builds.
    @field_validator("min_tokens")
    @classmethod
    def _at_most_max_tokens(cls, value: int, info: ValidationInfo) -> int:
        if value > info.data.get("max_tokens", value):
            raise ValueError("must be in [0, max_tokens]")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _explain(err: dict[str, Any], values: dict[str, Any]) -> str:
    """`SamplingParams.<field>=<given> must be ...`: the field as the caller wrote it, and the rule."""
    name, *inner = err["loc"] or ("(params)",)
    given = values.get(name, err["input"])
    where = "".join(f" item {i}" if isinstance(i, int) else f".{i}" for i in inner)
    if err["type"] == "value_error":
        rule = str(err["ctx"]["error"])
    elif err["type"] == "extra_forbidden" and inner:
        rule = "is not a field here"
    elif err["type"] == "extra_forbidden":
        rule = f"is not a sampling field (fields: {', '.join(SamplingParams.model_fields)})"
    else:
        rule = err["msg"].replace("Input should be", "must be")
    field = SamplingParams.model_fields.get(name)
    meaning = f" ({field.description})" if field is not None else ""
    return f"SamplingParams.{name}={given!r}{where}: {rule}{meaning}"


def sampling_fields(exclude: set[str] = frozenset(), **changes: FieldInfo) -> dict[str, Any]:
    """SamplingParams' fields as `pydantic.create_model` takes them, less `exclude`, with `changes` (a
    field's other default, a tighter bound) merged into their declaration."""
    fields = {}
    for name, info in SamplingParams.model_fields.items():
        if name in exclude:
            continue
        if name in changes:
            info = FieldInfo.merge_field_infos(info, changes[name])
        fields[name] = (info.annotation, info)
    return fields
