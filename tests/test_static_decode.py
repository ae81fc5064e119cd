"""The static decode step: no host sync or data-dependent op inside it (under a dispatch mode that
fails on one), the eager engine's tokens with it, compiled with fullgraph per bucket without
recompiles, and its count of device ops per layer."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch.engine.static_decode import GREEDY, LOGITS, LOGPROBS, SAMPLED, StaticDecode, decode_buckets
from moelaunch.engine.step_ops import StepOps, SyncError
from moelaunch.engine.warm_up import warm_up_decode
from moelaunch.launcher import LLM, SamplingParams
from moelaunch.measure.random_checkpoint import write_random_checkpoint
from moelaunch.model.attention import MLA
from moelaunch.model.decode_heads import DecodeHeadWeights
from moelaunch.model.moe import MoE

BUNDLED = Path(__file__).resolve().parents[1] / "checkpoints" / "small"
SAMPLED_PARAMS = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=6, ignore_eos=True, seed=3)


@pytest.fixture(scope="module")
def v3_model(tmp_path_factory) -> str:
    """V3 features at test sizes: sigmoid routing with a bias, group-limited top-k, shared experts."""
    return str(add_byte_tokenizer(make_hf_model(tmp_path_factory.mktemp("v3"), "v3", num_hidden_layers=4)))


def prompts(n: int) -> list[list[int]]:
    return [[1] + [5 + (7 * i + j) % 50 for j in range(3 + i % 5)] for i in range(n)]


def tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate(prompts(len(params)), params)
    return [o.outputs[0].token_ids for o in outs]


def python_files_run(fn: Callable[[], object]) -> set[str]:
    """The source files of the Python functions that run while fn does."""
    files: set[str] = set()

    def record(frame, event, arg) -> None:
        if event == "call":
            files.add(frame.f_code.co_filename)

    sys.setprofile(record)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return files


def count_static_runs(llm: LLM) -> list[tuple[int, str]]:
    """Wraps the static step's run to record each call's batch size and variant."""
    static = llm.engine.runner.static
    assert static is not None, "the engine did not build the static decode step"
    runs, run = [], static.run
    static.run = lambda chunks, variant: runs.append((len(chunks), variant)) or run(chunks, variant)
    return runs


def test_buckets_pad_to_powers_of_two_then_steps_of_eight():
    assert decode_buckets(1) == [1]
    assert decode_buckets(3) == [1, 2, 4]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 24]
    assert decode_buckets(64)[-3:] == [48, 56, 64]


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.sum().item(),
        lambda t: torch.bincount(t.long().abs()),
        lambda t: t[t > 0],
        lambda t: torch.nonzero(t),
        lambda t: torch.unique(t),
        lambda t: torch.repeat_interleave(t.long().abs()),
    ],
    ids=["item", "bincount", "bool-index", "nonzero", "unique", "repeat_interleave"],
)
def test_the_guard_fails_on_syncs_and_data_dependent_ops(op):
    t = torch.randn(16)
    with pytest.raises(SyncError), StepOps(strict=True):
        op(t)
    with StepOps() as seen:  # counting only: recorded, not raised
        op(t)
    assert seen.syncs


@pytest.mark.parametrize("which", ["bundled", "v3"])
def test_static_step_has_no_sync_and_gives_the_eager_tokens(which, v3_model, monkeypatch):
    model = str(BUNDLED) if which == "bundled" else v3_model

    # Lengths differ so the batch shrinks through several buckets, and the variant changes as rows end:
    # a penalty (the step returns logits) up to token 4, log-probabilities up to 6, sampling up to 7,
    # then greedy only.
    def seeded(max_tokens: int, seed: int, **options) -> SamplingParams:
        return SamplingParams(temperature=0.8, max_tokens=max_tokens, seed=seed, ignore_eos=True, **options)

    params = (
        [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(6)]
        + [SAMPLED_PARAMS] * 3
        + [seeded(4, 5, presence_penalty=0.5, logprobs=2), seeded(6, 9, logprobs=3), seeded(7, 11, top_p=0.9)]
    )
    options = dict(kv_cache_memory=8_000_000, block_size=4, max_num_seqs=16)
    with LLM(model, **options) as llm:
        assert llm.engine.runner.static is None  # compile auto on the CPU: eager
        expected = llm.generate(prompts(len(params)), params)
    monkeypatch.setenv("MOELAUNCH_STRICT_DECODE", "1")  # the static step, under StepOps(strict=True)
    with LLM(model, **options) as llm:
        runs = count_static_runs(llm)
        got = llm.generate(prompts(len(params)), params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    for o, e in zip(got[-3:-1], expected[-3:-1], strict=True):  # log-probabilities from the step
        assert o.outputs[0].token_logprobs == pytest.approx(e.outputs[0].token_logprobs, abs=1e-4)
        for top, want in zip(o.outputs[0].logprobs, e.outputs[0].logprobs, strict=True):
            assert top.keys() == want.keys() and list(top.values()) == pytest.approx(
                list(want.values()), abs=1e-4
            )
    assert len({n for n, _ in runs}) >= 3, runs
    assert [v for _, v in runs] == sorted((v for _, v in runs), key=[LOGITS, LOGPROBS, SAMPLED, GREEDY].index)
    assert {v for _, v in runs} == {LOGITS, LOGPROBS, SAMPLED, GREEDY}, runs


def mixed_params(lengths: list[int]) -> list[SamplingParams]:
    """Greedy, and seeded temperature, top-k, top-p and min-p rows in turn."""
    kinds = [
        dict(temperature=0),
        dict(temperature=0.8),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.1, top_p=0.8),
        dict(temperature=1.2, min_p=0.1),
    ]
    return [
        SamplingParams(**kinds[i % len(kinds)], max_tokens=n, ignore_eos=True, seed=100 + i)
        for i, n in enumerate(lengths)
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype"),
    [("none", "auto"), ("int8", "auto"), ("int4", "auto"), ("none", "fp8")],
)
def test_compiled_step_three_buckets_no_recompile_same_tokens(v3_model, quantization, kv_cache_dtype):
    """fullgraph=True raises on any graph break; one graph per bucket, none added by later steps. The
    compiled step samples inside itself and gives the eager engine's tokens; the same seeds twice give
    the same tokens. Integer weights too: their C++ kernels trace as custom ops, their experts with device
    offsets; and the FP8 cache, whose quantizing store writes the pool in place from the graph."""
    from torch._dynamo.utils import counters

    # 64 requests: 61 stop after 3 tokens, 2 after 5, 1 after 7: decode batches 64, 64, 3, 3, 1, 1. The
    # last three sample (top-k, top-p, min-p), so every step is the SAMPLED variant.
    params = mixed_params([3] * 61 + [5, 5, 7])
    options = dict(
        kv_cache_memory=16_000_000,
        block_size=8,
        max_num_seqs=64,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )
    with LLM(v3_model, **options) as llm:
        expected = tokens(llm, params)
    torch._dynamo.reset()
    with LLM(v3_model, compile="on", **options) as llm:
        runs = count_static_runs(llm)
        graphs_before = counters["stats"]["unique_graphs"]
        made = []  # MLA's absorbed stacks were made by the priming step: no graph remakes them per call
        remake = DecodeHeadWeights._made
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(DecodeHeadWeights, "_made", lambda *a: made.append(1) or remake(*a))
            assert tokens(llm, params) == expected
        assert not made
        static = llm.engine.runner.static
        assert sorted({static.bucket(n) for n, _ in runs}) == [1, 4, 64]
        assert {v for _, v in runs} == {SAMPLED}
        assert counters["stats"]["unique_graphs"] - graphs_before == 3
        assert tokens(llm, params) == expected  # the same buckets and seeds again: nothing recompiles
        assert counters["stats"]["unique_graphs"] - graphs_before == 3
        # The compiled step calls its kernels from C++ (the graph's C++ wrapper, the kernels' C++
        # registrations): no Python of the model, the kernels or torch's custom-op layer runs inside it.
        with torch.inference_mode():
            files = python_files_run(lambda: static.step_fn(static.buffers[1], SAMPLED))
        inside = ("/moelaunch/kernels/", "/moelaunch/model/", "/torch/_library/")
        assert not {f for f in files if any(part in f for part in inside)}


@pytest.mark.slow
def test_module_state_is_fixed_in_a_compiled_step_until_it_is_rebuilt(v3_model):
    """The compiled step skips dynamo's guards on the model's modules (a tenth of a millisecond a step):
    a module attribute changed afterwards compiles nothing new, and Engine.rebuild_static_decode (what
    an expert placement runs) brings it in: the tokens of an eager engine with the same change."""
    from torch._dynamo.utils import counters

    def scale_routed_experts(llm: LLM) -> None:  # ten times the routed experts' weight in each sum
        for module in llm.engine.runner.model.modules():
            if isinstance(module, MoE):
                module.gate.scale *= 10

    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]
    options = dict(kv_cache_memory=4_000_000, max_num_seqs=1)
    with LLM(v3_model, **options) as llm:
        before = tokens(llm, params)
        scale_routed_experts(llm)
        changed = tokens(llm, params)
    assert changed != before
    torch._dynamo.reset()
    with LLM(v3_model, compile="on", **options) as llm:
        assert tokens(llm, params) == before
        graphs = counters["stats"]["unique_graphs"]
        scale_routed_experts(llm)
        tokens(llm, params)  # the prompt step eager (new scale), the decode steps compiled (old scale)
        assert counters["stats"]["unique_graphs"] == graphs
        llm.engine.rebuild_static_decode()
        assert tokens(llm, params) == changed


def test_a_quantized_kv_b_is_dequantized_to_the_models_dtype(v3_model):
    """A bf16 model's integer kv_b_proj: its absorbed decode stacks are bf16 like a plain bf16 kv_b (fp32
    stacks, the rows' dtype on the CPU, read twice the bytes a step)."""
    options = dict(kv_cache_memory=4_000_000, max_num_seqs=2, dtype="bfloat16", quantization="int8")
    with LLM(v3_model, **options) as llm:
        tokens(llm, [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
        attention = [m for m in llm.engine.runner.model.modules() if isinstance(m, MLA)]
        assert attention and all(m.kv_b_proj.quant is not None for m in attention)
        for m in attention:
            stacks = m._decode_heads._stacks or m._decode_einsum._stacks
            assert stacks is not None and {s.dtype for s in stacks} == {torch.bfloat16}


@pytest.mark.slow
def test_warm_up_compiles_every_bucket_before_traffic(v3_model):
    """What `launch serve` runs before it listens under compile: on: after it, greedy and sampled
    batches of every bucket's size compile nothing more."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    options = dict(kv_cache_memory=16_000_000, block_size=8, max_num_seqs=4, cuda_graph_sizes=[1, 4])
    with LLM(v3_model, compile="on", **options) as llm:
        graphs_before = counters["stats"]["unique_graphs"]
        sizes, _ = warm_up_decode(llm.engine, llm.spec.engine)
        assert sizes == [1, 4]
        assert counters["stats"]["unique_graphs"] - graphs_before == 4  # 2 sizes x greedy, sampled
        runs = count_static_runs(llm)
        for n in (4, 1):
            tokens(llm, [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)] * n)
            tokens(llm, [SAMPLED_PARAMS] * n)
        assert sorted({(llm.engine.runner.static.bucket(n), v) for n, v in runs}) == [
            (1, GREEDY), (1, SAMPLED), (4, GREEDY), (4, SAMPLED)
        ]  # fmt: skip
        assert counters["stats"]["unique_graphs"] - graphs_before == 4


# Device ops per layer of a batch-1 static decode step on the V3 shape below: 19.4 measured (23.4 before
# SiLU gating went into the gate/up products' epilogue, the router's GEMM into its routing kernel and the
# q_a norm into the latent's norm-and-rotary kernel; 30.6 before the sort, add-norm and combine fusions).
OPS_PER_LAYER_BUDGET = 20
V3_SHAPE = dict(
    num_hidden_layers=8,
    first_k_dense_replace=0,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=2,
    n_group=8,
    topk_group=4,
)


def test_ops_per_decode_step_on_the_v3_shape(tmp_path):
    path = write_random_checkpoint(tmp_path / "v3-8x64", "tiny", "v3", 0, decisive_routing=True, **V3_SHAPE)
    with LLM(str(path), kv_cache_memory=4_000_000, max_num_seqs=8, skip_tokenizer_init=True) as llm:
        engine = llm.engine
        static = StaticDecode(engine.model, engine.cache, 8, 64, torch.device("cpu"), compile=False)
        with torch.inference_mode(), StepOps() as seen:
            static.forward(static.buffer(1), GREEDY)
    assert not seen.syncs
    per_layer = seen.total / V3_SHAPE["num_hidden_layers"]
    assert per_layer <= OPS_PER_LAYER_BUDGET, (per_layer, seen.ops.most_common())


@pytest.mark.parametrize(
    ("options", "named"),
    [(dict(cuda_graph_sizes=[0, 8]), "cuda_graph_sizes"), (dict(cuda_graph_sizes=[]), "cuda_graph_sizes"),
     (dict(compile="fast"), "compile"), (dict(cuda_graphs="yes"), "cuda_graphs")],
)  # fmt: skip
def test_bad_compile_and_graph_settings_are_refused_before_loading(options, named):
    from moelaunch.engine.config import EngineConfig

    with pytest.raises(ValueError, match=named):
        EngineConfig(**options)
