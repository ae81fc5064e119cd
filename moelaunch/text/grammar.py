"""Grammars over a tokenizer's vocabulary (xgrammar): compiled once per (kind, spec), matched per
sequence, each step's allowed tokens written as a bitmask (bit i of word w: token 32 w + i)."""

from __future__ import annotations

import re
from functools import lru_cache

import torch
import xgrammar as xgr

from moelaunch.text.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """A schema, regex or grammar that xgrammar cannot compile."""


class Grammars:
    """Compiles grammars for one tokenizer and model vocabulary (the logits' width, which may be
    larger than the tokenizer's)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        vocab, byte_level = tokenizer.grammar_vocabulary()
        vocab = vocab[:vocab_size] + [""] * (vocab_size - len(vocab))  # the logits' width
        kind = xgr.VocabType.BYTE_LEVEL if byte_level else xgr.VocabType.RAW
        stops = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        self.info = xgr.TokenizerInfo(vocab, kind, vocab_size=vocab_size, stop_token_ids=stops)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.compile = lru_cache(maxsize=256)(self._compile)

    def _compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        """kind is one of KINDS; spec its text (a choice's options joined by NUL)."""
        try:
            if kind == "json_schema":
                return self._compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":
                # An object, as OpenAI's JSON mode gives (xgrammar's builtin JSON grammar allows any value).
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            if kind == "choice":
                return self._compiler.compile_regex("|".join(_escape(c) for c in spec.split("\0")))
            return self._compiler.compile_grammar(spec)
        except RuntimeError as e:
            # xgrammar's message starts with "[time] source.cc:line: "; the rest is the reason.
            reason = re.sub(r"^\[[^\]]*\] \S+: ", "", str(e).strip())
            raise GrammarError(f"the {kind} cannot be compiled: {reason}") from None

    def matcher(self, kind: str, spec: str) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compile(kind, spec))

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """[rows, words] int32, every token allowed."""
        return xgr.allocate_token_bitmask(rows, self.info.vocab_size)


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in r"\^$.|?*+()[]{}/" else ch for ch in text)
