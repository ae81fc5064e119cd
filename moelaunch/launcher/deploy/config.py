"""The deployment file (cluster.yaml): its schema, loading with `--set key.path=value` overrides, and
errors that name the file, the key path, what was given and what is allowed.

One file describes a deployment on every backend: `cluster.backend` picks where the ranks run (this
machine, a Ray cluster, a Slurm allocation); `job.mode` picks what they do. A new job mode is one more
class in `JobConfig`; a new backend adds its own section beside `cluster.slurm`.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from moelaunch.engine.config import EngineConfig
from moelaunch.engine.sampling_params import SamplingParams, sampling_fields
from moelaunch.model.quantization import Quantization
from moelaunch.model.weight_spec import WeightDtype
from moelaunch.text.files import read_text

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "local.yaml"

# Keys holding file paths: relative ones resolve against the YAML file's directory, or against the
# working directory when they come from --set (where the user typed them).
PATH_KEYS = (("model",), ("job", "input"), ("job", "output"), ("parallel", "expert_placement_file"))


class DeployConfigError(ValueError):
    """A deployment file that cannot be used; the message names the file, the key and the fix."""


class _Strict(BaseModel):
    # strict: YAML already types its scalars, so "8" for an int is a mistake, not something to coerce.
    model_config = ConfigDict(extra="forbid", strict=True)


class ParallelConfig(_Strict):
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per replica (heads, dense MLP, vocab)")
    dp: int = Field(1, ge=1, description="data-parallel replicas (DP attention)")
    pp: int = Field(1, ge=1, description="pipeline stages")
    ep: int | None = Field(None, ge=1, description="expert-parallel ranks; always dp*tp, given only to check")
    expert_placement: list[list[int]] | None = Field(
        None, description="owners[e] = EP ranks holding expert e (default: contiguous blocks)"
    )
    expert_placement_file: str | None = Field(
        None,
        description="a placement per MoE layer, copies included (JSON written by `launch plan --expert-load "
        "FILE --write-placement OUT.json`); layers it leaves out keep expert_placement",
    )


class Timeouts(_Strict):
    startup_s: float = Field(600, gt=0, description="wait for devices and workers to come up")
    collective_s: float = Field(600, gt=0, description="longest wait inside one collective")


# What a value written into an `#SBATCH` line may hold: Slurm names and lists of them, nothing a shell or
# the script's line structure would read (no spaces, quotes, $, ;, newlines).
SBATCH_VALUE = r"^[A-Za-z0-9_.,:+@%/=-]+$"


class SlurmConfig(_Strict):
    partition: str | None = Field(None, pattern=SBATCH_VALUE, description="a partition name (or a list: a,b)")
    account: str | None = Field(None, pattern=SBATCH_VALUE)
    # Slurm's formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
    time: str = Field("01:00:00", pattern=r"^(\d+-)?\d+(:\d+){0,2}$")
    gpus_per_node: int | None = Field(None, ge=0, description="--gpus-per-node; default devices_per_node")
    extra_args: list[Annotated[str, Field(pattern=r"^--[a-z][a-z-]*(=[A-Za-z0-9_.,:+@%/=-]+)?$")]] = Field(
        default_factory=list, description="more #SBATCH options, e.g. --qos=high"
    )

    @field_validator("time", mode="before")
    @classmethod
    def _time_is_quoted(cls, value: Any) -> Any:
        if isinstance(value, int):
            # YAML 1.1 reads unquoted 1:00:00 as the base-60 number 3600.
            raise ValueError(
                f'given {value}; allowed: a quoted Slurm time such as "01:00:00" or "1-00:00:00"'
            )
        return value


class ClusterConfig(_Strict):
    backend: Literal["local", "ray", "slurm"] = "local"
    address: str = Field("auto", description="ray: auto (start an embedded cluster) or host:port of a head")
    nodes: int = Field(1, ge=1)
    devices_per_node: int | None = Field(
        None,
        ge=1,
        description="GPUs, or CPU worker slots on CPU-only machines; default: what the layout needs per node",
    )
    device: Literal["auto", "cuda", "cpu"] = "auto"
    device_memory_gb: float | None = Field(
        None, gt=0, description="memory of one device in GB (1e9 B); cpu: RAM per worker slot"
    )
    memory_fraction: float = Field(0.9, gt=0, le=1, description="share of a device the plan may fill")
    env: dict[str, str] = Field(default_factory=dict, description="environment pushed to every worker")
    timeouts: Timeouts = Field(default_factory=Timeouts)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)

    @field_validator("env", mode="before")
    @classmethod
    def _env_values_as_text(cls, value: Any) -> Any:
        # `OMP_NUM_THREADS: 4` is an int in YAML but a string in the environment.
        if isinstance(value, dict):
            return {
                k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v
                for k, v in value.items()
            }
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"given variable name {name!r}; allowed: letters, digits and _")
        return value


class _Job(_Strict):
    def sampling(self) -> dict[str, Any]:
        """The job's sampling fields, as SamplingParams takes them."""
        return self.model_dump(include=set(_JOB_SAMPLING))

    @model_validator(mode="after")
    def _sampling_params(self) -> _Job:
        SamplingParams(**self.sampling())  # the checks across fields (min_tokens <= max_tokens)
        return self


# A chat or batch job's sampling fields: SamplingParams' own but for n (one reply per turn or line),
# with longer replies and some randomness by default.
_JOB_SAMPLING = sampling_fields(exclude={"n"}, max_tokens=Field(256), temperature=Field(0.6))
_Sampling = create_model("_Sampling", __base__=_Job, **_JOB_SAMPLING)


class ChatJob(_Sampling):
    mode: Literal["chat"] = "chat"


class BatchJob(_Sampling):
    mode: Literal["batch"]
    input: str = Field(min_length=1, description="path of the prompts file (JSON lines)")
    output: str = Field(
        min_length=1, description="path of the results file (JSON lines; a rerun skips finished ids)"
    )


class BenchJob(_Strict):
    mode: Literal["bench"]
    num_requests: int = Field(64, ge=1)
    input_len: int = Field(256, ge=1)
    output_len: int = Field(128, ge=1)
    output: str | None = Field(None, description="path to write the results as JSON too")


class ServeJob(_Strict):
    """An OpenAI-compatible HTTP server on rank 0 (its settings: the `server` section)."""

    mode: Literal["serve"]


API_KEY_ENV = "MOELAUNCH_API_KEY"


class ServerConfig(_Strict):
    host: str = Field(
        "127.0.0.1", min_length=1, description="address to bind; 0.0.0.0 exposes every interface"
    )
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port (printed on start)")
    api_key: str | None = Field(
        None, min_length=1, description="Bearer token every route but /health requires (or MOELAUNCH_API_KEY)"
    )
    served_model_name: str | None = Field(
        None, min_length=1, description="the model id; default: the dir name"
    )
    max_queue: int = Field(
        256, ge=0, description="sequences (prompts x n) waiting beyond the running batches; more get 429"
    )
    stall_timeout_s: float = Field(
        30.0,
        gt=0,
        description="an engine step longer than this (a rank stopped or too slow) fails the requests "
        "waiting on it and refuses new ones with 503 until the step completes",
    )
    max_body_bytes: int = Field(1_000_000, ge=1, description="largest request body accepted (413 beyond)")
    log_interval_s: float = Field(10.0, gt=0, description="seconds between throughput / cache-use log lines")
    strict: bool = Field(
        False, description="refuse (400) a request field the server does not know, not log it"
    )
    allow_special_tokens_in_content: bool = Field(
        False,
        description="read special-token markup in a chat message's content (<｜Assistant｜>) as control "
        "tokens; off: as text, so a client's user cannot forge an assistant turn",
    )

    @field_validator("api_key", mode="before")
    @classmethod
    def _no_empty_key(cls, value: Any) -> Any:
        # `--set server.api_key=` reads as null: a server without a key must come from leaving it out.
        if value is None or value == "":
            raise ValueError("given an empty key; allowed: a key, or no api_key for a server without one")
        return value

    def api_key_in_effect(self) -> str | None:
        """server.api_key, else MOELAUNCH_API_KEY; set but empty is a mistake, not "no key"."""
        if self.api_key is not None:
            return self.api_key
        from_env = os.environ.get(API_KEY_ENV)
        if from_env is not None and not from_env.strip():
            raise ValueError(
                f"{API_KEY_ENV} is set but empty: give it a key, or unset it for a server without one"
            )
        return from_env


JobConfig = Annotated[ChatJob | BatchJob | BenchJob | ServeJob, Field(discriminator="mode")]
JOB_MODES: dict[str, type[BaseModel]] = {
    get_args(cls.model_fields["mode"].annotation)[0]: cls for cls in get_args(get_args(JobConfig)[0])
}


class DeployConfig(_Strict):
    model: str = Field(min_length=1, description="a Hugging Face checkpoint directory or its config.json")
    dtype: WeightDtype = "auto"
    # Projections quantized at load (model/quantization.py); "none" runs the checkpoint as it is.
    quantization: Quantization = "none"
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    job: JobConfig = Field(default_factory=ChatJob)
    server: ServerConfig = Field(default_factory=ServerConfig)
    _source: str = PrivateAttr("<config>")

    @model_validator(mode="after")
    def _devices_the_layout_needs(self) -> DeployConfig:
        # Unset, a node has the devices its share of the layout needs (tp=2 on one node: 2), as LLM(tp=2)
        # needs no such setting; a layout that does not split over the nodes is left to the plan's message.
        c, world = self.cluster, self.parallel.tp * self.parallel.dp * self.parallel.pp
        if c.devices_per_node is None:
            c.devices_per_node = world // c.nodes if world % c.nodes == 0 else 1
        return self

    _overrides: dict[tuple[str, ...], str] = PrivateAttr(default_factory=dict)

    @property
    def source(self) -> str:
        """The YAML file this came from, for messages."""
        return self._source

    def error(self, path: str, given: Any, allowed: str) -> DeployConfigError:
        """A problem found after validation (by the plan, a backend), worded like the schema's own."""
        return DeployConfigError(_problem(self._source, self._overrides, path, given, allowed))


def load_deploy_config(path: str | Path | None = None, overrides: list[str] | None = None) -> DeployConfig:
    """Read, override and validate a deployment file (default: the embedded configs/local.yaml)."""
    file = Path(path) if path is not None else DEFAULT_CONFIG
    source = str(file)
    raw = _read_yaml(file)
    _resolve_paths(raw, file.resolve().parent)
    applied = _apply_overrides(raw, overrides or [], source)
    try:
        cfg = DeployConfig.model_validate(raw)
    except ValidationError as e:
        # unknown keys first: a misspelt key often explains a "missing" one
        errors = sorted(e.errors(include_url=False), key=lambda err: err["type"] != "extra_forbidden")
        raise DeployConfigError("\n".join(_explain(err, source, applied) for err in errors)) from None
    cfg._source, cfg._overrides = source, applied
    _check_consistency(cfg)
    return cfg


# --- reading ---------------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys; a second `parallel:` block is almost always a mistake."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml(file: Path) -> dict[str, Any]:
    try:
        text = read_text(file, "deployment file")
    except ValueError as e:
        raise DeployConfigError(
            f"{e}; give the path of a cluster YAML file (the embedded default is {DEFAULT_CONFIG})"
        ) from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown line"
        started = e.context_mark
        context = f" ({e.context} started at line {started.line + 1})" if e.context and started else ""
        raise DeployConfigError(f"{file}: YAML syntax error at {where}: {e.problem}{context}") from None
    if not isinstance(raw, dict):
        raise DeployConfigError(
            f"{file}: (top level): given {show_value(raw)}; allowed: a mapping with keys "
            f"{', '.join(DeployConfig.model_fields)}"
        )
    return raw


def _resolve_paths(raw: dict[str, Any], base: Path, only: tuple[str, ...] | None = None) -> None:
    for keys in PATH_KEYS if only is None else [only]:
        node = raw
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        value = node.get(keys[-1]) if isinstance(node, dict) else None
        if isinstance(value, str) and value:
            node[keys[-1]] = os.path.normpath(base / Path(value).expanduser())


def _apply_overrides(raw: dict[str, Any], overrides: list[str], source: str) -> dict[tuple[str, ...], str]:
    """Apply `key.path=value` (value parsed as a YAML scalar); return each overridden path -> its text."""
    applied: dict[tuple[str, ...], str] = {}
    for text in overrides:
        key, sep, value_text = text.partition("=")
        keys = tuple(key.strip().split("."))
        if not sep or not all(keys):
            raise DeployConfigError(
                f"{source}: --set {text}: expected KEY.PATH=VALUE, e.g. --set parallel.tp=8"
            )
        try:
            value = yaml.safe_load(value_text)
        except yaml.YAMLError:
            raise DeployConfigError(f"{source}: --set {text}: the value is not valid YAML") from None
        node = raw
        for depth, part in enumerate(keys[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(keys[: depth + 1])
                raise DeployConfigError(
                    f"{source}: --set {text}: {where} is {show_value(child)}, "
                    "not a mapping with keys under it"
                )
            node = child
        node[keys[-1]] = value
        applied[keys] = text
        if keys in PATH_KEYS:
            _resolve_paths(raw, Path.cwd(), only=keys)
    _switch_job_mode(raw, applied)
    return applied


def _switch_job_mode(raw: dict[str, Any], applied: dict[tuple[str, ...], str]) -> None:
    """`--set job.mode=chat` on a batch file keeps only the keys chat knows (max_tokens, temperature...),
    so switching modes from the command line does not trip over the old mode's keys."""
    job = raw.get("job")
    if ("job", "mode") not in applied or not isinstance(job, dict) or job.get("mode") not in JOB_MODES:
        return
    known = JOB_MODES[job["mode"]].model_fields
    raw["job"] = {k: v for k, v in job.items() if k in known or ("job", k) in applied}


# --- messages --------------------------------------------------------------------------------------


def _problem(source: str, applied: dict[tuple[str, ...], str], path: str, given: Any, allowed: str) -> str:
    return f"{source}: {path}: given {show_value(given)}{_from_set(applied, path)}; allowed: {allowed}"


def _from_set(applied: dict[tuple[str, ...], str], path: str) -> str:
    for keys, text in applied.items():
        key = ".".join(keys)
        # the error is at the overridden key, inside it, or at a key the override created on its way
        if path == key or path.startswith(key + ".") or key.startswith(path + "."):
            return f" (from --set {text})"
    return ""


def show_value(value: Any) -> str:
    """A value as messages quote it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_ALLOWED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "a list",
    "dict_type": "a mapping (key: value)",
    "string_too_short": "a non-empty string",
}


def _explain(err: dict[str, Any], source: str, applied: dict[tuple[str, ...], str]) -> str:
    """One line for one pydantic error, in the project's words."""
    parts, model = _walk(err["loc"])
    path = ".".join(parts) or "(top level)"
    kind, ctx = err["type"], err.get("ctx", {})
    if kind == "extra_forbidden":
        parent, key = ".".join(parts[:-1]), parts[-1]
        known = list(model.model_fields) if model else []
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        keys_of = f"{parent} keys" if parent else "top-level keys"
        return f"{source}: unknown key {path}{hint}{_from_set(applied, path)} ({keys_of}: {', '.join(known)})"
    if kind == "missing":
        field = model.model_fields.get(parts[-1]) if model else None
        what = field.description if field and field.description else "a value"
        return f"{source}: {path}: required key missing; allowed: {what}"
    if kind == "union_tag_not_found":
        return f"{source}: {path}.mode: required key missing; allowed: one of {', '.join(JOB_MODES)}"
    if kind == "union_tag_invalid":
        return _problem(source, applied, f"{path}.mode", ctx["tag"], f"one of {', '.join(JOB_MODES)}")
    if kind == "literal_error":
        allowed = f"one of {ctx['expected']}"
    elif kind in ("model_type", "model_attributes_type") and path == "job":
        allowed = f"a mapping with mode ({', '.join(JOB_MODES)}) and that mode's keys"
    elif kind in ("model_type", "model_attributes_type"):
        sub = _submodel_at(parts)
        allowed = f"a mapping with keys {', '.join(sub.model_fields)}" if sub else "a mapping"
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        ops = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
        bound = next(iter(ctx.values()))
        allowed = f"a number {ops[kind]} {bound}"
    elif kind == "string_pattern_mismatch":
        allowed = f"a string matching {ctx['pattern']}"
    elif kind == "value_error" and str(ctx["error"]).startswith("must be "):
        allowed = str(ctx["error"]).removeprefix("must be ")  # SamplingParams' rules
    elif kind == "value_error":
        # our validators write "given ...; allowed: ..." themselves
        return f"{source}: {path}: {ctx['error']}{_from_set(applied, path)}"
    else:
        allowed = _ALLOWED.get(kind, err["msg"])
    return _problem(source, applied, path, err["input"], allowed)


def _walk(loc: tuple[Any, ...]) -> tuple[list[str], type[BaseModel] | None]:
    """Key path of an error location (list indices as [i], union tags dropped) and the model owning its
    last key."""
    parts: list[str] = []
    model: type[BaseModel] | None = DeployConfig
    owner: type[BaseModel] | None = DeployConfig
    for item in loc:
        if isinstance(item, int) and parts:
            parts[-1] += f"[{item}]"
            continue
        if parts == ["job"] and item in JOB_MODES:
            model = owner = JOB_MODES[item]  # the discriminated union's tag, not a key
            continue
        owner = model
        parts.append(str(item))
        field = model.model_fields.get(str(item)) if model else None
        model = _model_in(field.annotation) if field else None
    return parts, owner


def _submodel_at(parts: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = DeployConfig
    for part in parts:
        field = model.model_fields.get(part) if model else None
        model = _model_in(field.annotation) if field else None
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found:
            return found
    return None


# --- checks across keys ----------------------------------------------------------------------------


def _check_consistency(cfg: DeployConfig) -> None:
    p, c = cfg.parallel, cfg.cluster
    if p.ep is not None and p.ep != p.dp * p.tp:
        raise cfg.error(
            "parallel.ep",
            p.ep,
            f"dp*tp = {p.dp}*{p.tp} = {p.dp * p.tp} (routed experts spread over every rank of a pipeline "
            "stage), or leave ep out",
        )
    if c.backend != "ray" and c.address != "auto":
        raise cfg.error("cluster.address", c.address, f"auto (backend {c.backend} starts its own processes)")
    if c.backend == "local" and c.nodes != 1:
        raise cfg.error("cluster.nodes", c.nodes, "1 with backend local (this machine); use ray or slurm")
    gpus = c.slurm.gpus_per_node
    if c.device != "cpu" and gpus is not None and gpus < c.devices_per_node:
        raise cfg.error(
            "cluster.slurm.gpus_per_node",
            gpus,
            f">= devices_per_node = {c.devices_per_node} (one GPU per rank)",
        )
