"""Next-token distributions from logits: per-row controls (penalties, logit bias, banned and allowed
tokens, a grammar's bitmask), temperature, min-p, top-k and top-p, and the draw.

Everything works on a batch of rows [rows, vocab] with per-row settings as device tensors, built on
the host when the batch is formed: no host sync and no shape that depends on the values, so the step
can be captured whole, draw included. The draw is counter-based: a row's uniform number is a hash of
(seed, position of the drawn token) made with integer tensor ops, so no generator state lives on the
host or in a graph, and a seeded row draws the same token in any batch, on any path (the engine's
eager and static steps, single-sequence generation) and on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelaunch import kernels


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


# Which number a draw takes from its (seed, position): the token itself, or a draft's acceptance test.
DRAW, ACCEPT = 0, 1
_LOW32 = 0xFFFFFFFF


def _times(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x < 2**32 held in int64, in 16-bit halves of c: no product overflows int64,
    so eager, compiled and GPU code agree bit for bit."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _LOW32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of x < 2**32; shifts are logical as x >= 0."""
    x = _times(x ^ (x >> 16), 0x7FEB352D)
    x = _times(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """[rows] float32 in [0, 1), a function of (seed, position, stream) only (seed, position >= 0)."""
    h = _mix(seed & _LOW32)
    h = _mix(h ^ (seed >> 32))
    h = _mix(h ^ ((2 * position + stream) & _LOW32))  # one stream per parity: DRAW and ACCEPT
    return (h >> 8).float() / float(1 << 24)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[rows] the token where each row's cumulative probability first exceeds u times its total (never
    a zero-probability token: its cumulative sum equals its predecessor's)."""
    cumulative = probs.cumsum(-1)
    index = (cumulative <= (u * cumulative[:, -1]).unsqueeze(1)).sum(-1)
    # Rounding can put u * total at the total itself: the likeliest token then.
    return torch.where(index < probs.shape[-1], index, probs.argmax(-1))


@dataclass
class RowSampling:
    """Per-row draw settings. A filter may be one number when no row uses it (its cost is then
    skipped); temperature 0 marks a greedy row."""

    temperature: torch.Tensor  # [rows] float
    seed: torch.Tensor  # [rows] long, >= 0
    position: torch.Tensor  # [rows] long: the index in its sequence of the token drawn
    top_k: torch.Tensor | int = 0
    top_p: torch.Tensor | float = 1.0
    min_p: torch.Tensor | float = 0.0


def next_tokens(
    logits: torch.Tensor, s: RowSampling, sampled: bool, guess: torch.Tensor | None = None
) -> torch.Tensor:
    """[rows] long: the argmax in greedy rows, a draw from the filtered softmax in the others.

    sampled: whether any row samples (False skips the draw). guess: [rows] a draft token per row (-1:
    none), kept with probability p(guess), else the draw is from p without it (exact rejection
    sampling of a point guess); a greedy row's argmax is compared with its guess by the caller."""
    best = kernels.row_argmax(logits)
    if not sampled:
        return best
    greedy = s.temperature <= 0
    temperature = torch.where(greedy, 1.0, s.temperature)
    probs = filtered_logits(logits, temperature, s.top_k, s.top_p, s.min_p).softmax(-1)
    u = uniform(s.seed, s.position, DRAW)
    if guess is None:
        return torch.where(greedy, best, inverse_cdf(probs, u))
    has_guess = (guess >= 0).unsqueeze(1)
    at_guess = has_guess & (torch.arange(probs.shape[-1], device=probs.device) == guess.unsqueeze(1))
    p_guess = (probs * at_guess).sum(-1)
    keep = uniform(s.seed, s.position, ACCEPT) < p_guess
    drawn = torch.where(keep, guess, inverse_cdf(probs.masked_fill(at_guess, 0.0), u))
    return torch.where(greedy, best, drawn)


def greedy_and_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([rows] argmax, [rows] whether finite) of greedy rows' logits, from one pass over them."""
    return kernels.row_argmax_and_finite(logits)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[rows] bool: whether each row of logits holds neither NaN nor inf (broken weights)."""
    return kernels.rows_finite(logits)


def sample(logits: torch.Tensor, temperature: float, seed: int = 0, position: int = 0) -> int:
    """A token id from logits [vocab]: argmax at temperature 0, else the draw `next_tokens` makes for
    (seed, position)."""
    rows = RowSampling(
        torch.tensor([temperature], device=logits.device),
        torch.tensor([seed], device=logits.device),
        torch.tensor([position], device=logits.device),
    )
    return int(next_tokens(logits.float().unsqueeze(0), rows, temperature > 0)[0])
