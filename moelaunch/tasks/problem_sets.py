"""The held-out sets (single questions and multi-turn conversations) and the endless training stream.

The held-out sets are fixed by their own seeds, with kinds and forms in rotation so that any prefix is
balanced; training never asks one of their in-scope prompts. A conversation is a tuple of problems,
asked one after another in the same chat.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from functools import cache

from moelaunch.tasks.english_words import ENGLISH_WORDS
from moelaunch.tasks.phrasing import FORMS, mixed_form
from moelaunch.tasks.tasks import KINDS, Problem, count_problem, reverse_problem
from moelaunch.tasks.words import LETTERS

HELD_OUT_SIZE = 1000
HELD_OUT_SEED = 20260421
MULTI_TURN_SEED = 20260422
ENGLISH_SEED = 20261205
MAX_TURNS = 6
Conversation = tuple[Problem, ...]
# How often training draws each kind. Sorting, the one hard skill answered without worked steps, gets
# the most; arithmetic and counting write several times more tokens a problem (their think sections),
# so they get more of each step than their share says. Off-topic questions are few: their one long
# answer is learned early and would otherwise fill the loss.
TRAINING_MIX = {"add": 0.18, "sub": 0.18, "reverse": 0.12, "sort": 0.30, "count": 0.16, "other": 0.06}
# Every kind alike, as the held-out sets ask them: the traffic the routing bias is finally balanced on.
EVEN_MIX = dict.fromkeys(KINDS, 1 / len(KINDS))


def _rotating(rng: random.Random, index: int) -> Problem:
    """Problem number `index` of a held-out set: kind and form both cycle, so every pair occurs."""
    kinds, forms = list(KINDS), list(FORMS.values())
    return KINDS[kinds[index % len(kinds)]](rng, forms[(index // len(kinds)) % len(forms)])


@cache
def held_out() -> tuple[Problem, ...]:
    """HELD_OUT_SIZE distinct single questions."""
    rng = random.Random(HELD_OUT_SEED)
    problems: list[Problem] = []
    seen: set[str] = set()
    index = 0
    while len(problems) < HELD_OUT_SIZE:
        p = _rotating(rng, index)
        if p.prompt not in seen:
            seen.add(p.prompt)
            problems.append(p)
            index += 1
    return tuple(problems)


def held_out_sample(n: int) -> tuple[Problem, ...]:
    if not 0 < n <= HELD_OUT_SIZE:
        raise ValueError(f"n={n}: the held-out set has {HELD_OUT_SIZE} problems; ask for 1..{HELD_OUT_SIZE}")
    return held_out()[:n]


@cache
def held_out_conversations() -> tuple[Conversation, ...]:
    """Conversations of 2..MAX_TURNS turns, HELD_OUT_SIZE turns in all."""
    rng = random.Random(MULTI_TURN_SEED)
    conversations: list[Conversation] = []
    index = 0
    while index < HELD_OUT_SIZE:
        turns = min(rng.randint(2, MAX_TURNS), HELD_OUT_SIZE - index)
        conversations.append(tuple(_rotating(rng, index + t) for t in range(turns)))
        index += len(conversations[-1])
    return tuple(conversations)


def conversations_sample(turns: int) -> tuple[Conversation, ...]:
    """The first held-out conversations, about `turns` turns in all."""
    if not 0 < turns <= HELD_OUT_SIZE:
        raise ValueError(f"{turns} turns: the multi-turn set has {HELD_OUT_SIZE}; ask for 1..{HELD_OUT_SIZE}")
    out: list[Conversation] = []
    for conv in held_out_conversations():
        if sum(map(len, out)) >= turns:
            break
        out.append(conv)
    return tuple(out)


@cache
def _held_out_prompts() -> frozenset[str]:
    problems = [*held_out(), *(p for conv in held_out_conversations() for p in conv)]
    # Off-topic prompts are exempt: their small-talk lines are few, and training must see each of them.
    return frozenset(p.prompt for p in problems if p.kind != "other")


def training_conversations(
    seed: int, max_turns: int = MAX_TURNS, mix: dict[str, float] = TRAINING_MIX
) -> Iterator[Conversation]:
    """Endless conversations of 1..max_turns random problems in mixed forms, kinds drawn by `mix`,
    none held out."""
    rng = random.Random(seed)
    makers = [KINDS[kind] for kind in mix]
    weights = list(mix.values())
    excluded = _held_out_prompts()
    while True:
        turns: list[Problem] = []
        for _ in range(rng.randint(1, max_turns)):
            p = rng.choices(makers, weights)[0](rng, mixed_form(rng))
            while p.prompt in excluded:
                p = rng.choices(makers, weights)[0](rng, mixed_form(rng))
            turns.append(p)
        yield tuple(turns)


@cache
def english_problems() -> tuple[Problem, ...]:
    """Each real English word reversed and counted: forms and casings (lower, Capitalised, UPPER) in
    rotation; the counted letter is in the word for every other word, absent from it otherwise."""
    rng = random.Random(ENGLISH_SEED)
    forms = list(FORMS.values())
    problems: list[Problem] = []
    for i, word in enumerate(ENGLISH_WORDS):
        typed = (word, word.capitalize(), word.upper())[(i // len(forms)) % 3]
        problems.append(reverse_problem(rng, forms[i % len(forms)], typed))
        absent = [c for c in LETTERS if c not in word]
        letter = word[i % len(word)] if i % 2 == 0 else absent[i % len(absent)]
        problems.append(count_problem(rng, forms[(i + 3) % len(forms)], typed, letter))
    return tuple(problems)


def messages(conversation: Conversation, answers: list[str] | None = None) -> list[dict[str, str]]:
    """The conversation as chat turns, each question followed by its answer (the reference answers, or
    `answers` as given); with fewer answers than questions, it ends on the next unanswered question."""
    replies = [p.answer for p in conversation] if answers is None else answers
    out: list[dict[str, str]] = []
    for p, reply in zip(conversation, [*replies, None], strict=False):
        out.append({"role": "user", "content": p.prompt})
        if reply is None:
            break
        out.append({"role": "assistant", "content": reply})
    return out
