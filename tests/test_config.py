"""config.json reading: both rope spellings, family defaults, and clear errors."""

from __future__ import annotations

import json

import pytest

from moelaunch.model.config import ConfigError, args_from_hf_config, load_args

BASE = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
)
YARN = {"factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def test_rope_scaling_and_rope_parameters_spellings_agree():
    old = args_from_hf_config({**BASE, "rope_theta": 5000.0, "rope_scaling": {"type": "yarn", **YARN}})
    new = args_from_hf_config(
        {**BASE, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, **YARN}}
    )
    assert old == new
    assert old.rope_theta == 5000.0 and old.rope_scaling.factor == 40 and old.rope_scaling.enabled


def test_v3_defaults_noaux_tc_sigmoid_and_v2_defaults_softmax():
    v3 = args_from_hf_config({**BASE, "model_type": "deepseek_v3"})
    assert (v3.topk_method, v3.scoring_func, v3.uses_expert_bias) == ("noaux_tc", "sigmoid", True)
    v2 = args_from_hf_config({**BASE, "model_type": "deepseek_v2"})
    assert (v2.topk_method, v2.scoring_func, v2.uses_expert_bias) == ("greedy", "softmax", False)


def test_null_q_lora_rank_means_plain_q_proj():
    assert args_from_hf_config({**BASE, "q_lora_rank": None}).q_lora_rank == 0


def test_softmax_scale_includes_yarn_mscale_squared():
    args = args_from_hf_config({**BASE, "rope_scaling": {"type": "yarn", **YARN}})
    mscale = 0.1 * 1.0 * __import__("math").log(40) + 1.0
    assert args.softmax_scale == pytest.approx((8 + 4) ** -0.5 * mscale**2)


def test_published_configs_load():
    for name, layers, experts in [("deepseek-v3-671b", 61, 256), ("deepseek-v2-236b", 60, 160),
                                  ("deepseek-v2-lite-16b", 27, 64)]:  # fmt: skip
        args = load_args(f"configs/models/{name}.json")
        assert (args.num_hidden_layers, args.n_routed_experts) == (layers, experts)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": None}, "lacks hidden_size"),
        ({"scoring_func": "relu"}, "scoring_func 'relu'"),
        ({"topk_method": "magic"}, "topk_method 'magic'"),
        ({"n_group": 3}, "not divisible by n_group"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope type 'linear'"),
    ],
)
def test_bad_configs_name_the_field(tmp_path, change, message):
    cfg = {**BASE, **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message) as err:
        load_args(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


def test_missing_and_invalid_config_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_args(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_args(tmp_path)


def test_published_parameter_counts_on_meta_device():
    """Shapes built from the published configs give the published sizes (671B main model, 236B, 16B)."""
    import torch

    from moelaunch.model import Transformer

    for name, billions in [
        ("deepseek-v3-671b", 671.0),
        ("deepseek-v2-236b", 235.7),
        ("deepseek-v2-lite-16b", 15.7),
    ]:
        with torch.device("meta"):
            model = Transformer(load_args(f"configs/models/{name}.json"), with_mtp=False)
        assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.1)
