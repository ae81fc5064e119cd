"""The dtype conversions of one eager decode step of a bfloat16 model on the CPU (bf16 weights and cache,
fp32 rows: WeightSpec.compute_dtype), counted by StepOps, against a budget per layer.

Each conversion the step needs: a bf16 GEMM's rows in and its output out (decode batches above
LINEAR_KERNEL_MAX_ROWS, where oneDNN's GEMM beats the kernel), the latent into the bf16 cache, the bf16
embedding rows out. Below that batch the kernels read bf16 weights as stored and convert nothing but the
latent and the embedding. What the budget catches: a conversion per step of something that does not
change between steps, such as a weight (the absorbed attention's W_UK and W_UV once were, 2 per layer of
H x (nope + v) x C elements each step), or conversions back and forth around an op.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_hf_model

from moelaunch.engine.step_ops import StepOps
from moelaunch.kernels.selection import LINEAR_KERNEL_MAX_ROWS, bf16_dot_products
from moelaunch.launcher import LLM, SamplingParams
from moelaunch.launcher.cli import main

LAYERS = 4
FEW_ROWS, MANY_ROWS = 8, LINEAR_KERNEL_MAX_ROWS + 8
# Per layer, at most: MANY_ROWS, a bf16 GEMM's rows in and out for each projection of a layer (q_a with
# kv_a, q_b, o_proj, the MLP's gate_up and down: 5 x 2) and the latent into the cache; FEW_ROWS, the
# latent. Per step: the embedding's rows, the head's rows in and logits out, the positions for the rotary
# tables (int64 to fp32, in any dtype).
CONVERSIONS_PER_LAYER = {FEW_ROWS: 1, MANY_ROWS: 11}
CONVERSIONS_PER_STEP = 4
# On a CPU with bf16 dot products, also the rows rounded for them: the MLA decode's queries (latent and
# rope parts), the per-head products' rows (into W_UK, into W_UV) and the routed experts' (gate_up, down).
ROUNDED_PER_LAYER = 6 if bf16_dot_products() else 0


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(make_hf_model(tmp_path_factory.mktemp("bf16"), "v3", num_hidden_layers=LAYERS))


@pytest.fixture(scope="module")
def bf16_llm(model_path):
    with LLM(model_path, dtype="bfloat16", max_num_seqs=MANY_ROWS, skip_tokenizer_init=True) as llm:
        yield llm


def budget(batch: int) -> int:
    return (CONVERSIONS_PER_LAYER[batch] + ROUNDED_PER_LAYER) * LAYERS + CONVERSIONS_PER_STEP


def one_decode_step(llm: LLM, batch: int) -> StepOps:
    """Prefill `batch` prompts, take a first decode step, then count the ops of the next one."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"conv-{batch}-{i}", [1, 5 + i % 50, 6, 7], params)
    for _ in range(2):
        engine.step()
    with StepOps() as seen:
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return seen


@pytest.mark.parametrize("batch", [FEW_ROWS, MANY_ROWS])
def test_a_bf16_decode_step_converts_no_weight_and_nothing_twice(bf16_llm, batch):
    model = bf16_llm.engine.model
    assert model.compute_dtype() == torch.float32 and model.weight_dtype() == torch.bfloat16
    seen = one_decode_step(bf16_llm, batch)
    assert seen.conversions.total() <= budget(batch), (seen.conversions, seen.converted)


def test_step_profile_counts_the_conversions_in_the_dtype_asked(model_path, capsys):
    """`launch bench --step-profile --dtype bfloat16` profiles the bf16 model (it once ran float32 whatever
    --dtype said) and shows each step's conversions."""
    argv = ["bench", "--model", model_path, "--step-profile", "--dtype", "bfloat16,float32"]
    assert main([*argv, "--batch-sizes", str(MANY_ROWS), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    bf16, fp32 = out.split("bfloat16: ")[1].split("float32: ")
    assert "the engine's steps: eager" in bf16  # compile is off on the CPU: no static step
    conversions = {}
    for text, dtype in ((bf16, "bf16"), (fp32, "fp32")):
        row = next(
            line.split() for line in text.splitlines() if line.split()[:2] == [str(MANY_ROWS), "engine"]
        )
        conversions[dtype] = int(row[4])
    # fp32: only the positions; bf16 also its GEMMs' rows and outputs, the cache's latents, the embedding.
    assert conversions["fp32"] == 1 < conversions["bf16"] <= budget(MANY_ROWS), out
