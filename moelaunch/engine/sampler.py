"""Next tokens for a batch of sequences, each with its own settings and seeded generator, so a
sequence draws the same tokens whatever batch, replica or layout it runs in.

With a speculative draft, the target rows are checked in order: greedy keeps a draft token while it
is the argmax; sampling keeps it with probability p(draft) and otherwise draws from p without it
(the draft is a point guess, so this is exact rejection sampling: outputs keep the target
distribution). After the last kept draft token one more token is drawn from its row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelaunch.engine.sequence import Sequence
from moelaunch.model.sampling import draw, filtered_logits


@dataclass
class SampledToken:
    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def _banned_while_short(seq: Sequence, n_new: int, eos_id: int | None) -> list[int]:
    """Tokens that would end the output before min_tokens (n_new: tokens already taken this step)."""
    if len(seq.output) + n_new >= seq.params.min_tokens:
        return []
    ends = list(seq.params.stop_token_ids)
    if eos_id is not None and not seq.params.ignore_eos:
        ends.append(eos_id)
    return ends


def _target(row: torch.Tensor, seq: Sequence, n_new: int, eos_id: int | None) -> torch.Tensor:
    """Logits after min_tokens bans; for sampling also temperature, top-k and top-p."""
    banned = _banned_while_short(seq, n_new, eos_id)
    if banned:
        row = row.clone()
        row[banned] = float("-inf")
    p = seq.params
    return row if p.greedy else filtered_logits(row, p.temperature, p.top_k, p.top_p)


def _record(token: int, logprobs: torch.Tensor | None, j: int, seq: Sequence) -> SampledToken:
    sampled = SampledToken(token)
    n_top = seq.params.logprobs
    if logprobs is not None and n_top is not None:
        sampled.logprob = float(logprobs[j, token])
        top = logprobs[j].topk(n_top)
        sampled.top_logprobs = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return sampled


def sample_sequence(
    rows: torch.Tensor, seq: Sequence, draft: list[int], eos_id: int | None
) -> list[SampledToken]:
    """rows [len(draft) + 1, vocab]: the target logits at the sequence's last token and each draft
    token. Returns the kept draft tokens and one more (at least one token)."""
    logprobs = torch.log_softmax(rows, dim=-1) if seq.params.logprobs is not None else None
    out: list[SampledToken] = []
    for j in range(len(draft) + 1):
        target = _target(rows[j], seq, len(out), eos_id)
        guess = draft[j] if j < len(draft) else None
        if seq.params.greedy:
            token = int(target.argmax())
        else:
            probs = target.softmax(-1)
            if guess is not None and torch.rand(1, generator=seq.generator).item() < probs[guess].item():
                token = guess
            else:
                if guess is not None:
                    probs[guess] = 0.0
                token = draw(probs, seq.generator)
        out.append(_record(token, logprobs, j, seq))
        if token != guess:
            break
    return out


def sample_batch(
    logits: torch.Tensor, requests: list[tuple[Sequence, list[int]]], eos_id: int | None
) -> list[list[SampledToken]]:
    """`sample_sequence` for each (sequence, draft) over consecutive blocks of len(draft) + 1 rows.

    Plain greedy sequences (no draft, no min_tokens ban, no logprobs) take their token from one argmax
    over the whole batch: one call instead of one per sequence, which shows at large decode batches.
    """
    argmax = logits.argmax(dim=-1).tolist()
    out, at = [], 0
    for seq, draft in requests:
        p = seq.params
        if not draft and p.greedy and p.logprobs is None and not _banned_while_short(seq, 0, eos_id):
            out.append([SampledToken(argmax[at])])
        else:
            out.append(sample_sequence(logits[at : at + len(draft) + 1], seq, draft, eos_id))
        at += len(draft) + 1
    return out
