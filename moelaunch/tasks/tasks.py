"""The synthetic chat task family the bundled model is trained and scored on.

Every problem has one exact answer: addition and subtraction of numbers up to 3 digits (differences may
be negative), reversing a word of 1-12 letters in any capitalisation, sorting 2-8 numbers up to 999,
counting a letter in a word (ignoring case). Anything else gets one fixed answer, OUT_OF_SCOPE. Each
problem is asked in one of several forms (phrasing.py); problem_sets.py draws the held-out sets and the
training conversations. Sums, differences and counts are worked out first in a hidden think section,
as DeepSeek-R1 writes one (`<think>steps</think>answer`; the *_steps functions below).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from moelaunch.tasks.phrasing import Form, phrase
from moelaunch.tasks.words import LETTERS, any_word, word_like
from moelaunch.text.reasoning import with_reasoning

MAX_DIGITS = 3
MAX_WORD = 12
SORT_SIZES = (2, 8)
MAX_COUNT = 4
OUT_OF_SCOPE = "I can add, subtract, reverse, sort and count letters."


@dataclass(frozen=True)
class Problem:
    kind: str
    form: str
    prompt: str
    answer: str
    # Worked steps the model writes in a hidden think section before the answer (empty: it answers
    # at once). The *_steps functions below say why each skill's steps have the shape they do.
    reasoning: str = ""

    @property
    def reply(self) -> str:
        """The whole reply the model is trained to write: think section, then the answer."""
        return with_reasoning(self.reasoning, self.answer)


def _number(rng: random.Random) -> int:
    # Draw the digit count first so short operands are as common as long ones.
    digits = rng.randint(1, MAX_DIGITS)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def cased(rng: random.Random, word: str) -> str:
    """A word as people type it: lower case, Capitalised, UPPER or MiXeD."""
    style = rng.random()
    if style < 0.4:
        return word
    if style < 0.65:
        return word.capitalize()
    if style < 0.8:
        return word.upper()
    return "".join(c.upper() if rng.random() < 0.5 else c for c in word)


def _digits_lsb_first(n: int, width: int) -> str:
    return f"{n:0{width}d}"[::-1]


def addition_steps(a: int, b: int) -> str:
    """`123+456` as `321+654=9750`: both operands zero-padded and least significant digit first, then
    the 4-digit sum the same way. Each sum digit then depends on two digits at fixed distances and the
    carry just written, which a small transformer learns from far fewer examples than carries that run
    against the writing order; the answer is the sum read backwards without its leading zeros."""
    w = MAX_DIGITS
    return f"{_digits_lsb_first(a, w)}+{_digits_lsb_first(b, w)}={_digits_lsb_first(a + b, w + 1)}"


def subtraction_steps(a: int, b: int) -> str:
    """`50-8` as `050-800=2400`, digits least significant first as in addition_steps. A negative
    difference shows as a last digit 9 (the borrow out of the hundreds, the difference mod 10^4):
    the steps then subtract the other way round (`8-50`: `800-050=8599 050-800=2400`) and the answer
    is that difference with a minus sign."""
    w = MAX_DIGITS
    difference = _digits_lsb_first((a - b) % 10 ** (w + 1), w + 1)
    first = f"{_digits_lsb_first(a, w)}-{_digits_lsb_first(b, w)}={difference}"
    return first if a >= b else f"{first} {subtraction_steps(b, a)}"


def counting_steps(word: str, letter: str) -> str:
    """`banana`, `a` as `b0a1n1a2n2a3`: each letter followed by the count so far, so every step is
    one comparison and at most one increment instead of a count over the whole word at once."""
    steps, n = [], 0
    for ch in word:
        n += ch.lower() == letter
        steps.append(f"{ch}{n}")
    return "".join(steps)


def _add(rng: random.Random, form: Form) -> Problem:
    a, b = _number(rng), _number(rng)
    return Problem("add", form.name, phrase(rng, form, "add", a=a, b=b), str(a + b), addition_steps(a, b))


def _sub(rng: random.Random, form: Form) -> Problem:
    a, b = _number(rng), _number(rng)
    return Problem("sub", form.name, phrase(rng, form, "sub", a=a, b=b), str(a - b), subtraction_steps(a, b))


def reverse_problem(rng: random.Random, form: Form, word: str) -> Problem:
    return Problem("reverse", form.name, phrase(rng, form, "reverse", w=word), word[::-1])


def count_problem(rng: random.Random, form: Form, word: str, letter: str) -> Problem:
    """How many `letter` (lower case) in `word`, ignoring case."""
    prompt = phrase(rng, form, "count", w=word, c=letter)
    n = word.lower().count(letter)
    return Problem("count", form.name, prompt, str(n), counting_steps(word, letter))


def _reverse(rng: random.Random, form: Form) -> Problem:
    return reverse_problem(rng, form, cased(rng, any_word(rng, rng.randint(1, MAX_WORD))))


def _sort(rng: random.Random, form: Form) -> Problem:
    numbers = [_number(rng) for _ in range(rng.randint(*SORT_SIZES))]
    answer = " ".join(map(str, sorted(numbers)))
    return Problem("sort", form.name, phrase(rng, form, "sort", numbers=numbers), answer)


def _count(rng: random.Random, form: Form) -> Problem:
    if rng.random() < 0.5:
        # An English-looking word, a letter mostly from it: counts of 0-2, as real words give.
        word = word_like(rng, rng.randint(1, MAX_WORD))
        letter = rng.choice(word) if rng.random() < 0.75 else rng.choice(LETTERS)
        return count_problem(rng, form, cased(rng, word), letter)
    # Random letters with the count drawn first (uniform) so that no single answer is a safe guess; the
    # word may be capitalised, and counting ignores case.
    letter, n = rng.choice(LETTERS), rng.randint(0, MAX_COUNT)
    others = LETTERS.replace(letter, "")
    chars = [letter] * n + [rng.choice(others) for _ in range(rng.randint(max(n, 1), MAX_WORD) - n)]
    rng.shuffle(chars)
    word = "".join(chars)
    if rng.random() < 0.25:
        word = word.capitalize()
    return count_problem(rng, form, word, letter)


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
