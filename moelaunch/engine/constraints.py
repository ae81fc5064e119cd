"""The constraints on a sequence's next token that need the tokenizer: its bad words as token ids and
its structured-output grammar. Every sampling rank keeps one per sequence, made on first use and fed
the sequence's tokens as they come, so the grammar is where the output is."""

from __future__ import annotations

import torch

from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.text.grammar import Grammars
from moelaunch.text.tokenizer import Tokenizer


class SequenceConstraints:
    def __init__(self, bad_words: list[list[int]], matcher) -> None:
        self.bad_words = bad_words
        self.matcher = matcher  # xgrammar.GrammarMatcher or None
        self._fed = 0  # output tokens the matcher has accepted

    def banned_after(self, history: list[int]) -> list[int]:
        """Each bad word's last token, where the history ends with the word's other tokens (vLLM's rule:
        a one-token word is never generated)."""
        banned = []
        for word in self.bad_words:
            head = word[:-1]
            if not head or history[-len(head) :] == head:
                banned.append(word[-1])
        return banned

    def fill_grammar(self, output: list[int], bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens the grammar allows after `output` into bitmask[row]."""
        for token in output[self._fed :]:
            # A token outside the grammar only comes from a draw the mask allowed, so this holds; if a
            # terminated grammar was passed (ignore_eos), the mask below allows only its stop tokens.
            self.matcher.accept_token(token)
        self._fed = len(output)
        self.matcher.fill_next_token_bitmask(bitmask, row)


class Constraints:
    """Makes each sequence's SequenceConstraints; grammars are compiled once per spec."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._grammars: Grammars | None = None

    @staticmethod
    def needed(params: SamplingParams) -> bool:
        return bool(params.bad_words) or params.structured_outputs is not None

    @property
    def grammars(self) -> Grammars:
        if self.tokenizer is None:
            raise ValueError(
                "bad_words and structured_outputs need the tokenizer, which skip_tokenizer_init=True left out"
            )
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size)
        return self._grammars

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError (naming the cause) for settings that cannot be applied, before any step."""
        if params.bad_words:
            self.grammars  # noqa: B018 (raises without a tokenizer)
        if params.structured_outputs is not None:
            self.grammars.compile(*params.structured_outputs.spec())

    def make(self, params: SamplingParams) -> SequenceConstraints:
        so = params.structured_outputs
        matcher = self.grammars.matcher(*so.spec()) if so is not None else None
        return SequenceConstraints(self._bad_word_ids(params.bad_words), matcher)

    def _bad_word_ids(self, words: tuple[str, ...]) -> list[list[int]]:
        """Each word's tokens, alone and after a space (so it is banned mid-text too) when that spelling
        is another token sequence of the same length (vLLM's rule)."""
        out = []
        for word in words:
            alone = self.tokenizer.encode(word.lstrip())
            out.append(alone)
            spaced = self.tokenizer.encode(" " + word.lstrip())
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return out
