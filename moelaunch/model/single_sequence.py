"""Single-sequence generation with the latent cache: prefill once, then one token per step."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from moelaunch.model.sampling import sample
from moelaunch.model.transformer import Transformer


@torch.inference_mode()
def stream_tokens(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_ids: tuple[int, ...] = (),
    seed: int = 0,
) -> Iterator[int]:
    """Yield generated token ids one by one; a stop token is yielded, then generation ends. A sampled
    token's draw is keyed on (seed, its position), as the engine's are."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    device = model.model.embed_tokens.weight.device
    cache = model.new_cache(1, len(prompt_ids) + max_new_tokens)
    tokens = torch.tensor([prompt_ids], device=device)
    pos = 0
    for _ in range(max_new_tokens):
        logits = model(tokens, start_pos=pos, cache=cache)[0, -1]
        pos += tokens.shape[1]
        token = sample(logits, temperature, seed, pos)
        yield token
        if token in stop_ids:
            return
        tokens = torch.tensor([[token]], device=device)


def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_ids: tuple[int, ...] = (),
    seed: int = 0,
) -> list[int]:
    return list(stream_tokens(model, prompt_ids, max_new_tokens, temperature, stop_ids, seed))
