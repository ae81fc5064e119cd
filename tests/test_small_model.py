"""The shipped small model (checkpoints/small): it loads in our loader and in transformers with the same
logits, it still solves the task family, and the script that trained it runs end to end."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelaunch.launcher.bundled.task_model import DEFAULT_CHECKPOINT, TaskModel
from moelaunch.launcher.bundled.tasks import held_out, held_out_sample, is_correct, training_stream
from moelaunch.launcher.bundled.train_small.__main__ import main as train_main
from moelaunch.launcher.cli import main as cli_main
from moelaunch.model import load_model

CKPT = DEFAULT_CHECKPOINT


@pytest.fixture(scope="module")
def task_model() -> TaskModel:
    return TaskModel.load(CKPT)


def test_checkpoint_is_a_small_deepseek_v3():
    cfg = json.loads((CKPT / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (
        cfg["num_nextn_predict_layers"] == 1 and cfg["q_lora_rank"] and cfg["rope_scaling"]["type"] == "yarn"
    )
    assert cfg["first_k_dense_replace"] >= 1 and cfg["topk_group"] < cfg["n_group"] > 1
    assert sum(f.stat().st_size for f in CKPT.iterdir()) <= 20 * 2**20


def test_chat_template_and_special_ids(task_model):
    tok = task_model.tokenizer
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    text = tok.apply_chat_template([{"role": "user", "content": "Reverse abc"}])
    assert text == "<｜begin▁of▁sentence｜><｜User｜>Reverse abc<｜Assistant｜>"
    assert tok.decode(tok.encode("What is 12+3?")) == "What is 12+3?"


def test_logits_match_transformers(task_model):
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
    problem = held_out_sample(1)[0]
    ids = torch.tensor([task_model.prompt_ids(problem.prompt) + task_model.tokenizer.encode(problem.answer)])
    with torch.no_grad():
        expected = reference(ids).logits
        ours = task_model.model(ids)
    assert (ours - expected).abs().max().item() <= 1e-4


def test_mtp_layer_is_loaded(task_model):
    assert len(task_model.model.mtp) == 1


def test_held_out_is_fixed_and_disjoint_from_training():
    assert len({p.prompt for p in held_out()}) == len(held_out()) >= 500
    prompts = {p.prompt for p in held_out()}
    stream = training_stream(seed=0)
    assert not any(next(stream).prompt in prompts for _ in range(5000))


def test_accuracy_on_held_out_sample(task_model):
    """The shipped model still solves the task family (0.98 on 500 problems, see docs/benchmarks.md;
    target 0.95): a broken loader, kernel or generate path scores far lower."""
    problems = held_out_sample(40)
    right = sum(is_correct(p, task_model.reply(p.prompt)) for p in problems)
    assert right / len(problems) >= 0.95


def test_eval_command_without_mtp_weights(tmp_path, capsys):
    # A variant with the MTP layer stripped (as a pruned or converted checkpoint may be) still scores.
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(CKPT / name, tmp_path / name)
    tensors = load_file(CKPT / "model.safetensors")
    mtp_prefix = f"model.layers.{json.loads((CKPT / 'config.json').read_text())['num_hidden_layers']}."
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith(mtp_prefix)}, tmp_path / "model.safetensors"
    )
    assert cli_main(["eval", "--model", str(tmp_path), "--n", "5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "MTP draft acceptance: n/a" in "\n".join(lines)
    assert re.fullmatch(r"accuracy=[01]\.\d{4} n=5", lines[-1])


def test_training_script_smoke(tmp_path):
    out = tmp_path / "tiny"
    assert train_main(["--out", str(out), "--tiny", "--steps", "3", "--batch", "8"]) == 0
    model = load_model(out)
    assert len(model.mtp) == 1
    assert model(torch.tensor([[0, 3, 6]])).shape == (1, 3, model.args.vocab_size)


def test_accuracy_through_the_engine_with_mtp():
    """The same floor through the path `launch` and the API take: the engine, chat template, batching,
    paged cache and MTP speculative decoding."""
    from moelaunch.launcher import LLM, SamplingParams

    problems = held_out_sample(40)
    greedy = SamplingParams(temperature=0, max_tokens=32)
    with LLM(str(CKPT), speculative="mtp") as llm:
        outs = llm.chat([[{"role": "user", "content": p.prompt}] for p in problems], greedy)
        acceptance = llm.engine.stats.spec_acceptance
    right = sum(is_correct(p, o.outputs[0].text.strip()) for p, o in zip(problems, outs, strict=True))
    assert right / len(problems) >= 0.95
    assert acceptance is not None and acceptance > 0.5
