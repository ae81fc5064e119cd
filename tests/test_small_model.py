"""The shipped small model (checkpoints/small): it loads in our loader and in transformers with the same
logits, it still solves the task family through the engine, single questions and later turns of a
conversation, and the script that trained it runs end to end."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelaunch.launcher.cli import main as cli_main
from moelaunch.measure.scoring import DEFAULT_CHECKPOINT, GREEDY, accuracy, ask, open_engine
from moelaunch.model import load_model
from moelaunch.model.expert_load import ExpertLoad
from moelaunch.tasks.problem_sets import (
    conversations_sample,
    held_out,
    held_out_conversations,
    held_out_sample,
    messages,
    training_conversations,
)
from moelaunch.text.tokenizer import Tokenizer
from moelaunch.training.small_model.__main__ import main as train_main

CKPT = DEFAULT_CHECKPOINT
# Exact match the shipped checkpoint must keep through the engine: issue 21's targets, 0.97 single and
# 0.95 on turns 2-6 (it scores 0.985 and 0.991 on these samples, expert load 1.20 at most).
SINGLE_FLOOR, LATER_FLOOR = 0.97, 0.95
MAX_LOAD = 1.3  # max/mean tokens per expert on any MoE layer, also issue 21's
# Real English words, which training never draws on purpose (issue 33: "reverse Launcher" got the
# out-of-scope reply while any random string of its length was reversed).
ENGLISH_REVERSE_FLOOR, ENGLISH_COUNT_FLOOR = 0.95, 0.9


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(CKPT)


def test_checkpoint_is_a_small_deepseek_v3():
    cfg = json.loads((CKPT / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (
        cfg["num_nextn_predict_layers"] == 1 and cfg["q_lora_rank"] and cfg["rope_scaling"]["type"] == "yarn"
    )
    assert cfg["first_k_dense_replace"] >= 1 and cfg["topk_group"] < cfg["n_group"] > 1
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid" and cfg["n_shared_experts"]
    assert sum(f.stat().st_size for f in CKPT.iterdir()) <= 20 * 2**20


def test_chat_template_and_special_ids(tokenizer):
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Reverse abc"}])
    assert text == "<｜begin▁of▁sentence｜><｜User｜>Reverse abc<｜Assistant｜>"
    for typed in ("What's 123 + 456?", "Reverse DeepSeek", "Sort 9, 3, 77"):
        assert tokenizer.decode(tokenizer.encode(typed)) == typed


def test_logits_match_transformers(tokenizer):
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
    ours = load_model(CKPT)
    conversation = held_out_conversations()[0]
    ids = torch.tensor([tokenizer.encode_chat(messages(conversation), add_generation_prompt=False)])
    with torch.no_grad():
        assert (ours(ids) - reference(ids).logits).abs().max().item() <= 1e-4


def test_held_out_sets_are_fixed_and_disjoint_from_training():
    assert len({p.prompt for p in held_out()}) == len(held_out()) == 1000
    conversations = held_out_conversations()
    assert sum(map(len, conversations)) == 1000 and all(2 <= len(c) <= 6 for c in conversations[:-1])
    prompts = {p.prompt for p in held_out()} | {p.prompt for c in conversations for p in c}
    stream = training_conversations(seed=0)
    asked = [p for _ in range(2000) for p in next(stream)]
    assert not any(p.prompt in prompts for p in asked if p.kind != "other")


def test_accuracy_through_the_engine():
    """The shipped model still answers through the engine, MTP on: 200 single questions, and turns 2-6
    of conversations asked after the model's own replies. The floors are issue 21's targets (the full
    held-out figures are in docs/benchmarks.md); a broken loader, kernel, cache, history, think-section
    or speculative path scores far lower."""
    llm = open_engine(CKPT)
    try:
        with ExpertLoad(llm.engine.model) as load:
            single = ask(llm, [(p,) for p in held_out_sample(200)])
        later = [a for a in ask(llm, conversations_sample(150)) if a.turn > 1]
        acceptance = llm.engine.stats.spec_acceptance
    finally:
        llm.shutdown()
    assert accuracy(single) >= SINGLE_FLOOR, [(a.problem.prompt, a.output) for a in single if not a.correct]
    assert accuracy(later) >= LATER_FLOOR and len(later) >= 100
    assert acceptance is not None and acceptance >= 0.9
    assert max(load.imbalance().values()) <= MAX_LOAD, load.imbalance()


def test_english_words_through_launch_eval(capsys):
    with open_engine(CKPT) as llm:
        reply = llm.chat([{"role": "user", "content": "reverse Launcher"}], GREEDY)[0].outputs[0].text
    assert reply == "rehcnuaL"
    assert cli_main(["eval", "--english"]) == 0
    out = capsys.readouterr().out
    scores = {
        kind: float(v) for kind, v in re.findall(r"^  (reverse|count) +\d+/99 +(\S+)$", out, re.MULTILINE)
    }
    assert scores["reverse"] >= ENGLISH_REVERSE_FLOOR and scores["count"] >= ENGLISH_COUNT_FLOOR, out
    assert out.strip().endswith("n=198")


def test_eval_command_without_mtp_weights(tmp_path, capsys):
    # A variant with the MTP layer stripped (as a pruned or converted checkpoint may be) still scores.
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(CKPT / name, tmp_path / name)
    tensors = load_file(CKPT / "model.safetensors")
    mtp_prefix = f"model.layers.{json.loads((CKPT / 'config.json').read_text())['num_hidden_layers']}."
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith(mtp_prefix)}, tmp_path / "model.safetensors"
    )
    load_file_out = tmp_path / "load.json"
    argv = ["eval", "--model", str(tmp_path), "--n", "8", "--multi-turn"]
    assert cli_main([*argv, "--expert-load-out", str(load_file_out)]) == 0
    out = capsys.readouterr().out
    load = json.loads(load_file_out.read_text())
    args = json.loads((CKPT / "config.json").read_text())
    assert load["format"] == "moelaunch-expert-load/1" and load["tokens"] > 0
    moe_layers = [str(i) for i in range(args["first_k_dense_replace"], args["num_hidden_layers"])]
    assert list(load["counts"]) == moe_layers  # no MTP layer in this checkpoint
    assert all(sum(c) == load["tokens"] * args["num_experts_per_tok"] for c in load["counts"].values())
    assert re.search(r"^  layer \d+: \d\.\d\d$", out, re.MULTILINE)
    assert "MTP draft acceptance: n/a" in out and "per turn:" in out and "per form:" in out
    assert re.search(r"^  2 +\d+/\d+", out, re.MULTILINE)  # turn 2 has a row
    assert re.fullmatch(r"accuracy=[01]\.\d{4} n=(\d+)", out.strip().splitlines()[-1])


def test_training_script_smoke(tmp_path):
    out = tmp_path / "tiny"
    assert (
        train_main(["--out", str(out), "--tiny", "--steps", "3", "--batch", "2", "--routing-steps", "2"]) == 0
    )
    model = load_model(out)
    assert len(model.mtp) == 1
    assert model(torch.tensor([[0, 3, 6]])).shape == (1, 3, model.args.vocab_size)
