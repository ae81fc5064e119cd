"""Per-request sampling settings, in the vLLM spelling, checked when made.

This is the one declaration of the sampling fields (type, default, allowed values, meaning): the server's
request bodies, a batch file's lines and a deployment file's job section take theirs from
`SamplingParams.model_fields` (sampling_fields), so a new field is added here only.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic.fields import FieldInfo

# Seeds seed a torch.Generator, which takes a signed 64-bit value.
MAX_SEED = 2**63 - 1


def _stop_strings(value: Any) -> Any:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return _listed(value, "a string or a list of strings")


def _token_ids(value: Any) -> Any:
    return _listed(value, "a list of token ids")


def _listed(value: Any, allowed: str) -> Any:
    # JSON and YAML give lists; the params keep tuples (frozen, hashable).
    if isinstance(value, list):
        return tuple(value)
    if not isinstance(value, tuple):
        raise ValueError(f"must be {allowed}")
    return value


def _top_k(value: int) -> int:
    if value != -1 and value < 1:
        raise ValueError("must be -1 (no limit) or a count >= 1")
    return value


class SamplingParams(BaseModel):
    # strict: true is not 1 and 1.5 tokens is not a count; frozen: one request's settings, shared by
    # its samples and sent to every rank.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    temperature: float = Field(1.0, ge=0, allow_inf_nan=False, description="randomness; 0 means greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="sample from the smallest set of tokens this likely")
    top_k: Annotated[int, AfterValidator(_top_k)] = Field(
        -1, description="sample from the k likeliest tokens; -1: no limit"
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

    def __init__(self, **values: Any) -> None:
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
