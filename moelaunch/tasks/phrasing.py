"""How a problem is asked: the wordings of each kind and the ways people vary them.

A `Form` is a wording (the kind's canonical one or a rewording) plus modifiers (lower case, "please",
a trailing "?" added or dropped, extra spaces). The held-out sets ask each problem in one named form,
so accuracy is reported per form; training draws wordings and modifiers at random.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from moelaunch.tasks.words import any_word

# The first wording of each kind is the canonical one ("plain"); the others are reworded forms.
WORDINGS: dict[str, tuple[str, ...]] = {
    "add": (
        "What is {a}+{b}?",
        "What's {a}+{b}?",
        "What is {a} + {b}?",
        "{a}+{b}",
        "{a} + {b} =",
        "{a}+{b}=?",
        "Calculate {a}+{b}",
        "What is {a} plus {b}?",
        "Add {a} and {b}",
    ),
    "sub": (
        "What is {a}-{b}?",
        "What's {a}-{b}?",
        "What is {a} - {b}?",
        "{a}-{b}",
        "{a} - {b} =",
        "{a}-{b}=?",
        "Calculate {a}-{b}",
        "What is {a} minus {b}?",
        "Subtract {b} from {a}",
    ),
    "reverse": (
        "Reverse {w}",
        "Reverse the word {w}",
        "Reverse: {w}",
        "Can you reverse {w}?",
        "What is {w} reversed?",
        "Spell {w} backwards",
        "{w} backwards",
    ),
    "sort": (
        "Sort {ns}",
        "Sort {nc}",
        "Sort {nk}",
        "Sort these numbers: {ns}",
        "Sort the numbers {nc}",
        "Sort: {ns}",
        "Can you sort {ns}?",
        "Sort {ns} in ascending order",
    ),
    "count": (
        "In {w}, count {c}",
        "How many {c} in {w}?",
        "Count {c} in {w}",
        "How many times does {c} appear in {w}?",
        "Count the letter {c} in {w}",
        "How many {c}'s are in {w}?",
        "Count the {c}s in {w}",
    ),
}

# Out-of-scope prompts: small talk, other questions, operations the model does not do, a task word alone.
SMALL_TALK = (
    "hi",
    "Hello",
    "Hey there",
    "Who are you?",
    "What can you do?",
    "help",
    "Thanks!",
    "Tell me a joke",
    "How are you?",
    "Good morning",
    "What is your name?",
    "Write a poem about the sea",
    "What is the capital of France?",
    "What time is it?",
    "Translate hello to French",
    "Explain quantum physics",
    "Why is the sky blue?",
    "Reverse",
    "Sort",
    "Count",
    "What is",
    "ok",
    "bye",
)
OFF_TOPIC = (
    "What is {a}*{b}?",
    "What is {a}/{b}?",
    "{a}*{b}",
    "What is {a} times {b}?",
    "Divide {a} by {b}",
    "What is {w}?",
    "Define {w}",
    "Translate {w}",
    "Tell me about {w}",
    "{W} {w} {w2}.",
    "Where is {W}?",
    "Who is {W}?",
)


@dataclass(frozen=True)
class Form:
    name: str
    reworded: bool = False
    modifiers: tuple[str, ...] = ()


FORMS = {
    f.name: f
    for f in (
        Form("plain"),
        Form("reworded", reworded=True),
        Form("lowercase", modifiers=("lowercase",)),
        Form("please", modifiers=("please",)),
        Form("punctuation", modifiers=("punctuation",)),
        Form("spacing", modifiers=("spacing",)),
    )
}
# How often training applies each modifier (independently); a rewording is drawn MIXED_REWORDED of the time.
MIXED_MODIFIERS = {"lowercase": 0.3, "please": 0.15, "punctuation": 0.25, "spacing": 0.15}
MIXED_REWORDED = 0.6


def mixed_form(rng: random.Random) -> Form:
    """A training form: any wording, any combination of modifiers."""
    modifiers = tuple(m for m, p in MIXED_MODIFIERS.items() if rng.random() < p)
    return Form("mixed", rng.random() < MIXED_REWORDED, modifiers)


def _lowercase(rng: random.Random, text: str) -> str:
    return text.lower()


def _please(rng: random.Random, text: str) -> str:
    if rng.random() < 0.5:
        return rng.choice(("Please ", "please ", "Please, ")) + text[0].lower() + text[1:]
    ending = "?" if text.endswith("?") else ""
    return text.rstrip("?.!=").rstrip() + ", please" + ending


def _punctuation(rng: random.Random, text: str) -> str:
    if text.endswith("?"):
        return text[:-1]
    return text + rng.choice("?.!")


MODIFIERS: dict[str, Callable[[random.Random, str], str]] = {
    "lowercase": _lowercase,
    "please": _please,
    "punctuation": _punctuation,
}


def _spaced(rng: random.Random, text: str) -> str:
    """Extra spaces as people type them: doubled between words, or before and after the message."""
    words = text.split(" ")
    text = (
        "".join(w + (" " * rng.randint(2, 3) if rng.random() < 0.5 else " ") for w in words[:-1]) + words[-1]
    )
    if rng.random() < 0.5:
        text = " " * rng.randint(1, 2) + text
    if rng.random() < 0.5:
        text += " " * rng.randint(1, 2)
    return text


def _off_topic(rng: random.Random) -> str:
    if rng.random() < 0.3:
        return rng.choice(SMALL_TALK)
    return rng.choice(OFF_TOPIC)


def _fields(rng: random.Random, values: dict[str, object]) -> dict[str, object]:
    fields = dict(values)
    if "numbers" in values:
        numbers = [str(n) for n in values["numbers"]]  # type: ignore[attr-defined]
        fields.update(ns=" ".join(numbers), nc=", ".join(numbers), nk=",".join(numbers))
    # Off-topic wordings name made-up words.
    word, word2 = any_word(rng, rng.randint(2, 9)), any_word(rng, rng.randint(2, 9))
    fields.update(w=fields.get("w", word), W=word.capitalize(), w2=word2)
    fields.setdefault("a", rng.randint(0, 99))
    fields.setdefault("b", rng.randint(1, 99))
    return fields


def phrase(rng: random.Random, form: Form, kind: str, **values: object) -> str:
    """The prompt asking `kind` with `values` (a, b / w / numbers / w, c) in `form`."""
    if kind == "other":
        text = _off_topic(rng)
    else:
        wordings = WORDINGS[kind]
        text = rng.choice(wordings[1:]) if form.reworded else wordings[0]
    for name in form.modifiers:
        if name in MODIFIERS:
            text = MODIFIERS[name](rng, text)
    prompt = text.format(**_fields(rng, values))
    return _spaced(rng, prompt) if "spacing" in form.modifiers else prompt
