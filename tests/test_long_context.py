"""An 8K-token prompt under DeepSeek-V3's own YaRN (factor 40 from 4K positions) against transformers'
DeepseekV3ForCausalLM: logits at every prompt position after chunked prefill over the latent cache, and
greedy tokens through the engine (chunked prefill over the paged cache, then decodes). The 128K run is
benchmarks/long_context.py."""

from __future__ import annotations

import pytest
import torch

from moelaunch.engine.llm import LLM
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.measure.random_checkpoint import write_random_checkpoint
from moelaunch.model import load_model

LENGTH = 8192  # twice YaRN's original 4096 positions
CHUNK = 2048  # the engine's default prefill budget per step
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("long"), "long-context", decisive_routing=True)


@pytest.mark.slow
def test_8k_prompt_logits_and_greedy_tokens_match_transformers(checkpoint):
    import transformers

    prompt = torch.randint(2, 320, (LENGTH,), generator=torch.Generator().manual_seed(0)).tolist()
    with LLM(str(checkpoint), max_model_len=LENGTH + NEW_TOKENS, max_num_seqs=1, max_num_batched_tokens=CHUNK,
             kv_cache_memory=200_000_000, skip_tokenizer_init=True) as llm:  # fmt: skip
        tokens = (
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))[0]
            .outputs[0]
            .token_ids
        )
    assert len(tokens) == NEW_TOKENS

    ours = load_model(checkpoint)
    ids = torch.tensor([prompt])
    cache = ours.new_cache(1, LENGTH)
    with torch.inference_mode():
        logits = torch.cat([ours(ids[:, a : a + CHUNK], a, cache) for a in range(0, LENGTH, CHUNK)], dim=1)[0]

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.inference_mode():  # the prompt and our continuation in one pass
        expected = reference(torch.tensor([prompt + tokens])).logits[0]
    assert (logits - expected[:LENGTH]).abs().max().item() <= 1e-4
    # transformers' greedy choice after the prompt and after each of our tokens is our next token.
    assert expected[LENGTH - 1 :].argmax(dim=-1).tolist()[:NEW_TOKENS] == tokens
