"""Training batches: chat-formatted problems as padded token ids and the masks of what is scored."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moelaunch.launcher.bundled.tasks import Problem
from moelaunch.launcher.bundled.train_small.tokenizer import PAD_ID
from moelaunch.model.tokenizer import Tokenizer


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T], right-padded
    valid: torch.Tensor  # [B, T] bool: real tokens (not padding)
    answer: torch.Tensor  # [B, T] bool: the assistant's answer and its eos, the tokens the loss scores
    kinds: list[str]


def encode(tok: Tokenizer, problem: Problem) -> tuple[list[int], int]:
    """Token ids of the whole exchange and where the answer starts, both from the chat template."""
    prompt = tok.encode_chat(problem.messages())
    full = tok.encode_chat(problem.messages(with_answer=True), add_generation_prompt=False)
    if full[: len(prompt)] != prompt:
        raise ValueError(f"the chat template renders the prompt of {problem} differently with its answer")
    return full, len(prompt)


def make_batch(tok: Tokenizer, problems: list[Problem]) -> Batch:
    encoded = [encode(tok, p) for p in problems]
    width = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(encoded), width), PAD_ID, dtype=torch.long)
    for row, (seq, _) in enumerate(encoded):
        ids[row, : len(seq)] = torch.tensor(seq)
    lengths = torch.tensor([len(seq) for seq, _ in encoded])
    starts = torch.tensor([start for _, start in encoded])
    pos = torch.arange(width)[None, :]
    valid = pos < lengths[:, None]
    return Batch(ids, valid, valid & (pos >= starts[:, None]), [p.kind for p in problems])


def batches(tok: Tokenizer, stream: Iterator[Problem], size: int) -> Iterator[Batch]:
    while True:
        yield make_batch(tok, [next(stream) for _ in range(size)])
