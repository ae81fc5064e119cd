"""Next-token choice from logits: argmax at temperature 0, else a draw from softmax(logits / T)."""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Token ids [B] from logits [B, vocab]."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
