"""Model arguments read from a Hugging Face `config.json` (DeepSeek-V2, V2-Lite and V3 spellings)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelaunch.text.files import is_missing, read_text


class ConfigError(ValueError):
    """A config.json that cannot describe a DeepSeek model; the message names the field and the fix."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters; `factor == 1` means plain RoPE."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None

    @property
    def enabled(self) -> bool:
        return self.factor > 1.0


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    kv_lora_rank: int
    q_lora_rank: int  # 0: plain q_proj (V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 0
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    quantization: dict[str, Any] | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale^2 under YaRN (the same rule as transformers)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs.enabled and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def uses_expert_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace and self.n_routed_experts > 0

    def moe_layer_ids(self) -> list[int]:
        """The MoE layers' indices, MTP layers (num_hidden_layers + k, as in the checkpoint) included."""
        return [
            i for i in range(self.num_hidden_layers + self.num_nextn_predict_layers) if self.is_moe_layer(i)
        ]

    @property
    def fp8_block_size(self) -> tuple[int, int] | None:
        """(128, 128) for a block-FP8 checkpoint, else None."""
        q = self.quantization
        if not q or q.get("quant_method") != "fp8":
            return None
        block = q.get("weight_block_size") or [128, 128]
        return int(block[0]), int(block[1])


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


def _rope_scaling(cfg: dict[str, Any]) -> tuple[float, RopeScaling]:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); older files use `rope_scaling`.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None) or "factor" not in params:
        return theta, RopeScaling()
    if kind != "yarn":
        raise ConfigError(f"rope type {kind!r} is not supported: DeepSeek models use 'yarn' or none")
    return theta, RopeScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 4096)),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
    )


# Integer settings and their least value: required ones must be there, optional ones may be absent or null.
_SIZES = {"vocab_size": 1, "hidden_size": 1, "intermediate_size": 1, "num_hidden_layers": 1,
          "num_attention_heads": 1, "kv_lora_rank": 1, "qk_nope_head_dim": 1, "qk_rope_head_dim": 1,
          "v_head_dim": 1}  # fmt: skip
_OPTIONAL_SIZES = {"moe_intermediate_size": 1, "n_routed_experts": 0, "n_shared_experts": 0,
                   "num_experts_per_tok": 0, "first_k_dense_replace": 0, "q_lora_rank": 0, "n_group": 1,
                   "topk_group": 1, "max_position_embeddings": 1, "num_nextn_predict_layers": 0}  # fmt: skip


def _check_sizes(cfg: dict[str, Any]) -> None:
    """Every size an integer at least its least value: a null, a string or -1 is named, not left to a
    TypeError or to the layout check (which would blame pp for num_hidden_layers = -1)."""
    for key, least in {**_SIZES, **_OPTIONAL_SIZES}.items():
        value = cfg.get(key)
        if value is None and key in _OPTIONAL_SIZES:
            continue
        if type(value) is not int or value < least:
            raise ConfigError(f"{key}: given {value!r}; allowed: an integer >= {least}")
    for key in ("routed_scaling_factor", "rms_norm_eps"):
        value = cfg.get(key)
        if value is not None and (type(value) not in (int, float) or value <= 0):
            raise ConfigError(f"{key}: given {value!r}; allowed: a number > 0")


def args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """Build ModelArgs from a parsed config.json, defaulting the way the model families do."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"config.json holds {type(cfg).__name__}, not an object of settings")
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}: is this a DeepSeek-V2/V3 config?")
    _check_sizes(cfg)
    is_v2 = cfg.get("model_type") == "deepseek_v2"
    # V3 files written by transformers omit these two; V2's defaults are softmax / greedy.
    scoring = cfg.get("scoring_func") or ("softmax" if is_v2 else "sigmoid")
    topk_method = cfg.get("topk_method") or ("greedy" if is_v2 else "noaux_tc")
    if scoring not in ("sigmoid", "softmax"):
        raise ConfigError(f"scoring_func {scoring!r} is not supported: use 'sigmoid' or 'softmax'")
    if topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
        raise ConfigError(
            f"topk_method {topk_method!r} is not supported: use noaux_tc, greedy or group_limited_greedy"
        )
    theta, rope_scaling = _rope_scaling(cfg)
    n_experts = int(cfg.get("n_routed_experts") or 0)
    n_group = int(cfg.get("n_group") or 1)
    if n_experts and n_experts % n_group:
        raise ConfigError(f"n_routed_experts={n_experts} is not divisible by n_group={n_group}")
    eos = cfg.get("eos_token_id", 1)
    args = ModelArgs(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=int(cfg["num_attention_heads"]),
        n_routed_experts=n_experts,
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        n_group=n_group,
        topk_group=int(cfg.get("topk_group") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        scoring_func=scoring,
        topk_method=topk_method,
        # V2 configs say norm_topk_prob false; transformers' V2 never normalizes.
        norm_topk_prob=bool(cfg.get("norm_topk_prob", not is_v2)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        bos_token_id=int(cfg.get("bos_token_id") or 0),
        eos_token_id=int(eos[0] if isinstance(eos, list) else (eos if eos is not None else 1)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        quantization=cfg.get("quantization_config"),
    )
    if args.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim={args.qk_rope_head_dim} must be even (rotary pairs)")
    if n_experts and args.num_experts_per_tok > n_experts:
        raise ConfigError(f"num_experts_per_tok={args.num_experts_per_tok} exceeds n_routed_experts")
    return args


def load_args(path: str | Path) -> ModelArgs:
    """Read `config.json` from a checkpoint directory (or the file itself)."""
    p = Path(path)
    # os.path.isdir: Path.is_dir raises PermissionError on a directory this user cannot search, and
    # read_text names that problem.
    file = p / "config.json" if os.path.isdir(p) else p
    if is_missing(file):
        raise ConfigError(f"{file} not found: a checkpoint directory needs a Hugging Face config.json")
    if p.suffix in (".safetensors", ".bin", ".pt"):
        raise ConfigError(f"{p} is a weights file: give the checkpoint directory ({p.parent})")
    try:
        cfg = json.loads(read_text(file, "config"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON ({e}): fix or re-download the file") from e
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        return args_from_hf_config(cfg)
    except ConfigError as e:
        raise ConfigError(f"{file}: {e}") from e
