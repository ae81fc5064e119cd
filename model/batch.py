"""How one forward pass's tokens are laid out: sequences of different lengths flattened into [N].

Linear layers and experts run on all N tokens at once; attention walks the spans, each against its
own cache row. A rank with no tokens runs the same pass with N = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import LatentCache


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's tokens in the flat batch: rows [offset, offset + length), positions from start_pos."""

    offset: int
    length: int
    start_pos: int
    cache_row: int = 0


@dataclass
class BatchLayout:
    spans: list[SeqSpan]
    positions: torch.Tensor  # [N] absolute position of every token
    cache: LatentCache | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def from_spans(
        cls, spans: list[SeqSpan], cache: LatentCache | None = None, device: torch.device | str = "cpu"
    ) -> BatchLayout:
        pos = [torch.arange(s.start_pos, s.start_pos + s.length) for s in spans]
        positions = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long)
        return cls(spans, positions.to(device), cache)

    @classmethod
    def rectangle(
        cls, batch: int, length: int, start_pos: int, cache: LatentCache | None, device: torch.device | str
    ) -> BatchLayout:
        """`batch` sequences of `length` tokens each, sequence b in cache row b."""
        spans = [SeqSpan(b * length, length, start_pos, b) for b in range(batch)]
        return cls.from_spans(spans, cache, device)
