"""The synthetic chat task family the bundled model is trained and scored on.

Every problem has one exact answer: addition and subtraction of numbers up to 3 digits (differences may
be negative), reversing a word of 1-12 letters in any capitalisation, sorting 2-8 numbers up to 999,
counting a letter in a word (ignoring case). Anything else gets one fixed answer, OUT_OF_SCOPE. Each
problem is asked in one of several forms (phrasing.py); problem_sets.py draws the held-out sets and the
training conversations.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass

from moelaunch.launcher.bundled.phrasing import Form, phrase

MAX_DIGITS = 3
MAX_WORD = 12
SORT_SIZES = (2, 8)
MAX_COUNT = 4
LETTERS = string.ascii_lowercase
OUT_OF_SCOPE = "I can add, subtract, reverse, sort and count letters."


@dataclass(frozen=True)
class Problem:
    kind: str
    form: str
    prompt: str
    answer: str


def _number(rng: random.Random) -> int:
    # Draw the digit count first so short operands are as common as long ones.
    digits = rng.randint(1, MAX_DIGITS)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _cased(rng: random.Random, word: str) -> str:
    """A word as people type it: lower case, Capitalised, UPPER or MiXeD."""
    style = rng.random()
    if style < 0.4:
        return word
    if style < 0.65:
        return word.capitalize()
    if style < 0.8:
        return word.upper()
    return "".join(c.upper() if rng.random() < 0.5 else c for c in word)


def _letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(n))


def _add(rng: random.Random, form: Form) -> Problem:
    a, b = _number(rng), _number(rng)
    return Problem("add", form.name, phrase(rng, form, "add", a=a, b=b), str(a + b))


def _sub(rng: random.Random, form: Form) -> Problem:
    a, b = _number(rng), _number(rng)
    return Problem("sub", form.name, phrase(rng, form, "sub", a=a, b=b), str(a - b))


def _reverse(rng: random.Random, form: Form) -> Problem:
    word = _cased(rng, _letters(rng, rng.randint(1, MAX_WORD)))
    return Problem("reverse", form.name, phrase(rng, form, "reverse", w=word), word[::-1])


def _sort(rng: random.Random, form: Form) -> Problem:
    numbers = [_number(rng) for _ in range(rng.randint(*SORT_SIZES))]
    answer = " ".join(map(str, sorted(numbers)))
    return Problem("sort", form.name, phrase(rng, form, "sort", numbers=numbers), answer)


def _count(rng: random.Random, form: Form) -> Problem:
    # The count is drawn first (uniform) so that no single answer is a safe guess; the word may be
    # capitalised, and counting ignores case.
    letter, n = rng.choice(LETTERS), rng.randint(0, MAX_COUNT)
    others = LETTERS.replace(letter, "")
    chars = [letter] * n + [rng.choice(others) for _ in range(rng.randint(max(n, 1), MAX_WORD) - n)]
    rng.shuffle(chars)
    word = "".join(chars)
    if rng.random() < 0.25:
        word = word.capitalize()
    return Problem("count", form.name, phrase(rng, form, "count", w=word, c=letter), str(n))


def _other(rng: random.Random, form: Form) -> Problem:
    return Problem("other", form.name, phrase(rng, form, "other"), OUT_OF_SCOPE)


KINDS: dict[str, Callable[[random.Random, Form], Problem]] = {
    "add": _add,
    "sub": _sub,
    "reverse": _reverse,
    "sort": _sort,
    "count": _count,
    "other": _other,
}


def is_correct(problem: Problem, output: str) -> bool:
    """Exact match, ignoring surrounding whitespace."""
    return output.strip() == problem.answer
