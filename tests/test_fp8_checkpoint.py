"""Block-FP8 checkpoints: made by `launch convert quantize-fp8`, loaded dequantized or kept as FP8
(W8A8 path), and converted back by `launch convert fp8-to-bf16`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch.launcher.cli import main as launch
from moelaunch.model import CheckpointReader, WeightSpec, load_model

IDS = torch.randint(2, 320, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    # transformers' own init scale: the decisive gates of the parity tests flip experts under FP8 noise
    original = make_hf_model(root / "orig", "v3", initializer_range=0.02)
    (original / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    assert launch(["convert", "quantize-fp8", str(original), str(root / "fp8")]) == 0
    assert launch(["convert", "fp8-to-bf16", str(root / "fp8"), str(root / "bf16")]) == 0
    return original, root / "fp8", root / "bf16"


def test_quantized_directory_looks_like_deepseeks(dirs):
    _, fp8, _ = dirs
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert (fp8 / "tokenizer_config.json").exists()
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight")
        s = f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv")
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (1, 1)
        # the latent projection is FP8 in DeepSeek's checkpoints, and `launch plan` counts it so
        assert f.get_tensor("model.layers.0.self_attn.kv_a_proj_with_mqa.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32


def test_fp8_model_equals_its_dequantized_bf16_twin(dirs):
    _, fp8, bf16 = dirs
    assert "quantization_config" not in json.loads((bf16 / "config.json").read_text())
    assert not any(n.endswith("_scale_inv") for n in CheckpointReader(bf16).names())
    a = load_model(WeightSpec(str(fp8), dtype="bfloat16"))(IDS)
    b = load_model(WeightSpec(str(bf16), dtype="bfloat16"))(IDS)
    assert torch.equal(a, b)  # same dequantized weights, same arithmetic


def test_fp8_model_stays_close_to_the_original(dirs):
    original, fp8, _ = dirs
    ref = load_model(original)(IDS)
    got = load_model(fp8)(IDS)
    diff = (got - ref).abs().max().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"fp8 weights vs fp32 original: max |dlogit| = {diff:.4f} (logit scale {ref.abs().max():.2f}), "
          f"argmax agreement {agree:.1%}")  # fmt: skip
    # e4m3 weights carry ~3% noise each; through 3 layers and the head that is ~10% of the logits
    assert diff < 0.25 * ref.abs().max().item() and agree >= 0.85


def test_round_trip_is_within_fp8_error(dirs):
    original, _, bf16 = dirs
    before, after = CheckpointReader(original), CheckpointReader(bf16)
    for name in before.names():
        w, w2 = before.read(name, torch.float32), after.read(name, torch.float32)
        # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value, at most amax/16 per block.
        assert (w2 - w).abs().max() <= w.abs().max() / 16 + 1e-6, name


def fake_fp8_activations(module: torch.nn.Module, inputs: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
    """W8A8's activation rounding, written out: per token and 128-column block, scale = amax / 448 and each
    value rounded to e4m3 (a block narrower than 128 is the whole row: zero padding changes no amax)."""
    (x,) = inputs
    blocks = x.float().unflatten(-1, (-1, min(128, x.shape[-1])))
    scale = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (((blocks / scale).to(torch.float8_e4m3fn).float() * scale).flatten(-2).to(x.dtype),)


def test_keeping_fp8_weights_runs_the_w8a8_path(dirs):
    """Kept as FP8, every FP8 projection (kv_a_proj_with_mqa too, as in DeepSeek's checkpoints) runs W8A8:
    the logits are those of the dequantized weights with each such projection's input rounded to e4m3."""
    _, fp8, _ = dirs
    kept = load_model(WeightSpec(str(fp8), dtype="fp8"))
    fp8_projections = {n for n, m in kept.named_modules() if getattr(m, "weight", None) is not None
                       and m.weight.dtype == torch.float8_e4m3fn}  # fmt: skip
    assert {
        "model.layers.1.mlp.experts.0.down_proj",
        "model.layers.0.self_attn.kv_a_proj_with_mqa",
    } <= fp8_projections
    ref_model = load_model(fp8)  # dequantized weights
    for name, module in ref_model.named_modules():
        if name in fp8_projections:
            module.register_forward_pre_hook(fake_fp8_activations)
    ref, got = ref_model(IDS), kept(IDS)
    diff = (got - ref).abs().max().item()
    print(f"W8A8 vs dequantized weights on e4m3-rounded activations: max |dlogit| = {diff:.2e}")
    assert diff <= 1e-4 * ref.abs().max().item()  # the same products, summed in another order


def test_w8a8_model_through_triton_kernels_in_the_interpreter(dirs, monkeypatch):
    _, fp8, _ = dirs
    kept = load_model(WeightSpec(str(fp8), dtype="fp8"))
    ids = IDS[:1, :6]
    expected = kept(ids)
    monkeypatch.setenv("MOELAUNCH_TRITON_ON_CPU", "1")
    assert (kept(ids) - expected).abs().max().item() <= 1e-3 * expected.abs().max().item()


def test_converting_an_fp8_checkpoint_again_is_refused(dirs, tmp_path, capsys):
    _, fp8, _ = dirs
    assert launch(["convert", "quantize-fp8", str(fp8), str(tmp_path / "x")]) == 1
    assert "already FP8" in capsys.readouterr().err


def test_converting_into_a_non_empty_directory_is_refused(dirs, tmp_path, capsys):
    original, _, _ = dirs
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "model.safetensors").write_bytes(b"something else")
    assert launch(["convert", "quantize-fp8", str(original), str(taken)]) == 1
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert (taken / "model.safetensors").read_bytes() == b"something else"  # nothing overwritten


def test_fp8_model_takes_the_static_decode_step_with_the_eager_tokens(tmp_path, monkeypatch):
    """Kept as FP8, the routed experts stack with their block scales, so the static decode step serves
    the model (on the CPU through the grouped MoE kernel's torch reference), with no sync inside it
    (MOELAUNCH_STRICT_DECODE=1) and the eager engine's tokens."""
    from test_static_decode import count_static_runs, prompts

    from moelaunch.launcher import LLM, SamplingParams

    original = add_byte_tokenizer(make_hf_model(tmp_path / "orig", "v3", initializer_range=0.02))
    assert launch(["convert", "quantize-fp8", str(original), str(tmp_path / "fp8")]) == 0
    params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(5)]
    options = dict(dtype="fp8", kv_cache_memory=8_000_000, block_size=4, max_num_seqs=8)

    def run() -> list[list[int]]:
        outs = llm.generate(prompts(len(params)), params)
        return [o.outputs[0].token_ids for o in outs]

    with LLM(str(tmp_path / "fp8"), **options) as llm:
        assert llm.engine.runner.static is None  # compile auto on the CPU: eager
        expert = llm.engine.runner.model.model.layers["1"].mlp.experts["0"].down_proj
        assert expert.weight.dtype == torch.float8_e4m3fn
        expected = run()
    monkeypatch.setenv("MOELAUNCH_STRICT_DECODE", "1")
    with LLM(str(tmp_path / "fp8"), **options) as llm:
        sizes = count_static_runs(llm)
        assert run() == expected
    assert len(set(sizes)) >= 3, sizes  # decode steps went through it, at several batch sizes
