"""The fixed prompts quality is compared on, and the comparison.

The baseline answers each probe greedily and records its top log-probabilities at a few positions of its
own answer (teacher forcing: the answer so far is part of the prompt, so every method is scored on the
same context). A method is then scored by how long its greedy answers follow the baseline's, and by
the mean |difference| of the log-probabilities (the logits normalized per position) of the baseline's
top tokens at those positions.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moelaunch.engine.llm import LLM
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.tasks.problem_sets import held_out_sample, messages

ANSWER_TOKENS = 32
FORCED_POSITIONS = (0, 8, 16, 24)
TOP = 20  # the engine returns at most 20 log-probabilities per token
TASK_PROBES = 4
LONG_PROBES = 4


@dataclass
class Probes:
    prompts: list[list[int]]
    answers: list[list[int]]  # the baseline's greedy answers
    top_logprobs: list[list[dict[int, float]]]  # per prompt and forced position: the baseline's top tokens

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> Probes:
        data = json.loads(path.read_text())
        tops = [[{int(t): lp for t, lp in top.items()} for top in per] for per in data["top_logprobs"]]
        return cls(data["prompts"], data["answers"], tops)


def probe_prompts(llm: LLM, vocab_size: int, long_len: int, task_family: bool) -> list[list[int]]:
    """Long prompts of fixed random tokens (where cache and attention approximations show), and, for a
    model of the task family, chats from the held-out set's end (the report scores accuracy on its start)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab_size, (long_len,), generator=g).tolist() for _ in range(LONG_PROBES)]
    if task_family:
        problems = held_out_sample(1000)[-TASK_PROBES:]
        prompts += [llm.tokenizer.encode_chat(messages((p,))) for p in problems]
    return prompts


def answer(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    """Greedy answers, then the top log-probabilities at FORCED_POSITIONS of each answer."""
    greedy = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
    answers = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    forced = [p + a[:j] for p, a in zip(prompts, answers, strict=True) for j in FORCED_POSITIONS]
    one = SamplingParams(temperature=0, max_tokens=1, logprobs=TOP)
    tops = [o.outputs[0].logprobs[0] for o in llm.generate(forced, one)]
    n = len(FORCED_POSITIONS)
    return answers, [tops[i * n : (i + 1) * n] for i in range(len(prompts))]


def baseline_probes(llm: LLM, prompts: list[list[int]]) -> Probes:
    answers, tops = answer(llm, prompts)
    return Probes(prompts, answers, tops)


def compare(llm: LLM, probes: Probes) -> tuple[float, float]:
    """(greedy agreement: the mean share of each answer that follows the baseline's before the first
    difference, mean |log-probability difference| over the baseline's top tokens the method also ranks)."""
    answers, tops = answer(llm, probes.prompts)
    agreement = []
    for ours, theirs in zip(answers, probes.answers, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), len(theirs))
        agreement.append(same / len(theirs))
    diffs = [
        abs(ours[t] - lp)
        for ours_per, theirs_per in zip(tops, probes.top_logprobs, strict=True)
        for ours, theirs in zip(ours_per, theirs_per, strict=True)
        for t, lp in theirs.items()
        if t in ours
    ]
    return sum(agreement) / len(agreement), sum(diffs) / max(len(diffs), 1)
