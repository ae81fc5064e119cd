"""Runs one scheduled step on this rank's shard of the model.

The step's chunks are split into micro-batches that flow through the pipeline stages (hidden
states sent to the next stage as soon as a micro-batch is done, so stages overlap). The last stage
samples, verifying any speculative draft; with MTP it then runs the MTP layer over the positions
whose next token is now known, which fills the MTP layer's cache and drafts the next step's guess.
The results are broadcast to every rank of the replica, which all apply the same updates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moelaunch.engine.sampler import SampledToken, Sampler, unpacked_logprobs
from moelaunch.engine.scheduler import ScheduledChunk
from moelaunch.engine.static_decode import GREEDY, LOGITS, LOGPROBS, SAMPLED, StaticDecode
from moelaunch.model.batch import BatchLayout, SeqSpan
from moelaunch.model.kv_cache import PagedLatentCache
from moelaunch.model.moe import MoE
from moelaunch.model.transformer import Transformer
from moelaunch.parallel.mesh import ParallelMesh
from moelaunch.text.tokenizer import Tokenizer

MAX_DRAFT = 1  # MTP depth 1: one guessed token per step


@dataclass
class StepResult:
    tokens: list[SampledToken] = field(default_factory=list)  # kept draft tokens, then one sampled
    draft: list[int] = field(default_factory=list)  # the guess for the next step


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        mesh: ParallelMesh,
        cache: PagedLatentCache,
        micro_batches: int,
        eos_id: int | None,
        use_mtp: bool = False,
        tokenizer: Tokenizer | None = None,
        static: StaticDecode | None = None,
    ) -> None:
        self.model = model
        self.mesh = mesh
        self.cache = cache
        self.micro_batches = micro_batches
        self.eos_id = eos_id
        self.use_mtp = use_mtp
        self.dtype = model.compute_dtype()
        self.sampler = Sampler(tokenizer, model.args.vocab_size, eos_id)
        self.static = static  # the static decode step, for decode-only micro-batches it takes
        # The MTP layer's MoE exchanges rows with other replicas' ranks (expert all-to-all): then every
        # rank runs it each step, drafting or not; otherwise a step with no drafting sequence skips it.
        self.mtp_always = any(
            not layer.mlp.routes_on_device for layer in model.mtp if isinstance(layer.mlp, MoE)
        )

    @torch.inference_mode()
    def step(self, plan: list[ScheduledChunk]) -> dict[int, StepResult]:
        """Run the plan; returns {seq_id: result} for the chunks that sample, on every rank."""
        results: dict[int, StepResult] = {}
        pending: list[dist.Work] = []
        for m in range(self.micro_batches):
            self._micro_step(plan[m :: self.micro_batches], results, pending)
        for work in pending:
            work.wait()
        return self._share(plan, results)

    def _micro_step(
        self, chunks: list[ScheduledChunk], results: dict[int, StepResult], pending: list
    ) -> None:
        if self.static is not None and self.static.takes(chunks):
            self._static_step(chunks, results)
            return
        mesh, model = self.mesh, self.model
        ids, spans, offset = [], [], 0
        for c in chunks:
            spans.append(SeqSpan(offset, c.length, c.start))
            ids.extend(c.token_ids)
            offset += c.length
        layout = BatchLayout.build(spans, self.cache, [c.seq.block_ids for c in chunks], mesh.device)
        sampling = [(c, s) for c, s in zip(chunks, spans, strict=True) if c.samples]
        if mesh.is_last_stage:  # the sampling controls and grammar masks, made while the model runs
            prepared = self.sampler.prepare_async([(c.seq, list(c.draft)) for c, _ in sampling], mesh.device)
        if mesh.is_first_stage:
            x = model.embed(torch.tensor(ids, dtype=torch.long, device=mesh.device))
        else:
            x = torch.empty(offset, model.args.hidden_size, dtype=self.dtype, device=mesh.device)
            if offset:  # both sides know the size; nothing travels for an empty micro-batch
                mesh.recv_from_previous_stage(x)
        x = model.run_layers(x, layout)
        if not mesh.is_last_stage:
            if offset:
                pending.append(mesh.send_to_next_stage(x))
            return
        hidden = model.final_norm(x)
        # Target rows: the sequence's last real token and every draft token after it.
        rows = [
            r for c, s in sampling for r in range(s.offset + s.length - len(c.draft) - 1, s.offset + s.length)
        ]
        logits = model.head(hidden[torch.tensor(rows, dtype=torch.long, device=mesh.device)])
        tokens = self.sampler.sample(logits, prepared.result())
        for (c, _), sampled in zip(sampling, tokens, strict=True):
            results[c.seq.seq_id] = StepResult(sampled)
        if self.use_mtp:
            drafting = [(c, s) for c, s in zip(chunks, spans, strict=True) if c.seq.drafts]
            if drafting or self.mtp_always:
                self._draft(drafting, hidden, results)

    def _static_step(self, chunks: list[ScheduledChunk], results: dict[int, StepResult]) -> None:
        """A decode-only micro-batch through the static step, which samples inside itself; a batch
        with per-row controls takes the logits and samples after it (the controls prepared while the
        step runs)."""
        sampling = [(i, c) for i, c in enumerate(chunks) if c.samples]
        sampler = self.sampler
        if any(sampler.controlled(c.seq) for _, c in sampling):
            prepared = sampler.prepare_async([(c.seq, []) for _, c in sampling], self.mesh.device)
            logits = self.static.run(chunks, LOGITS)
            rows = torch.tensor([i for i, _ in sampling], dtype=torch.long, device=logits.device)
            tokens = sampler.sample(logits[rows], prepared.result())
        elif any(c.seq.params.logprobs is not None for _, c in sampling):
            packed = self.static.run(chunks, LOGPROBS).tolist()  # the step's one transfer back
            tokens = [[unpacked_logprobs(packed[i], c.seq.params.logprobs)] for i, c in sampling]
        else:
            variant = SAMPLED if any(not c.seq.params.greedy for _, c in sampling) else GREEDY
            ids = self.static.run(chunks, variant).tolist()  # the step's one transfer back
            tokens = [[SampledToken(ids[i])] for i, _ in sampling]
        for (_, c), sampled in zip(sampling, tokens, strict=True):
            results[c.seq.seq_id] = StepResult(sampled)

    def _draft(self, chunks: list[tuple[ScheduledChunk, SeqSpan]], hidden, results) -> None:
        """MTP over each drafting chunk's valid positions (next token known); the last one's argmax is
        the draft. Only the drafting rows go through the head."""
        rows, next_ids, mtp_spans, drafting = [], [], [], []
        for c, s in chunks:
            result = results.get(c.seq.seq_id)
            kept = len(result.tokens) - 1 if result else 0
            valid = c.length - len(c.draft) + kept
            # A non-finite row's token (its sequence ends this step) stands in as 0 for the batch's shape.
            known = c.seq.tokens + [max(t.token, 0) for t in result.tokens] if result else c.seq.tokens
            mtp_spans.append(SeqSpan(len(rows), valid, c.start))
            rows.extend(range(s.offset, s.offset + valid))
            next_ids.extend(known[c.start + 1 : c.start + 1 + valid])
            if result:
                drafting.append((c.seq.seq_id, len(rows) - 1))
        device = self.mesh.device
        layout = BatchLayout.build(mtp_spans, self.cache, [c.seq.block_ids for c, _ in chunks], device)
        index = torch.tensor(rows, dtype=torch.long, device=device)
        heads = torch.tensor([row for _, row in drafting], dtype=torch.long, device=device)
        logits = self.model.mtp_forward(
            hidden[index], torch.tensor(next_ids, dtype=torch.long, device=device), layout, heads
        )
        best = logits.argmax(dim=-1).tolist()
        for (seq_id, _), token in zip(drafting, best, strict=True):
            results[seq_id].draft = [token]

    def _share(self, plan: list[ScheduledChunk], results: dict[int, StepResult]) -> dict[int, StepResult]:
        """Broadcast the last stage's results to the whole replica (every rank must update alike)."""
        mesh = self.mesh
        if mesh.dp_replica.size == 1:
            return results
        ids = [c.seq.seq_id for c in plan if c.samples]
        width = MAX_DRAFT + 2  # tokens (up to MAX_DRAFT + 1; NON_FINITE_TOKEN is -2) and one draft, -1 padded
        table = torch.full((len(ids), width), -1, dtype=torch.long)
        for i, seq_id in enumerate(ids):
            if seq_id in results:
                r = results[seq_id]
                table[i, : len(r.tokens)] = torch.tensor([t.token for t in r.tokens])
                table[i, -1] = r.draft[0] if r.draft else -1
        source = (mesh.shape.pp - 1) * mesh.shape.tp  # last stage, tp index 0, in replica order
        table = mesh.dp_replica.broadcast(table.to(mesh.device), source).cpu()
        if mesh.dp_replica.index == source:
            return results  # the source keeps its log-probabilities; the table is what it sent
        shared = {}
        for i, seq_id in enumerate(ids):
            sampled = [SampledToken(t) for t in table[i, :-1].tolist() if t != -1]
            draft = [int(table[i, -1])] if table[i, -1] >= 0 else []
            shared[seq_id] = StepResult(sampled, draft)
        return shared
