"""Words for the task family's prompts: random letter strings, and English-looking ones.

Random letters alone left the model unsure of real words: it took "reverse Launcher" for an
out-of-scope question while reversing any random string of that length.
"""

from __future__ import annotations

import random
import string

LETTERS = string.ascii_lowercase


def letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(n))


# Pieces of English-looking syllables.
# Space-separated; "-" is the empty piece, and a piece listed twice is drawn twice as often.
ONSETS = tuple(
    "- - b c d f g h j k l m n p r s t v w y z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk".split()
)
ONSETS += tuple("sl sm sn sp st str sw th tr wh qu".split())
VOWELS = tuple("a e i o u a e i o ai au ea ee ie oa oo ou y".split())
CODAS = tuple(
    "- - - b ck d ft g k l ll m mp n nch nd ng nk nt p r rd rk rn rt s ss st t tch th x sh ch".split()
)
SUFFIXES = tuple("- - - er ing ed ly tion es est en le y ness ment".split())


def word_like(rng: random.Random, n: int) -> str:
    """An English-looking word of n letters: syllables cut to length, then (from 5 letters) a suffix."""
    suffix = rng.choice(SUFFIXES).strip("-") if n >= 5 else ""
    stem = ""
    while len(stem) < n - len(suffix):
        stem += "".join(rng.choice(pieces).strip("-") for pieces in (ONSETS, VOWELS, CODAS))
    return stem[: n - len(suffix)] + suffix


def any_word(rng: random.Random, n: int) -> str:
    """n letters, English-looking half the time."""
    return word_like(rng, n) if rng.random() < 0.5 else letters(rng, n)
