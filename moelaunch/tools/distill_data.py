"""What a distillation step trains on: a batch that depends only on (seed, step), so a resumed run
sees exactly the batches an uninterrupted one would.

From the bundled task generator, `batch` rows of questions packed with their answers, and only the
answers' tokens are scored (what the model is asked to produce); from a prompt file, `batch` prompts,
every token scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moelaunch.tasks.problem_sets import training_conversations
from moelaunch.text.tokenizer import Tokenizer
from moelaunch.tools.calibration import encode_conversation, read_conversations
from moelaunch.training.small_model.data import packed_batches

# Row width for generated questions: a handful of them packed into each row.
GENERATED_ROW_TOKENS = 128


@dataclass
class DistillBatch:
    ids: torch.Tensor  # [B, T], right-padded
    valid: torch.Tensor  # [B, T] bool: real tokens
    scored: torch.Tensor  # [B, T] bool: tokens whose prediction is distilled


def _step_seed(seed: int, step: int) -> int:
    return seed * 1_000_003 + step


class DistillData:
    def __init__(self, model_dir: str | Path, prompts: str | Path | None, batch: int, seed: int) -> None:
        self.tok = Tokenizer.from_dir(model_dir)
        self.batch, self.seed = batch, seed
        self.sequences = (
            None
            if prompts is None
            else [encode_conversation(self.tok, c) for c in read_conversations(prompts)]
        )

    def batch_at(self, step: int) -> DistillBatch:
        if self.sequences is None:
            questions = training_conversations(_step_seed(self.seed, step), max_turns=1)
            b = next(packed_batches(self.tok, questions, self.batch, GENERATED_ROW_TOKENS))
            return DistillBatch(b.ids, b.valid, b.answer)
        gen = torch.Generator().manual_seed(_step_seed(self.seed, step))
        picked = [self.sequences[i] for i in torch.randint(len(self.sequences), (self.batch,), generator=gen)]
        width = max(map(len, picked))
        ids = torch.zeros(len(picked), width, dtype=torch.long)  # padding is masked out; any id serves
        for row, seq in enumerate(picked):
            ids[row, : len(seq)] = torch.tensor(seq)
        valid = torch.arange(width)[None, :] < torch.tensor([len(s) for s in picked])[:, None]
        return DistillBatch(ids, valid, valid)
