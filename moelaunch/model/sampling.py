"""Next-token distributions from logits: per-row controls (penalties, logit bias, banned and allowed
tokens, a grammar's bitmask), temperature, min-p, top-k and top-p, and the draw.

Everything before the draw works on a batch of rows [rows, vocab] with per-row settings as device
tensors, built on the host when the batch is formed: no host sync and no shape that depends on the
values, so the step can be captured whole. The engine's sampler (engine/sampler.py, which adds drafts
and log-probabilities) and single-sequence generation both use these, so a seeded draw is the same
token on either path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowControls:
    """Per-row settings for `controlled_logits`. Token id lists are padded with `vocab` (a column that
    is dropped), so every row of a tensor has the same width whatever its list's length."""

    presence: torch.Tensor  # [rows] subtracted once from every generated token's logit
    frequency: torch.Tensor  # [rows] subtracted per occurrence in the generated tokens
    repetition: torch.Tensor  # [rows] > 0; 1 leaves the logits alone
    generated: torch.Tensor  # [rows, g] long: the tokens generated so far
    seen: torch.Tensor  # [rows, s] long: prompt and generated tokens (for the repetition penalty)
    bias_ids: torch.Tensor  # [rows, b] long
    bias_values: torch.Tensor  # [rows, b]
    banned: torch.Tensor  # [rows, n] long: tokens that may not come next
    allowed: torch.Tensor  # [rows, a] long: the only tokens that may come next ...
    restricted: torch.Tensor  # [rows] bool: ... in the rows where this is set
    grammar: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32 bitmask: bit set = allowed


def _scatter(rows: int, vocab: int, ids: torch.Tensor, values: torch.Tensor | float) -> torch.Tensor:
    """Dense [rows, vocab] sums of `values` at `ids` (padding ids == vocab land in a dropped column)."""
    dense = torch.zeros(rows, vocab + 1, dtype=torch.float32, device=ids.device)
    src = values if isinstance(values, torch.Tensor) else torch.full(ids.shape, values, device=ids.device)
    return dense.scatter_add_(1, ids, src.float())[:, :vocab]


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 (bit i of word w: token 32 w + i) -> [rows, vocab] bool."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]


def controlled_logits(logits: torch.Tensor, c: RowControls) -> torch.Tensor:
    """Penalties, then logit bias, then the bans (banned, not allowed, not in the grammar) at -inf.

    The order is vLLM's for penalties: repetition (over prompt and output; positive logits divided,
    negative multiplied), then frequency and presence (over the output), as OpenAI defines them."""
    rows, vocab = logits.shape
    x = logits.float()
    seen = _scatter(rows, vocab, c.seen, 1.0) > 0
    rep = c.repetition.unsqueeze(1)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    counts = _scatter(rows, vocab, c.generated, 1.0)
    x = x - c.frequency.unsqueeze(1) * counts - c.presence.unsqueeze(1) * (counts > 0)
    x = x + _scatter(rows, vocab, c.bias_ids, c.bias_values)
    blocked = _scatter(rows, vocab, c.banned, 1.0) > 0
    outside = (_scatter(rows, vocab, c.allowed, 1.0) == 0) & c.restricted.unsqueeze(1)
    blocked = blocked | outside
    if c.grammar is not None:
        off_grammar = ~unpack_bitmask(c.grammar, vocab)
        # Where the bans leave nothing (min_tokens against a finished grammar), the grammar wins.
        blocked = blocked | off_grammar
        blocked = torch.where(blocked.all(-1, keepdim=True), off_grammar, blocked)
    return x.masked_fill(blocked, float("-inf"))


def filtered_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int = 0,
    top_p: torch.Tensor | float = 1.0,
    min_p: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """logits [rows, vocab] (or [vocab]) / temperature, with tokens below min_p times the likeliest's
    probability, outside the top k (k <= 0: no limit) and outside the top-p mass at -inf. Settings are
    per row ([rows] tensors) or one for all."""
    single = logits.dim() == 1
    x = logits.unsqueeze(0) if single else logits
    rows, vocab = x.shape

    def column(v: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(v, dtype=dtype, device=x.device).reshape(-1, 1).expand(rows, 1)

    x = x / column(temperature, x.dtype)
    # A setting given as one number that keeps everything costs nothing (no softmax, no sort).
    if not (isinstance(min_p, float | int) and min_p <= 0):
        probs = x.softmax(-1)
        x = x.masked_fill(probs < column(min_p, probs.dtype) * probs.amax(-1, keepdim=True), float("-inf"))
    if isinstance(top_k, int) and top_k <= 0 and isinstance(top_p, float | int) and top_p >= 1:
        return x[0] if single else x
    k = column(top_k, torch.long)
    k = torch.where(k > 0, k.clamp(max=vocab), vocab)
    sorted_x, order = x.sort(dim=-1, descending=True)
    x = x.masked_fill(x < sorted_x.gather(1, k - 1), float("-inf"))
    # Keep the smallest set whose mass reaches top_p (the token crossing it stays).
    sorted_probs = sorted_x.masked_fill(sorted_x < sorted_x.gather(1, k - 1), float("-inf")).softmax(-1)
    top_p = column(top_p, sorted_probs.dtype)
    # top_p == 1 keeps all (the cumulative sum's rounding could otherwise cross 1 and drop a token).
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs > top_p) & (top_p < 1)
    x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), float("-inf"))
    return x[0] if single else x


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id from probabilities [vocab]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> int:
    """A token id from logits [vocab]: argmax at temperature 0, else a draw from softmax(logits / T)."""
    if temperature <= 0:
        return int(logits.argmax())
    return draw(filtered_logits(logits.float(), temperature).softmax(-1), generator)
