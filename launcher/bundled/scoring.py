"""Exact-match scoring of a checkpoint on the task family through the engine: the path `launch`, the
API and the server take (chat template, batching, paged cache, and whatever options the LLM was given).

`launch eval` and `launch report` both score with `score_through_engine`, so their figures agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from moelaunch.launcher.api import LLM
from moelaunch.launcher.bundled.tasks import Problem, is_correct
from moelaunch.launcher.engine.sampling_params import SamplingParams

# The longest answer (four sorted 2-digit numbers) is 11 tokens plus eos; the rest is headroom.
MAX_ANSWER_TOKENS = 32


@dataclass
class Score:
    right: Counter[str] = field(default_factory=Counter)  # per problem kind
    total: Counter[str] = field(default_factory=Counter)

    @property
    def accuracy(self) -> float:
        return sum(self.right.values()) / max(sum(self.total.values()), 1)


def score_through_engine(llm: LLM, problems: Sequence[Problem]) -> Score:
    """Greedy answers to every problem, asked as one-turn chats in one batch."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_ANSWER_TOKENS)
    outputs = llm.chat([p.messages() for p in problems], greedy)
    score = Score()
    for problem, out in zip(problems, outputs, strict=True):
        score.total[problem.kind] += 1
        score.right[problem.kind] += is_correct(problem, out.outputs[0].text)
    return score
