"""A model of the task family asked questions through the chat template and the project's generate path.

Used by `launch eval` to score checkpoints and by the tests of the shipped small model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moelaunch.model import Transformer, load_model
from moelaunch.model.single_sequence import generate
from moelaunch.model.tokenizer import Tokenizer

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "small"
# The longest answer (four sorted 2-digit numbers) is 11 tokens plus eos; the rest is headroom.
MAX_NEW_TOKENS = 32


@dataclass
class TaskModel:
    model: Transformer
    tokenizer: Tokenizer

    @classmethod
    def load(cls, path: str | Path = DEFAULT_CHECKPOINT) -> TaskModel:
        return cls(load_model(path), Tokenizer.from_dir(path))

    def prompt_ids(self, question: str) -> list[int]:
        return self.tokenizer.encode_chat([{"role": "user", "content": question}])

    def generate_ids(self, prompt_ids: list[int]) -> list[int]:
        """Greedy answer tokens, ending with eos unless MAX_NEW_TOKENS ran out first."""
        stop = () if self.tokenizer.eos_id is None else (self.tokenizer.eos_id,)
        return generate(self.model, prompt_ids, MAX_NEW_TOKENS, temperature=0.0, stop_ids=stop)

    def reply(self, question: str) -> str:
        return self.tokenizer.decode(self.generate_ids(self.prompt_ids(question))).strip()
