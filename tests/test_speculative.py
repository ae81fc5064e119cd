"""MTP speculative decoding: greedy output identical to plain decoding, rejection sampling that keeps
the target distribution, and the acceptance count."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny_models import add_byte_tokenizer, add_mtp_layer, make_hf_model

from moelaunch.engine.sampler import sample_batch
from moelaunch.engine.sequence import Sequence
from moelaunch.launcher import LLM, SamplingParams
from moelaunch.model import load_model
from moelaunch.model.single_sequence import generate

PROMPTS = [[0, 5, 6, 7, 8, 9], [0] + [3] * 11, [0, 9, 10], [0, 5, 6, 7, 8, 9, 11, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_hf_model(tmp_path_factory.mktemp("mtp"), "v3", num_hidden_layers=4)
    return str(add_mtp_layer(add_byte_tokenizer(path)))


def test_mtp_greedy_output_equals_plain_greedy_with_real_and_oracle_drafts(checkpoint):
    model = load_model(checkpoint)
    expected = [generate(model, p, GREEDY.max_tokens) for p in PROMPTS]
    with LLM(checkpoint, kv_cache_memory=4_000_000, speculative="mtp") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        # Now make every other draft the true next-next token, so both verify branches run.
        runner, engine = llm.engine.runner, llm.engine
        real_draft = runner._draft
        truth = {tuple(p): e for p, e in zip(PROMPTS, expected, strict=True)}

        def oracle(chunks, spans, hidden, results):
            real_draft(chunks, spans, hidden, results)
            for c in chunks:
                r = results.get(c.seq.seq_id)
                at = len(c.seq.output) + len(r.tokens) if r else 0
                ref = truth[tuple(c.seq.prompt)]
                if r and at < len(ref) and at % 2 == 0:
                    r.draft = [ref[at]]

        runner._draft = oracle
        before = engine.stats.spec_accepted
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        assert engine.stats.spec_accepted - before >= 10


def test_draft_verification_keeps_the_sampling_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0], [0.3, 0.1, 0.4, -1.0, 0.9]])
    params = SamplingParams(temperature=1.0, max_tokens=4)
    draws, trials = Counter(), 6000
    for i in range(trials):
        seq = Sequence(i, "r", 0, [1], params, i)
        draws[sample_batch(logits, [(seq, [3])], eos_id=None)[0][0].token] += 1
    target = logits[0].softmax(-1)
    for token in range(5):
        assert abs(draws[token] / trials - target[token].item()) < 0.02


def test_a_grammar_sequence_keeps_its_grammar_beside_drafting_ones(checkpoint):
    # Byte-level vocabulary; a grammar's sequence ignores its draft, the others in the batch verify theirs.
    choices = ("alpha", "beta", "gamma")
    constrained = SamplingParams(
        temperature=0.8, max_tokens=12, seed=1, structured_outputs={"choice": choices}
    )
    with LLM(checkpoint, kv_cache_memory=4_000_000, speculative="mtp") as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        both = llm.generate(PROMPTS * 2, [GREEDY] * len(PROMPTS) + [constrained] * len(PROMPTS))
    assert [o.outputs[0].token_ids for o in both[: len(PROMPTS)]] == plain
    assert all(
        o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop" for o in both[len(PROMPTS) :]
    )


def test_mtp_needs_mtp_weights(tmp_path):
    path = add_byte_tokenizer(make_hf_model(tmp_path, "v3"))
    with pytest.raises(ValueError, match="has no MTP weights"):
        LLM(str(path), kv_cache_memory=1_000_000, speculative="mtp")
