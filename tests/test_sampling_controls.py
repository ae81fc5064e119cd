"""The sampler's per-row controls against plain per-token references written from OpenAI's and vLLM's
definitions: penalties, logit bias, allowed tokens, bad words, min-p/top-k/top-p, and a grammar's
mask; and the fields as SamplingParams takes them."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from moelaunch.engine.sampler import Sampler, sample_batch
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.engine.sequence import Sequence
from moelaunch.launcher.deploy.config import load_deploy_config
from moelaunch.launcher.jobs.batch import parse_line
from moelaunch.measure.scoring import DEFAULT_CHECKPOINT
from moelaunch.model.sampling import controlled_logits, filtered_logits
from moelaunch.text.tokenizer import Tokenizer

VOCAB = 40
EOS = 1


def make_seq(params: SamplingParams, prompt: list[int], output: list[int], seed: int = 0) -> Sequence:
    seq = Sequence(seed, "r", 0, prompt, params, seed)
    seq.output = list(output)
    return seq


def reference_logits(
    row: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    """One row, token by token: repetition over prompt + output (divide positive, multiply negative),
    then frequency (per occurrence) and presence (once) over the output, then the bias, then the bans."""
    x = list(row)
    for t in set(prompt + output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    for t, bias in p.logit_bias:
        x[t] += bias
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    if len(output) < p.min_tokens and not p.ignore_eos:
        x[EOS] = -math.inf
    return x


CASES = [
    dict(presence_penalty=1.5, temperature=0),
    dict(frequency_penalty=-0.7, temperature=0),
    dict(presence_penalty=0.5, frequency_penalty=2.0, temperature=0),
    dict(repetition_penalty=1.8, temperature=0),
    dict(repetition_penalty=0.6, presence_penalty=-1.0, temperature=0),
    dict(logit_bias={"3": 100, 7: -250, 11: 0.5}, temperature=0),  # -250 is clamped to -100
    dict(allowed_token_ids=[2, 5, 9, 30], repetition_penalty=1.3, temperature=0),
    dict(min_tokens=6, max_tokens=8, frequency_penalty=0.3, temperature=0),
    dict(),  # no control: this row passes through untouched beside the others
]


def test_controls_equal_the_per_token_reference_row_by_row_in_one_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), VOCAB, generator=gen) * 3
    seqs = []
    for i, case in enumerate(CASES):
        prompt = torch.randint(2, VOCAB, (7,), generator=gen).tolist()
        output = torch.randint(2, VOCAB, (i + 2,), generator=gen).tolist() + [4, 4, 4]
        seqs.append(make_seq(SamplingParams(**case), prompt, output, i))
    sampler = Sampler(None, VOCAB, EOS)
    prepared = sampler.prepare([(s, []) for s in seqs], logits.device)
    got = controlled_logits(logits, prepared.controls)
    for i, seq in enumerate(seqs):
        want = torch.tensor(reference_logits(logits[i].tolist(), seq.prompt, seq.output, seq.params))
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
    tokens = [t[0].token for t in sampler.sample(logits, prepared)]
    assert tokens == [int(got[i].argmax()) for i in range(len(seqs))]
    assert tokens[5] == 3  # the +100 bias wins
    assert tokens[6] in (2, 5, 9, 30)


def reference_filter(
    row: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    """The tokens left: above min_p * the top probability, among the k likeliest, within the top-p mass."""
    x = [v / temperature for v in row]
    z = sum(math.exp(v) for v in x)
    probs = [math.exp(v) / z for v in x]
    kept = [t for t in range(len(x)) if probs[t] >= min_p * max(probs)]
    kept.sort(key=lambda t: -x[t])
    if top_k > 0:
        kept = kept[:top_k]
    mass, total, left = 0.0, sum(probs[t] for t in kept), []
    for t in kept:
        if mass > top_p:
            break
        left.append(t)
        mass += probs[t] / total
    return set(left)


def test_filters_per_row_equal_the_reference():
    gen = torch.Generator().manual_seed(1)
    settings = [(1.0, -1, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, -1, 0.6, 0.0), (1.0, -1, 1.0, 0.2),
                (0.5, 8, 0.8, 0.05)]  # fmt: skip
    logits = torch.randn(len(settings), VOCAB, generator=gen) * 2
    columns = [torch.tensor(c) for c in zip(*settings, strict=True)]
    got = filtered_logits(logits, *columns)
    for i, s in enumerate(settings):
        assert {t for t in range(VOCAB) if got[i, t] > -math.inf} == reference_filter(logits[i].tolist(), *s)


def test_seeded_sampling_with_penalties_draws_from_the_penalized_distribution():
    logits = torch.zeros(1, 4)
    params = SamplingParams(temperature=1.0, presence_penalty=2.0, seed=0)
    counts = [0] * 4
    for i in range(3000):
        seq = make_seq(params, [3], [0, 0], seed=i)
        counts[sample_batch(logits, [(seq, [])], None)[0][0].token] += 1
    # Token 0 was generated: its logit is 0 - 2, the others 0.
    want = torch.tensor([-2.0, 0, 0, 0]).softmax(-1)
    for t in range(4):
        assert abs(counts[t] / 3000 - want[t].item()) < 0.03


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(DEFAULT_CHECKPOINT)


def test_bad_words_ban_a_words_last_token_only_after_its_others(tokenizer):
    vocab = tokenizer.vocab_size
    ab = tokenizer.encode("ab")
    x = tokenizer.encode("x")[0]
    logits = torch.zeros(3, vocab)
    logits[:, ab[1]] = 5.0
    logits[:, x] = 6.0  # x is banned everywhere, so b (after a) is the next best
    params = SamplingParams(temperature=0, bad_words=["ab", "x"])
    after_a = make_seq(params, [5], [ab[0]])
    elsewhere = make_seq(params, [5], [x - 1 if x - 1 != ab[0] else x + 1], seed=1)
    tokens = sample_batch(logits[:2], [(after_a, []), (elsewhere, [])], EOS, tokenizer)
    assert tokens[1][0].token == ab[1]
    assert tokens[0][0].token not in (ab[1], x)


SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "size": {"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"]}},
    "required": ["kind", "size"],
}  # fmt: skip


def test_a_grammar_keeps_random_logits_on_the_schema_and_ends_with_eos(tokenizer):
    params = SamplingParams(temperature=1.0, max_tokens=200, structured_outputs={"json": SCHEMA})
    sampler = Sampler(tokenizer, tokenizer.vocab_size, tokenizer.eos_id)
    gen = torch.Generator().manual_seed(3)
    for seed in range(3):
        seq = make_seq(params, [0], [], seed)
        for _ in range(params.max_tokens):
            logits = torch.randn(2, tokenizer.vocab_size, generator=gen) * 4  # a draft row too
            token = sampler.sample(logits, sampler.prepare([(seq, [7])], logits.device))[0][0].token
            if token == tokenizer.eos_id:
                break
            seq.output.append(token)
        value = json.loads(tokenizer.decode(seq.output))
        assert value["kind"] in ("cat", "dog") and isinstance(value["size"]["n"], int)


def test_sampling_fields_are_checked_and_normalized():
    p = SamplingParams(
        logit_bias={"5": 300, 2: -1.5}, bad_words="no", structured_outputs={"choice": ["a", "b"]}
    )
    assert p.logit_bias == ((2, -1.5), (5, 100.0))
    assert p.bad_words == ("no",)
    assert SamplingParams(**json.loads(json.dumps(p.model_dump()))) == p  # as the ranks receive it
    for bad, says in [
        (dict(presence_penalty=2.5), "presence_penalty=2.5"),
        (dict(repetition_penalty=0), "repetition_penalty=0"),
        (dict(logit_bias={"x": 1}), "token id 'x'"),
        (dict(min_p=1.5), "min_p=1.5"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "exactly one of"),
        (dict(structured_outputs={"json": "{"}), "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=says):
            SamplingParams(**bad)


def test_random_batches_match_the_reference():
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        seqs, rows = [], []
        for i in range(rng.randint(1, 6)):
            penalties = {"presence_penalty": rng.uniform(-2, 2), "frequency_penalty": rng.uniform(-2, 2)}
            case = dict(temperature=0, repetition_penalty=rng.uniform(0.5, 2), **penalties)
            prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 9))]
            output = [rng.randrange(2, VOCAB) for _ in range(rng.randint(0, 9))]
            seqs.append(make_seq(SamplingParams(**case), prompt, output, i))
            rows.append(torch.randn(VOCAB, generator=gen))
        logits = torch.stack(rows)
        tokens = sample_batch(logits, [(s, []) for s in seqs], EOS)
        for s, row, t in zip(seqs, rows, tokens, strict=True):
            ref = reference_logits(row.tolist(), s.prompt, s.output, s.params)
            assert t[0].token == max(range(VOCAB), key=ref.__getitem__)


def test_batch_lines_and_job_sections_take_the_new_fields(tmp_path):
    line = {"id": 1, "prompt": "x", "presence_penalty": 1.0, "logit_bias": {"7": 5}, "min_p": 0.1,
            "structured_outputs": {"choice": ["a", "b"]}}  # fmt: skip
    params = parse_line(1, json.dumps(line), {}, 0).params
    assert params.logit_bias == ((7, 5.0),) and params.structured_outputs.choice == ("a", "b")
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        f"model: {DEFAULT_CHECKPOINT}\n"
        "job: {mode: chat, repetition_penalty: 1.3, bad_words: [zz], logit_bias: {5: -100},"
        " structured_outputs: {regex: '[ab]+'}}\n"
    )
    job = SamplingParams(**load_deploy_config(deploy).job.sampling())
    assert job.repetition_penalty == 1.3 and job.logit_bias == ((5, -100.0),)
    assert job.structured_outputs.regex == "[ab]+" and job.bad_words == ("zz",)
