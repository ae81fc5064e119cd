"""Next tokens for a batch of sequences, each with its own settings and seed, so a sequence draws the
same tokens whatever batch, replica, layout or step path it runs in.

Every row's token is drawn on the device by `device_tokens` (moelaunch.model.sampling.next_tokens: a
counter-based draw keyed on the sequence's seed and the token's position), the same function the
static decode step runs inside itself; only the ids come back.

A step's per-row controls (penalties, logit bias, min_tokens and bad-word bans, allowed tokens, the
grammar's bitmask) are prepared on the host from what is known before the model runs, in a thread
while it runs; they are then applied to all rows at once on the logits' device (moelaunch.model.sampling).

With a speculative draft, the target rows are checked in order: greedy keeps a draft token while it
is the argmax; sampling keeps it with probability p(draft) and otherwise draws from p without it
(the draft is a point guess, so this is exact rejection sampling: outputs keep the target
distribution; every row's verdict is computed on the device at once, the host keeps rows in order
up to the first rejection). After the last kept draft token one more token is drawn from its row. A
sequence with a grammar ignores its draft (the grammar's mask is made for the first row only).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moelaunch.engine.constraints import Constraints
from moelaunch.engine.outputs import NON_FINITE_TOKEN
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.engine.sequence import Sequence
from moelaunch.model.sampling import (
    RowControls,
    RowSampling,
    controlled_logits,
    finite_rows,
    greedy_and_finite,
    next_tokens,
)
from moelaunch.text.tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 20  # SamplingParams.logprobs' upper bound
Batch = list[tuple[Sequence, list[int]]]  # (sequence, its draft tokens): len(draft) + 1 logits rows


@dataclass
class SampledToken:
    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass
class Prepared:
    batch: Batch
    controls: RowControls | None  # None: no row has any control (the logits are used as they are)


def _padded(lists: list[list[int]], pad: int, device: torch.device, dtype=torch.long) -> torch.Tensor:
    width = max(1, max(map(len, lists), default=0))
    return torch.tensor([row + [pad] * (width - len(row)) for row in lists], dtype=dtype, device=device)


class Sampler:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_id: int | None) -> None:
        self.constraints = Constraints(tokenizer, vocab_size)
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self._worker: ThreadPoolExecutor | None = None

    def prepare_async(self, batch: Batch, device: torch.device) -> Future[Prepared]:
        """`prepare`, in the background when a grammar's masks are to be made: call before the model
        runs, take the result after. Without a grammar it is quick and runs here (a thread's GIL
        hand-offs cost the forward more than it saves)."""
        if not any(seq.params.structured_outputs is not None for seq, _ in batch):
            done: Future[Prepared] = Future()
            done.set_result(self.prepare(batch, device))
            return done
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="sampler-prepare")
        return self._worker.submit(self.prepare, batch, device)

    def prepare(self, batch: Batch, device: torch.device) -> Prepared:
        if not any(self.controlled(seq) for seq, _ in batch):  # checked without copying any history
            return Prepared(batch, None)
        rows = [(seq, j, seq.output + draft[:j]) for seq, draft in batch for j in range(len(draft) + 1)]
        vocab, p = self.vocab_size, [seq.params for seq, _, _ in rows]
        banned, grammar_rows = [], []
        for i, (seq, j, history) in enumerate(rows):
            if Constraints.needed(seq.params) and seq.constraints is None:
                seq.constraints = self.constraints.make(seq.params)
            banned.append(self._banned(seq, history))
            if seq.constraints is not None and seq.constraints.matcher is not None and j == 0:
                grammar_rows.append(i)
        grammar = None
        if grammar_rows:
            grammar = self.constraints.grammars.new_bitmask(len(rows))
            for i in grammar_rows:
                seq = rows[i][0]
                seq.constraints.fill_grammar(seq.output, grammar, i)
            grammar = grammar.to(device)

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        # Token lists only for the rows whose penalties read them.
        generated = [
            h if q.presence_penalty or q.frequency_penalty else []
            for (_, _, h), q in zip(rows, p, strict=True)
        ]
        seen = [
            s.prompt + h if q.repetition_penalty != 1 else [] for (s, _, h), q in zip(rows, p, strict=True)
        ]
        controls = RowControls(
            presence=floats([q.presence_penalty for q in p]),
            frequency=floats([q.frequency_penalty for q in p]),
            repetition=floats([q.repetition_penalty for q in p]),
            generated=_padded(generated, vocab, device),
            seen=_padded(seen, vocab, device),
            bias_ids=_padded([[t for t, _ in q.logit_bias] for q in p], vocab, device),
            bias_values=_padded([[b for _, b in q.logit_bias] for q in p], 0, device, torch.float32),
            banned=_padded(banned, vocab, device),
            allowed=_padded([list(q.allowed_token_ids or ()) for q in p], vocab, device),
            restricted=torch.tensor([q.allowed_token_ids is not None for q in p], device=device),
            grammar=grammar,
        )
        return Prepared(batch, controls)

    def controlled(self, seq: Sequence) -> bool:
        """Whether any of the sequence's rows has a control (a min_tokens ban is widest on its first)."""
        q = seq.params
        return (
            q.presence_penalty != 0
            or q.frequency_penalty != 0
            or q.repetition_penalty != 1
            or bool(q.logit_bias)
            or q.allowed_token_ids is not None
            or Constraints.needed(q)
            or bool(self._min_tokens_ban(seq, 0))
        )

    def _min_tokens_ban(self, seq: Sequence, n_new: int) -> list[int]:
        """Tokens that would end the output before min_tokens (n_new: tokens already taken this step)."""
        if len(seq.output) + n_new >= seq.params.min_tokens:
            return []
        ends = list(seq.params.stop_token_ids)
        if self.eos_id is not None and not seq.params.ignore_eos:
            ends.append(self.eos_id)
        return ends

    def _banned(self, seq: Sequence, history: list[int]) -> list[int]:
        banned = self._min_tokens_ban(seq, len(history) - len(seq.output))
        if seq.constraints is not None:
            banned += seq.constraints.banned_after(history)
        return banned

    def sample(self, logits: torch.Tensor, prepared: Prepared) -> list[list[SampledToken]]:
        """logits [rows, vocab]: for each (sequence, draft) of the batch, len(draft) + 1 consecutive rows.
        Returns each sequence's kept draft tokens and one more (at least one token)."""
        batch = prepared.batch
        raw = logits
        if prepared.controls is not None:
            logits = controlled_logits(logits, prepared.controls)
        rows = [(seq, j, draft) for seq, draft in batch for j in range(len(draft) + 1)]
        # A grammar's sequence ignores its draft (its mask is made for the first row only).
        guesses = [
            draft[j] if j < len(draft) and seq.params.structured_outputs is None else -1
            for seq, j, draft in rows
        ]
        drawn_at = [(seq.params, seq.seed, seq.num_tokens + j) for seq, j, _ in rows]
        settings = row_sampling(drawn_at, raw.device)
        guess = torch.tensor(guesses, device=raw.device) if any(g >= 0 for g in guesses) else None
        sampled = any(not seq.params.greedy for seq, _ in batch)
        tokens = device_tokens(raw, logits, settings, sampled, guess).tolist()  # the step's one sync
        out, at = [], 0
        for seq, draft in batch:
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs = torch.log_softmax(raw[at : at + len(draft) + 1], dim=-1)
            kept: list[SampledToken] = []
            for j in range(len(draft) + 1):
                token, guess_j = tokens[at + j], guesses[at + j]
                if token == NON_FINITE_TOKEN:  # never a draft's guess: the row ends here
                    kept.append(SampledToken(NON_FINITE_TOKEN))
                    break
                kept.append(_record(token, logprobs, j, seq))
                if token != guess_j:
                    break
            out.append(kept)
            at += len(draft) + 1
        return out


def row_sampling(rows: list[tuple[SamplingParams, int, int]], device: torch.device) -> RowSampling:
    """Draw settings of rows given as (params, seed, position of the drawn token). A filter no row
    uses stays one number (the sort over the vocabulary is the costly part)."""
    p = [q for q, _, _ in rows]
    return RowSampling(
        temperature=torch.tensor([q.temperature for q in p], dtype=torch.float32, device=device),
        seed=torch.tensor([seed for _, seed, _ in rows], dtype=torch.long, device=device),
        position=torch.tensor([pos for _, _, pos in rows], dtype=torch.long, device=device),
        top_k=torch.tensor([q.top_k for q in p], device=device) if any(q.top_k > 0 for q in p) else 0,
        top_p=torch.tensor([q.top_p for q in p], device=device) if any(q.top_p < 1 for q in p) else 1.0,
        min_p=torch.tensor([q.min_p for q in p], device=device) if any(q.min_p > 0 for q in p) else 0.0,
    )


def device_tokens(
    raw: torch.Tensor, logits: torch.Tensor, s: RowSampling, sampled: bool, guess: torch.Tensor | None = None
) -> torch.Tensor:
    """[rows] next tokens on the logits' device (`next_tokens` over the controlled logits), with
    NON_FINITE_TOKEN where the raw logits hold a NaN or inf (broken weights). The eager and the static
    step both sample with this, so a row gets the same token from either."""
    if raw is logits and not sampled and guess is None:
        best, finite = greedy_and_finite(raw)  # greedy rows, uncontrolled: one pass for both
        return torch.where(finite, best, NON_FINITE_TOKEN)
    finite = finite_rows(raw)
    return torch.where(finite, next_tokens(logits, s, sampled, guess), NON_FINITE_TOKEN)


def packed_logprobs(raw: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[rows, 2 + 2 k] float, to come back with the tokens in one transfer: the token, its
    log-probability, then the k likeliest tokens' log-probabilities and their ids (k: the most a
    request may ask for, within the vocabulary). Ids are exact as floats below 2**24."""
    logprobs = torch.log_softmax(raw.float(), dim=-1)
    chosen = logprobs.gather(1, tokens.clamp(min=0).unsqueeze(1))
    top = logprobs.topk(min(MAX_TOP_LOGPROBS, raw.shape[-1]), dim=-1)
    return torch.cat([tokens.unsqueeze(1).float(), chosen, top.values, top.indices.float()], dim=1)


def unpacked_logprobs(row: list[float], n_top: int | None) -> SampledToken:
    """A `packed_logprobs` row as the token with its log-probabilities (none when not asked)."""
    token = int(row[0])
    if n_top is None or token == NON_FINITE_TOKEN:
        return SampledToken(token)
    k = (len(row) - 2) // 2
    values, ids = row[2 : 2 + n_top], row[2 + k : 2 + k + n_top]
    return SampledToken(token, row[1], {int(i): v for i, v in zip(ids, values, strict=True)})


def _record(token: int, logprobs: torch.Tensor | None, j: int, seq: Sequence) -> SampledToken:
    sampled = SampledToken(token)
    n_top = seq.params.logprobs
    if logprobs is not None and n_top is not None:
        sampled.logprob = float(logprobs[j, token])
        top = logprobs[j].topk(n_top)
        sampled.top_logprobs = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return sampled


def sample_batch(
    logits: torch.Tensor, batch: Batch, eos_id: int | None, tokenizer: Tokenizer | None = None
) -> list[list[SampledToken]]:
    """One step's tokens without a model runner (tests, tools): prepare and sample at once."""
    sampler = Sampler(tokenizer, logits.shape[-1], eos_id)
    return sampler.sample(logits, sampler.prepare(batch, logits.device))
