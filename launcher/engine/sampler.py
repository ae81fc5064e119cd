"""Next tokens for a batch of sequences, each with its own settings and seeded generator, so a
sequence draws the same tokens whatever batch, replica or layout it runs in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence


@dataclass
class SampledToken:
    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def _banned_while_short(seq: Sequence, eos_id: int | None) -> list[int]:
    """Tokens that would end the output before min_tokens."""
    if len(seq.output) >= seq.params.min_tokens:
        return []
    ends = list(seq.params.stop_token_ids)
    if eos_id is not None and not seq.params.ignore_eos:
        ends.append(eos_id)
    return ends


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
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


def sample_next(logits: torch.Tensor, seqs: list[Sequence], eos_id: int | None) -> list[SampledToken]:
    """logits [R, vocab] (fp32) for the R sequences, in order."""
    logprobs = torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
    out = []
    for i, seq in enumerate(seqs):
        row = logits[i]
        banned = _banned_while_short(seq, eos_id)
        if banned:
            row = row.clone()
            row[banned] = float("-inf")
        p = seq.params
        if p.greedy:
            token = int(row.argmax())
        else:
            row = _filter_top_k_top_p(row / p.temperature, p.top_k, p.top_p)
            token = int(torch.multinomial(row.softmax(-1), 1, generator=seq.generator))
        sampled = SampledToken(token)
        if logprobs is not None and p.logprobs is not None:
            sampled.logprob = float(logprobs[i, token])
            top = logprobs[i].topk(p.logprobs) if p.logprobs else None
            sampled.top_logprobs = (
                dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else {}
            )
        out.append(sampled)
    return out
