"""Training batches: chat-template-rendered conversations packed into rows, and the masks of what is scored.

Conversations are packed back to back (each from its own bos) into rows of `width` tokens: no compute
is spent on padding, and every turn is learned after arbitrary earlier text, as a chat's later turns
are asked.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moelaunch.tasks.problem_sets import Conversation, messages
from moelaunch.text.tokenizer import Tokenizer
from moelaunch.training.small_model.tokenizer import ASSISTANT, PAD_ID


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T], right-padded
    valid: torch.Tensor  # [B, T] bool: real tokens (not padding)
    answer: torch.Tensor  # [B, T] bool: the assistant's answers and their eos, the tokens the loss scores
    segment: torch.Tensor  # [B, T] long: which answer (an index into kinds) a token belongs to, else -1
    kinds: list[str]  # the kind of each answer


def encode(tok: Tokenizer, conversation: Conversation) -> tuple[list[int], list[int]]:
    """Token ids of the whole chat and, per token, the number of the turn whose answer (reply and eos)
    it belongs to, -1 for the rest.

    The chat is what the engine sees when it answers the last question: earlier turns hold answers
    only (the template drops think sections), and the last reply is written whole. An earlier answer
    that the model would have reached by reasoning is not scored, since the model never writes it
    without its think section.
    """
    prompt = tok.encode_chat(messages(conversation, [p.answer for p in conversation[:-1]]))
    full = prompt + tok.encode(conversation[-1].reply) + [tok.eos_id]
    assistant = tok.encode(ASSISTANT)[0]
    last = len(conversation) - 1
    turn_of, turn, inside = [], -1, False
    for t in full:
        scored = inside and (turn == last or not conversation[turn].reasoning)
        turn_of.append(turn if scored else -1)
        if t == assistant:
            inside, turn = True, turn + 1
        elif t == tok.eos_id:
            inside = False
    return full, turn_of


def packed_batches(
    tok: Tokenizer, stream: Iterator[Conversation], rows: int, width: int, packed: bool = True
) -> Iterator[Batch]:
    """Rows of `width` tokens; packed=False puts one conversation a row, alone as the engine runs it."""

    def encoded() -> Iterator[tuple[Conversation, list[int], list[int]]]:
        for conversation in stream:
            ids, turn_of = encode(tok, conversation)
            if len(ids) > width:
                raise ValueError(f"a conversation of {len(ids)} tokens does not fit a row of {width}")
            yield conversation, ids, turn_of

    source = encoded()
    pending = next(source)
    while True:
        ids = torch.full((rows, width), PAD_ID, dtype=torch.long)
        segment = torch.full((rows, width), -1, dtype=torch.long)
        kinds: list[str] = []
        for row in range(rows):
            used = 0
            while used + len(pending[1]) <= width and (packed or used == 0):
                conversation, seq, turn_of = pending
                ids[row, used : used + len(seq)] = torch.tensor(seq)
                segment[row, used : used + len(seq)] = torch.tensor(
                    [-1 if t < 0 else len(kinds) + t for t in turn_of]
                )
                kinds += [p.kind for p in conversation]
                used += len(seq)
                pending = next(source)
        yield Batch(ids, ids != PAD_ID, segment >= 0, segment, kinds)
