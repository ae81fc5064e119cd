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


def oracle_drafts(runner, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """Make every other draft of the runner the true next-next token (the random MTP layer's are
    rejected), so that verification keeps some."""
    real_draft = runner._draft
    truth = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}

    def oracle(chunks, hidden, results):
        real_draft(chunks, hidden, results)
        for c, _ in chunks:
            r = results.get(c.seq.seq_id)
            at = len(c.seq.output) + len(r.tokens) if r else 0
            ref = truth[tuple(c.seq.prompt)]
            if r and at < len(ref) and at % 2 == 0:
                r.draft = [ref[at]]

    runner._draft = oracle


def test_mtp_greedy_output_equals_plain_greedy_with_real_and_oracle_drafts(checkpoint):
    model = load_model(checkpoint)
    expected = [generate(model, p, GREEDY.max_tokens) for p in PROMPTS]
    with LLM(checkpoint, kv_cache_memory=4_000_000, speculative="mtp", speculative_policy="always") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        # Now make every other draft the true next-next token, so both verify branches run.
        oracle_drafts(llm.engine.runner, PROMPTS, expected)
        engine = llm.engine
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


class ScriptedPolicy:
    """Stands in for rank 0's DraftPolicy: its decision at step i is script(i); records nothing."""

    def __init__(self, script):
        self.script, self.steps = script, 0

    def drafts(self, batch: int) -> bool:
        self.steps += 1
        return self.script(self.steps - 1)

    def record(self, *measured) -> None:
        pass


def watch_plans(engine) -> list[list[tuple[int, bool, int]]]:
    """Every step's plan as (seq_id, drafts, draft tokens verified) per chunk."""
    plans, step = [], engine.runner.step

    def recording(plan):
        plans.append([(c.seq.seq_id, c.seq.drafts, len(c.draft)) for c in plan])
        return step(plan)

    engine.runner.step = recording
    return plans


def run_switching(checkpoint, script) -> tuple[dict[int, list[bool]], list, object]:
    """8 sequences, 3 at a time, under a scripted policy, with oracle drafts: greedy tokens must be plain
    decoding's. Returns each sequence's drafts flag per step, the plans, and the engine."""
    model = load_model(checkpoint)
    prompts = PROMPTS * 2
    expected = [generate(model, p, GREEDY.max_tokens) for p in prompts]
    with LLM(checkpoint, kv_cache_memory=4_000_000, speculative="mtp", max_num_seqs=3) as llm:
        engine = llm.engine
        engine.draft_policy = ScriptedPolicy(script)
        oracle_drafts(engine.runner, prompts, expected)
        plans = watch_plans(engine)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    flags: dict[int, list[bool]] = {}
    for plan in plans:
        for seq_id, drafts, _ in plan:
            flags.setdefault(seq_id, []).append(drafts)
    assert all(f == sorted(f, reverse=True) for f in flags.values())  # once off, off for good
    return flags, plans, engine


def test_policy_switches_keep_greedy_tokens_and_the_metrics(checkpoint):
    # On for the first 3 sequences, off after 5 steps (they stop drafting while running), so the next 3
    # start without drafts; on again when the last 2 arrive (they draft).
    flags, plans, engine = run_switching(checkpoint, lambda i: i < 5 or i >= 24)
    first = [f for _, f in sorted(flags.items())]
    assert all(f[0] and not f[-1] for f in first[:3])
    assert not any(any(f) for f in first[3:6]) and all(all(f) for f in first[6:])
    # The metrics count exactly the draft tokens the steps verified.
    assert engine.stats.spec_drafted == sum(n for plan in plans for _, _, n in plan) > 0
    assert 0 < engine.stats.spec_accepted <= engine.stats.spec_drafted


def test_policy_switching_every_few_steps_keeps_greedy_tokens(checkpoint):
    run_switching(checkpoint, lambda i: i % 3 != 2)


def test_policy_off_skips_the_mtp_layer(checkpoint):
    model = load_model(checkpoint)
    expected = [generate(model, p, GREEDY.max_tokens) for p in PROMPTS]
    with LLM(checkpoint, kv_cache_memory=4_000_000, speculative="mtp") as llm:
        engine = llm.engine
        engine.draft_policy = ScriptedPolicy(lambda i: False)
        calls, forward = [], engine.model.mtp_forward
        engine.model.mtp_forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        assert not calls and engine.stats.spec_drafted == 0


def test_auto_policy_turns_useless_drafts_off_and_says_why(checkpoint, capfd):
    # The untrained MTP layer's drafts are rejected: after measuring both sides the policy stops them.
    model = load_model(checkpoint)
    prompts = PROMPTS * 2
    expected = [generate(model, p, GREEDY.max_tokens) for p in prompts]
    with LLM(checkpoint, kv_cache_memory=4_000_000, speculative="mtp", max_num_seqs=1) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
        policy = llm.engine.draft_policy
    assert policy.acceptance is not None and policy.acceptance < 0.2
    assert "moelaunch: MTP off at batch 1: " in capfd.readouterr().err
    assert policy.buckets[1].pays is False
