"""Next-token distributions from logits: temperature, top-k and top-p, and the draw.

The engine's per-sequence sampler (launcher/engine/sampler.py, which adds min_tokens, drafts and
log-probabilities) and single-sequence generation both use these, so a seeded draw is the same token
on either path.
"""

from __future__ import annotations

import torch


def filtered_logits(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """logits [vocab] / temperature, with tokens outside the top k and the top-p mass at -inf."""
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest set whose mass reaches top_p (the token crossing it stays).
        drop = probs.cumsum(-1) - probs > top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id from probabilities [vocab]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> int:
    """A token id from logits [vocab]: argmax at temperature 0, else a draw from softmax(logits / T)."""
    if temperature <= 0:
        return int(logits.argmax())
    return draw(filtered_logits(logits.float(), temperature).softmax(-1), generator)
