"""The synthetic chat task family the shipped small model is trained and scored on.

Every problem has one exact answer: addition and subtraction of numbers up to 2 digits, reversing a
word of 3-6 letters, sorting 3-4 numbers below 100, counting a letter in a 6-letter word. The
difficulty is what the shipped 2.3M-parameter model masters in its CPU training budget. The held-out
set is fixed (its own seed, the kinds in rotation) and the training stream never yields one of its
prompts.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

HELD_OUT_SIZE = 1000
HELD_OUT_SEED = 20250101
MAX_DIGITS = 2
COUNT_WORD_LENGTH = 6
LETTERS = string.ascii_lowercase
# The instruction words the tokenizer keeps whole; task content is spelled one character a token.
WORDS = ("What", "is", "Reverse", "Sort", "In", "count")


@dataclass(frozen=True)
class Problem:
    kind: str
    prompt: str
    answer: str

    def messages(self, with_answer: bool = False) -> list[dict[str, str]]:
        """The problem as chat turns (with the assistant's answer when training on it)."""
        turns = [{"role": "user", "content": self.prompt}]
        if with_answer:
            turns.append({"role": "assistant", "content": self.answer})
        return turns


def _number(rng: random.Random) -> int:
    # Draw the digit count first so short operands are as common as long ones.
    digits = rng.randint(1, MAX_DIGITS)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _add(rng: random.Random) -> Problem:
    a, b = _number(rng), _number(rng)
    return Problem("add", f"What is {a}+{b}?", str(a + b))


def _sub(rng: random.Random) -> Problem:
    a, b = sorted((_number(rng), _number(rng)), reverse=True)
    return Problem("sub", f"What is {a}-{b}?", str(a - b))


def _word(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def _reverse(rng: random.Random) -> Problem:
    word = _word(rng, 3, 6)
    return Problem("reverse", f"Reverse {word}", word[::-1])


def _sort(rng: random.Random) -> Problem:
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 4))]
    return Problem("sort", "Sort " + " ".join(map(str, numbers)), " ".join(map(str, sorted(numbers))))


def _count(rng: random.Random) -> Problem:
    # The count is drawn first (0-3, uniform) so that no single answer is a safe guess. The letter comes
    # last, where the answer is asked for, and the word length is fixed: attention then sees the
    # matches as a share of a prompt of constant length, which encodes the count directly.
    letter, n = rng.choice(LETTERS), rng.randint(0, 3)
    others = LETTERS.replace(letter, "")
    chars = [letter] * n + [rng.choice(others) for _ in range(COUNT_WORD_LENGTH - n)]
    rng.shuffle(chars)
    return Problem("count", f"In {''.join(chars)}, count {letter}", str(n))


KINDS: dict[str, Callable[[random.Random], Problem]] = {
    "add": _add,
    "sub": _sub,
    "reverse": _reverse,
    "sort": _sort,
    "count": _count,
}
# How often training draws each kind: reversing is learned first, counting last, so counting gets the
# largest share.
TRAINING_MIX = {"add": 0.2, "sub": 0.2, "reverse": 0.15, "sort": 0.2, "count": 0.25}


@cache
def held_out() -> tuple[Problem, ...]:
    """The fixed evaluation set; kinds rotate, so any prefix is balanced across kinds."""
    rng = random.Random(HELD_OUT_SEED)
    makers = list(KINDS.values())
    problems: list[Problem] = []
    seen: set[str] = set()
    while len(problems) < HELD_OUT_SIZE:
        p = makers[len(problems) % len(makers)](rng)
        if p.prompt not in seen:
            seen.add(p.prompt)
            problems.append(p)
    return tuple(problems)


def held_out_sample(n: int) -> tuple[Problem, ...]:
    if not 0 < n <= HELD_OUT_SIZE:
        raise ValueError(f"n={n}: the held-out set has {HELD_OUT_SIZE} problems; ask for 1..{HELD_OUT_SIZE}")
    return held_out()[:n]


def training_stream(seed: int) -> Iterator[Problem]:
    """Endless random problems of every kind, none of them in the held-out set."""
    rng = random.Random(seed)
    makers = [KINDS[kind] for kind in TRAINING_MIX]
    weights = list(TRAINING_MIX.values())
    excluded = {p.prompt for p in held_out()}
    while True:
        p = rng.choices(makers, weights)[0](rng)
        if p.prompt not in excluded:
            yield p


def is_correct(problem: Problem, output: str) -> bool:
    """Exact match, ignoring surrounding whitespace."""
    return output.strip() == problem.answer
