"""The task family asked through the engine, as `launch`'s chat and the API ask it: greedy, MTP
speculative decoding on, every conversation's turn k in one batch, each later turn asked after the
model's own earlier replies.

Used by `launch eval` and by the tests of the bundled model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from moelaunch.engine.llm import LLM
from moelaunch.engine.routed_load import TOTAL_ONLY_WINDOW
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.model.checkpoint import CheckpointReader
from moelaunch.model.config import load_args
from moelaunch.model.loading import has_mtp_weights
from moelaunch.tasks.problem_sets import Conversation, messages
from moelaunch.tasks.tasks import Problem, is_correct
from moelaunch.text.reasoning import split_reasoning

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "small"
# The longest reply is the out-of-scope sentence (53 tokens) plus eos; a negative difference's think
# section and answer take 33; the rest is headroom.
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
KV_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Answer:
    problem: Problem
    turn: int  # position in its conversation, from 1
    output: str  # the answer, after the think section
    reasoning: str | None  # the think section, None when the reply had none

    @property
    def correct(self) -> bool:
        return is_correct(self.problem, self.output)


def open_engine(model: str | Path, record_load: bool = False) -> LLM:
    """The engine on `model`, drafting with its MTP layer when the checkpoint has one; record_load: it
    records routed load (the whole run's total is what is read)."""
    mtp = has_mtp_weights(load_args(model), CheckpointReader(model))
    return LLM(
        model=str(model),
        speculative="mtp" if mtp else None,
        kv_cache_memory=KV_CACHE_BYTES,
        expert_load_window=TOTAL_ONLY_WINDOW if record_load else None,
    )


def ask(llm: LLM, conversations: Sequence[Conversation]) -> list[Answer]:
    """Every turn of every conversation, answered in order; the history holds the model's own replies."""
    replies: list[list[str]] = [[] for _ in conversations]
    answers: list[Answer] = []
    for turn in range(max(map(len, conversations))):
        active = [i for i, conv in enumerate(conversations) if len(conv) > turn]
        outputs = llm.chat([messages(conversations[i], replies[i]) for i in active], GREEDY)
        for i, out in zip(active, outputs, strict=True):
            reasoning, answer = split_reasoning(out.outputs[0].text)
            replies[i].append(answer)  # as a chat or an API client sends the history back
            answers.append(Answer(conversations[i][turn], turn + 1, answer, reasoning))
    return answers


def tally(answers: Sequence[Answer], key: Callable[[Answer], object]) -> dict[str, tuple[int, int]]:
    """(right, total) per value of key, in order of first appearance."""
    right: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for a in answers:
        k = str(key(a))
        total[k] += 1
        right[k] += a.correct
    return {k: (right[k], n) for k, n in total.items()}


def accuracy(answers: Sequence[Answer]) -> float:
    return sum(a.correct for a in answers) / max(len(answers), 1)
