"""The engine's routed-load record (a device ring of the last N steps) against an offline count of the
same tokens (ExpertLoad's hooks on the gates), in eager steps and in the static decode step, whose
padding rows it must leave out; and engine.eplb's refusals before the model loads."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from prometheus_client import generate_latest
from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch.engine.config import EngineConfig, EplbConfig
from moelaunch.engine.eplb import check_eplb, redundant_expert_bytes
from moelaunch.engine.routed_load import LoadReport
from moelaunch.engine.static_decode import StaticDecode
from moelaunch.launcher import LLM, SamplingParams
from moelaunch.launcher.serve.metrics import ServeMetrics
from moelaunch.model import load_model
from moelaunch.model.config import load_args
from moelaunch.model.expert_load import ExpertLoad
from moelaunch.model.expert_load_file import read_expert_load, write_expert_load
from moelaunch.parallel.expert_parallel import ExpertPlacement
from moelaunch.parallel.mesh import MeshShape

PROMPTS = [[5, 6, 7, 8, 9], [3] * 11, [9, 10]]  # three decodes: batch bucket 4, one padding row
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
WINDOW = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(add_byte_tokenizer(make_hf_model(tmp_path_factory.mktemp("load"), "v3", num_hidden_layers=4)))


def run_counted(
    checkpoint: str, offline_too: bool = True
) -> tuple[list[torch.Tensor], LoadReport, list[list[int]]]:
    """Step the engine by hand: the offline per-step counts [layers, E] (offline_too: the hooks' count
    reads each step's ids back, a host sync), the engine's report, the tokens."""
    with LLM(checkpoint, kv_cache_memory=2_000_000, block_size=4, expert_load_window=WINDOW) as llm:
        engine = llm.engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, GREEDY)
        per_step, tokens = [], {}
        offline = ExpertLoad(engine.model)
        with offline if offline_too else contextlib.nullcontext():
            while engine.has_unfinished():
                offline.reset()
                for out in engine.step():
                    tokens[out.request_id] = out.outputs[0].token_ids
                per_step.append(torch.stack(list(offline.counts.values())))
        return per_step, engine.read_expert_load(), [tokens[str(i)] for i in range(len(PROMPTS))]


def test_recorded_load_equals_offline_count(checkpoint, tmp_path):
    per_step, report, _ = run_counted(checkpoint)
    assert report.layer_ids == [1, 2, 3]  # layer 0 is dense
    assert torch.equal(report.total, sum(per_step))
    assert torch.equal(report.window, sum(per_step[-WINDOW:]))  # the ring keeps the last WINDOW steps
    assert report.steps == len(per_step) and report.window_steps == WINDOW
    routed = sum(map(len, PROMPTS)) + len(PROMPTS) * (GREEDY.max_tokens - 1)
    assert report.tokens(report.total) == routed
    out = tmp_path / "load.json"  # what `launch plan --expert-load` reads back
    write_expert_load(out, report.tokens(report.total), report.by_layer(report.total))
    read = read_expert_load(out, load_args(checkpoint))
    assert read.tokens == routed and read.layers == (1, 2, 3) and torch.equal(read.counts, report.total)


def test_static_decode_records_without_sync_or_padding(checkpoint, monkeypatch):
    """Decode steps through the static step under the guard that fails on a host sync, padded to 4
    rows: the record equals the eager run's (the padding row is not counted)."""
    _, eager, eager_tokens = run_counted(checkpoint)
    monkeypatch.setenv("MOELAUNCH_STRICT_DECODE", "1")
    padded, run = [], StaticDecode.run
    monkeypatch.setattr(
        StaticDecode, "run", lambda self, c, v: padded.append(self.bucket(len(c)) - len(c)) or run(self, c, v)
    )
    _, static, static_tokens = run_counted(checkpoint, offline_too=False)
    assert any(padded)  # the static step ran, with padding rows
    assert static_tokens == eager_tokens
    assert torch.equal(static.total, eager.total)
    assert torch.equal(static.window, eager.window)


def test_recording_is_off_by_default(checkpoint):
    with LLM(checkpoint, kv_cache_memory=2_000_000) as llm:
        assert llm.engine.load is None
        with pytest.raises(ValueError, match="set expert_load_window"):
            llm.engine.read_expert_load()
        with pytest.raises(ValueError, match="tp\\*dp > 1 and pp = 1, not tp=1 dp=1 pp=1"):
            llm.engine.set_expert_placement({1: [[0]] * 8})


def test_eplb_refused_before_the_model_loads(checkpoint, monkeypatch):
    import moelaunch.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "load_shard", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match=r"tp=1, dp=1.*nothing to balance; use tp\*dp > 1"):
        LLM(checkpoint, eplb={"window": 4, "interval": 4})


@pytest.mark.parametrize(
    "shape, eplb, message",
    [
        ((2, 1, 2), {}, "pp=1 layouts only"),
        ((1, 2, 1), {"redundant_experts": 3}, "11 slots do not split over ep=2"),
        ((1, 2, 1), {"redundant_experts": 10}, "at most 8 redundant experts"),
    ],
)
def test_eplb_layout_refusals(checkpoint, shape, eplb, message):
    with pytest.raises(ValueError, match=message):
        check_eplb(EplbConfig(**eplb), load_args(checkpoint), MeshShape(*shape))


def test_eplb_config_refusals():
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        EngineConfig(eplb={"window": 0})
    with pytest.raises(ValueError, match="redundant_experts"):
        EngineConfig(eplb={"redundant_experts": -1})


def test_expert_load_window_and_eplb_window_agree():
    with pytest.raises(ValueError, match="expert_load_window=5.*eplb.window=4"):
        EngineConfig(expert_load_window=5, eplb={"window": 4})


def test_metrics_of_a_report():
    """Per layer: max/mean tokens per expert and routed rows per EP rank (an expert's copies share its
    rows); per EP rank: rows over all layers. Never one series per expert."""
    window = torch.tensor([[10, 0, 0, 2], [3, 3, 3, 3]])
    placement = ExpertPlacement(((0,), (1,), (1,), (0, 1)), 2)
    report = LoadReport([1, 2], window, window, 7, 3, 2, {1: placement, 2: placement}, rebalances=2)
    metrics = ServeMetrics()
    metrics.expert_load(report)
    text = generate_latest(metrics.registry).decode()

    def value(series: str) -> float:
        return float(re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE).group(1))

    assert value('moelaunch_expert_load_imbalance{layer="1"}') == pytest.approx(10 / 3)
    assert value('moelaunch_expert_load_imbalance{layer="2"}') == 1.0
    assert value('moelaunch_ep_rank_load_imbalance{layer="1"}') == pytest.approx(11 / 6)  # ranks: 11, 1
    assert value('moelaunch_ep_rank_routed_rows{ep_rank="0"}') == 11 + 3 + 1.5
    assert value('moelaunch_ep_rank_routed_rows{ep_rank="1"}') == 1 + 6 + 1.5
    assert value("moelaunch_expert_load_window_tokens") == 6  # 12 pairs, 2 experts per token
    assert value("moelaunch_eplb_rebalances") == 2
    assert text.count("moelaunch_expert_load_imbalance{") == 2


def test_eplb_keeps_room_for_the_redundant_copies(checkpoint):
    """Each rank ends up with (experts + redundant) / ep experts per MoE layer: the KV budget leaves
    room for the ones it does not hold yet."""
    model = load_model(checkpoint)
    args = model.args
    per_expert = 3 * args.hidden_size * args.moe_intermediate_size * model.weight_dtype().itemsize
    moe_layers = len(args.moe_layer_ids()) - args.num_nextn_predict_layers  # no MTP layer here
    # One process holds all 8 experts: at ep=1 the 2 copies are 2 more in every layer.
    assert redundant_expert_bytes(model, EplbConfig(redundant_experts=2), 1) == 2 * moe_layers * per_expert
