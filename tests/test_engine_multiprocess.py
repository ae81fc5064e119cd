"""The engine on multi-process layouts (real local worker processes on gloo): continuous batching,
preemption, prefix caching and MTP give the single process's tokens."""

from __future__ import annotations

import pytest
from tiny_models import add_byte_tokenizer, add_mtp_layer, make_hf_model

from moelaunch.engine.static_decode import GREEDY as GREEDY_STEP
from moelaunch.engine.static_decode import SAMPLED as SAMPLED_STEP
from moelaunch.engine.static_decode import StaticDecode
from moelaunch.launcher import LLM, SamplingParams

pytestmark = pytest.mark.slow

SHARED = [0] + list(range(20, 36))
PROMPTS = [[0, 5, 6, 7, 8, 9], [0] + [3] * 11, SHARED + [40], [0, 9, 10], SHARED + [50, 51], [0, 44] * 9]
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=5)
TIGHT = dict(kv_cache_memory=14 * 4 * (16 + 8) * 5 * 4, block_size=4)  # 14 blocks of 4 tokens, 4+1 layers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_hf_model(tmp_path_factory.mktemp("mp"), "v3", num_hidden_layers=4)
    return str(add_mtp_layer(add_byte_tokenizer(path)))


def mtp(speculative: str | None) -> dict:
    return {"speculative": speculative, "speculative_policy": "always"} if speculative else {}


def outputs(llm: LLM) -> list[list[int]]:
    greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return greedy + [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], SAMPLED)]


@pytest.fixture(scope="module")
def single(checkpoint):
    """One process's outputs, without and with MTP (sampling with drafts draws differently, so MTP
    drafts on every step here: the auto policy's timing-driven choices would move the draws)."""
    results = {}
    for speculative in (None, "mtp"):
        with LLM(checkpoint, kv_cache_memory=4_000_000, **mtp(speculative)) as llm:
            results[speculative] = outputs(llm)
    return results


@pytest.mark.parametrize(
    "layout, options",
    [
        (dict(tp=2), dict(TIGHT, **mtp("mtp"))),  # preemption, prefix reuse and MTP, heads split
        (dict(dp=2), dict(mtp("mtp"), kv_cache_memory=4_000_000, block_size=4)),  # EP over 2 replicas
        (dict(pp=2), dict(TIGHT)),  # two stages, two micro-batches in flight
    ],
)
def test_multiprocess_engine_matches_one_process(checkpoint, single, layout, options):
    with LLM(checkpoint, **layout, **options) as llm:
        assert outputs(llm) == single[options.get("speculative")]
        engine = llm.engine
        assert engine.blocks.stats.prefix_hit_tokens > 0  # SHARED's full blocks were reused
        if options.get("speculative"):
            assert engine.stats.spec_drafted > 0
        if options["kv_cache_memory"] == TIGHT["kv_cache_memory"]:
            assert engine.scheduler.preemptions > 0


@pytest.mark.parametrize("layout", [dict(tp=2), dict(dp=2)], ids=["tp2", "dp2"])
def test_draft_policy_switches_keep_greedy_tokens(checkpoint, single, layout):
    """Rank 0's draft decisions (scripted: on, off, on again) reach every rank with the step: a replica's
    ranks drop and take up drafts together (at dp=2 the MTP layer's experts are exchanged between the
    replicas on every step, drafting or not). The greedy tokens stay plain decoding's."""
    with LLM(checkpoint, **layout, kv_cache_memory=4_000_000, speculative="mtp", max_num_seqs=2) as llm:
        steps = []
        llm.engine.draft_policy.drafts = lambda batch: steps.append(batch) or not 3 <= len(steps) < 8
        greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert greedy == single[None][: len(PROMPTS)]
        assert llm.engine.stats.spec_drafted > 0 and len(steps) > 16  # a sequence started after step 8


def test_static_decode_at_tp2_has_no_sync(checkpoint, single, monkeypatch):
    """Every rank's decode steps take the static step under the guard that fails on a sync; experts
    split over the two ranks run on the device and are summed with one all-reduce."""
    monkeypatch.setenv("MOELAUNCH_STRICT_DECODE", "1")
    with LLM(checkpoint, tp=2, kv_cache_memory=4_000_000, block_size=4) as llm:
        static = llm.engine.runner.static
        assert static is not None
        runs, run = [], static.run
        static.run = lambda chunks, variant: runs.append(variant) or run(chunks, variant)
        assert outputs(llm) == single[None]
        assert set(runs) == {GREEDY_STEP, SAMPLED_STEP}  # seeded rows drew inside the step on both ranks


def test_static_decode_rebuilt_after_a_rebalance_at_tp2(checkpoint, single, monkeypatch):
    """EPLB at tp2 (dp 1: the experts are summed on the device): each rebalance gives the ranks 5 of the
    10 expert slots, a new shape for the static step's stacks, which is rebuilt; it still runs without
    a sync and gives one process's tokens."""
    monkeypatch.setenv("MOELAUNCH_STRICT_DECODE", "1")
    steps, run = [], StaticDecode.run
    monkeypatch.setattr(StaticDecode, "run", lambda self, c, v: steps.append(id(self)) or run(self, c, v))
    eplb = {"window": 3, "interval": 4, "redundant_experts": 2}
    with LLM(checkpoint, tp=2, kv_cache_memory=4_000_000, block_size=4, eplb=eplb) as llm:
        assert outputs(llm) == single[None]
        engine = llm.engine
        assert engine.rebalances >= 2
        for placement in engine.placements().values():
            assert [sum(r in o for o in placement.owners) for r in (0, 1)] == [5, 5]
    assert len(set(steps)) > 1  # decode steps ran through more than one static step
