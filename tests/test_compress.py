"""Pruning and distillation (launcher/compress): what each keeps, that the checkpoints load and
generate, exactness at the identity settings, and clear errors for bad arguments."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import add_byte_tokenizer, add_mtp_layer, make_hf_model

from moelaunch.launcher import LLM, SamplingParams
from moelaunch.launcher.cli import main
from moelaunch.model import load_model
from moelaunch.model.gate import Gate
from moelaunch.model.single_sequence import generate
from moelaunch.text.tokenizer import Tokenizer
from moelaunch.tools import distill as distill_module
from moelaunch.tools import expert_pruning, head_pruning
from moelaunch.tools.calibration import calibration_sequences
from moelaunch.tools.distill import (
    DEFAULT_TRAIN,
    DistillConfig,
    Distiller,
    check_config,
    distill,
    init_student,
)
from moelaunch.tools.distill_data import DistillData
from moelaunch.tools.expert_pruning import prune_experts
from moelaunch.tools.head_pruning import prune_heads
from moelaunch.tools.magnitude_pruning import prune_magnitude

PROMPTS = ["What is 12+34?", "Reverse hello", "Sort 42 7 19", "In banana, count a", "hello world " * 3]
IDS = torch.tensor([[0, 5, 9, 44, 71, 3, 100, 20, 8, 8, 250, 17]])
GREEDY = SamplingParams(temperature=0, max_tokens=6)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """8 routed experts in 2 groups (topk_group 1), 4 heads, 3 layers (1 dense) plus an MTP layer."""
    path = make_hf_model(tmp_path_factory.mktemp("tiny"), "v3")
    return add_mtp_layer(add_byte_tokenizer(path))


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    file = tmp_path_factory.mktemp("calib") / "prompts.txt"
    file.write_text("\n".join(PROMPTS) + "\n")
    return file


def logits(path) -> torch.Tensor:
    return load_model(path)(IDS)


def reference_routing(gate: Gate, x: torch.Tensor) -> torch.Tensor:
    """Expert ids chosen for x, written out from DeepSeek-V3's rule: sigmoid scores plus the bias, the
    topk_group groups with the best top-2 sums, then the top-k experts among them."""
    scores = torch.sigmoid(x.double() @ gate.weight.double().T) + gate.e_score_correction_bias.double()
    groups = scores.view(x.shape[0], gate.n_groups, -1)
    best_groups = groups.topk(2, dim=-1).values.sum(-1).topk(gate.topk_groups, dim=-1).indices
    allowed = torch.zeros_like(groups, dtype=torch.bool)
    allowed[torch.arange(x.shape[0])[:, None], best_groups] = True
    return scores.masked_fill(~allowed.flatten(1), float("-inf")).topk(gate.top_k, dim=-1).indices


def test_expert_pruning_keeps_the_most_used_experts(tiny, prompt_file, tmp_path):
    result = prune_experts(tiny, tmp_path / "out", 4, prompt_file)

    # Recount: every gate's inputs on the same prompts, routed by reference_routing.
    model = load_model(tiny)
    gates = {
        3 if name.startswith("mtp.") else int(name.split(".")[2]): g
        for name, g in model.named_modules()
        if isinstance(g, Gate)
    }
    recount = {layer: torch.zeros(8, dtype=torch.long) for layer in gates}

    def counter(layer: int):
        def hook(gate: Gate, inputs: tuple[torch.Tensor]) -> None:
            recount[layer] += torch.bincount(reference_routing(gate, inputs[0]).flatten(), minlength=8)

        return hook

    handles = [g.register_forward_pre_hook(counter(layer)) for layer, g in gates.items()]
    with torch.inference_mode():
        for seq in calibration_sequences(tiny, prompt_file):
            ids = torch.tensor([seq])
            model.mtp_logits(model.hidden_states(ids)[:, :-1], ids[:, 1:])
    for h in handles:
        h.remove()
    assert result.counts.keys() == recount.keys() == {1, 2, 3}
    for layer, counts in recount.items():
        assert torch.equal(result.counts[layer], counts)
        # Distinct counts make "the 4 most used" unambiguous.
        order = counts.argsort(descending=True).tolist()
        assert counts[order[3]] > counts[order[4]]
        assert result.kept[layer] == sorted(order[:4])

    before, after = load_file(tiny / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    for layer, kept in result.kept.items():
        prefix = f"model.layers.{layer}.mlp."
        assert torch.equal(after[prefix + "gate.weight"], before[prefix + "gate.weight"][kept])
        bias = "gate.e_score_correction_bias"
        assert torch.equal(after[prefix + bias], before[prefix + bias][kept])
        for new, old in enumerate(kept):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"experts.{{}}.{proj}.weight"
                assert torch.equal(after[prefix + name.format(new)], before[prefix + name.format(old)])
        assert f"{prefix}experts.4.up_proj.weight" not in after
        assert torch.equal(
            after[prefix + "shared_experts.up_proj.weight"], before[prefix + "shared_experts.up_proj.weight"]
        )
    assert json.loads((tmp_path / "out" / "config.json").read_text())["n_routed_experts"] == 4


def test_pruned_checkpoint_generates_through_the_llm_api(tiny, prompt_file, tmp_path):
    out = tmp_path / "out"
    prune_experts(tiny, out, 4, prompt_file)
    model = load_model(out)
    prompts = [[0, 7, 30, 41, 99], [0, 12, 5]]
    with LLM(str(out), kv_cache_memory=4_000_000) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [generate(model, p, GREEDY.max_tokens) for p in prompts]
    assert all(len(ids) == GREEDY.max_tokens for ids in got)


def test_pruning_to_every_expert_or_head_changes_nothing(tiny, prompt_file, tmp_path):
    prune_experts(tiny, tmp_path / "experts", 8, prompt_file)
    prune_heads(tiny, tmp_path / "heads", 4, prompt_file)
    reference = logits(tiny)
    assert torch.equal(logits(tmp_path / "experts"), reference)
    assert torch.equal(logits(tmp_path / "heads"), reference)


def test_head_pruning_equals_silencing_the_dropped_heads(tiny, prompt_file, tmp_path):
    """A head reaches the residual stream only through its o_proj columns: the pruned model computes
    what the original computes with the dropped heads' columns zeroed."""
    kept = prune_heads(tiny, tmp_path / "out", 2, prompt_file)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_attention_heads"] == 2
    model = load_model(tiny)
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            layer = 3 if name.startswith("mtp.") else int(name.split(".")[2])
            columns = module.o_proj.weight.view(module.o_proj.out_features, 4, -1)
            dropped = [h for h in range(4) if h not in kept[layer]]
            columns[:, dropped] = 0
    torch.testing.assert_close(logits(tmp_path / "out"), model(IDS), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits(tmp_path / "out"), logits(tiny), atol=1e-3)


@pytest.mark.parametrize("sparsity", [0.3, 0.9])
def test_magnitude_pruning_gives_the_asked_sparsity(tiny, tmp_path, sparsity):
    prune_magnitude(tiny, tmp_path / "out", sparsity)
    before, after = load_file(tiny / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    n_pruned = 0
    for name, w in after.items():
        if not name.endswith("_proj.weight"):
            assert torch.equal(w, before[name]), name
            continue
        n_pruned += 1
        zero = w == 0
        # Weights already zero (the MTP layer's eh_proj is mostly zeros) count towards the target.
        assert int(zero.sum()) == max(round(sparsity * w.numel()), int((before[name] == 0).sum())), name
        assert torch.equal(w[~zero], before[name][~zero])  # survivors unchanged
        assert before[name][zero].abs().max() <= before[name][~zero].abs().min()  # the smallest went
    assert n_pruned > 0
    load_model(tmp_path / "out")(IDS)


def test_two_of_four_pattern_holds_in_every_group(tiny, tmp_path):
    prune_magnitude(tiny, tmp_path / "out", 0.5, "2:4")
    before, after = load_file(tiny / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    for name, w in after.items():
        if name.endswith("_proj.weight"):
            groups, original = w.view(w.shape[0], -1, 4), before[name].view(w.shape[0], -1, 4).abs()
            # Two survivors per group, fewer only where the group held fewer non-zeros to begin with.
            assert torch.equal((groups != 0).sum(-1), (original != 0).sum(-1).clamp(max=2)), name
            kept_min = original.masked_fill(groups == 0, float("inf")).amin(-1)
            dropped_max = original.masked_fill(groups != 0, 0).amax(-1)
            assert bool((dropped_max <= kept_min).all()), name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--experts", "5"], "do not divide into n_group=2"),
        (["--experts", "12"], "has 8 routed experts"),
        (["--experts", "2", "--n-group", "2"], "best two"),
        (["--heads", "5"], "has 4 attention heads"),
        (["--sparsity", "0.3", "--pattern", "2:4"], "give --sparsity 0.5"),
    ],
)
def test_bad_prune_arguments_fail_before_loading(tiny, tmp_path, monkeypatch, capsys, args, message):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(expert_pruning, "load_model", no_load)
    monkeypatch.setattr(head_pruning, "load_model", no_load)
    assert main(["prune", str(tiny), str(tmp_path / "out"), *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("launch prune: error:") and message in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_prune_refuses_two_methods_and_a_non_empty_output(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["prune", str(tiny), str(tmp_path / "out"), "--experts", "4", "--heads", "2"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["prune", str(tiny), str(tmp_path / "full"), "--sparsity", "0.5"]) == 1
    assert "not an empty directory" in capsys.readouterr().err


def test_calibration_file_forms(tiny, tmp_path):
    """A text line is a user turn; JSON lines give a user turn or a whole conversation."""
    tok = Tokenizer.from_dir(tiny)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    (tmp_path / "p.txt").write_text("hi\n\n")
    (tmp_path / "p.jsonl").write_text(
        json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"messages": turns}) + "\n"
    )
    asked = tok.encode_chat(turns[:1])
    assert calibration_sequences(tiny, tmp_path / "p.txt") == [asked]
    assert calibration_sequences(tiny, tmp_path / "p.jsonl") == [
        asked,
        tok.encode_chat(turns, add_generation_prompt=False),
    ]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected"):
        calibration_sequences(tiny, tmp_path / "bad.jsonl")


def distill_config(tiny, prompt_file, out, steps: int = 6, **kw) -> DistillConfig:
    train = replace(DEFAULT_TRAIN, steps=steps, batch=4, warmup=2, save_every=3)
    return DistillConfig(
        teacher=tiny, out=out, layers=2, experts=4, features=True, prompts=prompt_file, train=train, **kw
    )


def kl_on_first_batch(cfg: DistillConfig, student_dir) -> float:
    distiller = Distiller(cfg, load_model(cfg.teacher), load_model(student_dir))
    with torch.no_grad():
        return distiller.losses(DistillData(cfg.teacher, cfg.prompts, 8, seed=1).batch_at(0)).kl.item()


def test_distillation_lowers_the_kl_and_resumes_where_it_stopped(tiny, prompt_file, tmp_path, monkeypatch):
    cfg = distill_config(tiny, prompt_file, tmp_path / "whole")
    history = distill(cfg)
    assert len(history) == 6
    start = distill_config(tiny, prompt_file, tmp_path / "start")
    init_student(start, load_model(tiny), check_config(start))
    assert kl_on_first_batch(cfg, cfg.out) < 0.8 * kl_on_first_batch(cfg, start.out)

    # The same run stopped by Ctrl-C at step 4 (state saved after step 3), then resumed.
    stopped = distill_config(tiny, prompt_file, tmp_path / "stopped")
    real_batch_at = DistillData.batch_at

    def interrupt_at_4(self, step):
        if step == 4:
            raise KeyboardInterrupt
        return real_batch_at(self, step)

    monkeypatch.setattr(DistillData, "batch_at", interrupt_at_4)
    with pytest.raises(KeyboardInterrupt):
        distill(stopped)
    monkeypatch.setattr(DistillData, "batch_at", real_batch_at)
    resumed = distill(replace(stopped, resume=True))
    assert resumed == history[3:]
    whole, again = load_file(cfg.out / "model.safetensors"), load_file(stopped.out / "model.safetensors")
    assert whole.keys() == again.keys()
    assert all(torch.equal(whole[name], again[name]) for name in whole)


def test_student_loads_and_generates(tiny, prompt_file, tmp_path):
    cfg = distill_config(tiny, prompt_file, tmp_path / "student", steps=2)
    distill(cfg)
    config = json.loads((cfg.out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["n_routed_experts"], config["first_k_dense_replace"]) == (
        2,
        4,
        1,
    )
    model = load_model(cfg.out)
    assert len(model.mtp) == 1  # the MTP layer comes along
    prompts = [[0, 7, 30, 41, 99], [0, 12, 5]]
    with LLM(str(cfg.out), kv_cache_memory=4_000_000) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [generate(model, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "2", "--experts", "5"], "do not divide into n_group=2"),
        (["--layers", "4", "--experts", "4"], "has 3 decoder layers"),
        (["--layers", "2", "--experts", "4", "--resume"], "not found"),
    ],
)
def test_bad_distill_arguments_fail_before_loading(tiny, tmp_path, monkeypatch, capsys, args, message):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(distill_module, "load_model", no_load)
    assert main(["distill", str(tiny), str(tmp_path / "out"), *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("launch distill: error:") and message in err and "\n" not in err
