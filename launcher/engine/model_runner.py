"""Runs one scheduled step on this rank's shard of the model.

The step's chunks are split into micro-batches that flow through the pipeline stages (hidden
states sent to the next stage as soon as a micro-batch is done, so stages overlap). The last stage
samples; the tokens are broadcast to every rank of the replica, which all apply the same updates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from model.batch import BatchLayout, SeqSpan
from model.kv_cache import PagedLatentCache
from model.transformer import Transformer
from parallel.mesh import ParallelMesh

from .sampler import SampledToken, sample_next
from .scheduler import ScheduledChunk


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        mesh: ParallelMesh,
        cache: PagedLatentCache,
        micro_batches: int,
        eos_id: int | None,
    ) -> None:
        self.model = model
        self.mesh = mesh
        self.cache = cache
        self.micro_batches = micro_batches
        self.eos_id = eos_id
        self.dtype = model.compute_dtype()

    @torch.inference_mode()
    def step(self, plan: list[ScheduledChunk]) -> dict[int, SampledToken]:
        """Run the plan; returns {seq_id: sampled} for chunks that sample. On ranks other than the
        replica's last stage, sampled entries carry only the broadcast token."""
        sampled: dict[int, SampledToken] = {}
        pending: list[dist.Work] = []
        for m in range(self.micro_batches):
            self._micro_step(plan[m :: self.micro_batches], sampled, pending)
        for work in pending:
            work.wait()
        return self._share(plan, sampled)

    def _micro_step(
        self, chunks: list[ScheduledChunk], sampled: dict[int, SampledToken], pending: list
    ) -> None:
        mesh, model = self.mesh, self.model
        ids, spans, offset = [], [], 0
        for c in chunks:
            spans.append(SeqSpan(offset, c.length, c.start))
            ids.extend(c.seq.tokens[c.start : c.start + c.length])
            offset += c.length
        layout = BatchLayout.build(spans, self.cache, [c.seq.block_ids for c in chunks], mesh.device)
        if mesh.is_first_stage:
            x = model.embed(torch.tensor(ids, dtype=torch.long, device=mesh.device))
        else:
            x = torch.empty(offset, model.args.hidden_size, dtype=self.dtype, device=mesh.device)
            if offset:  # both sides know the size; nothing travels for an empty micro-batch
                dist.recv(x, mesh.peer_rank(mesh.pp_index - 1))
        x = model.run_layers(x, layout)
        if not mesh.is_last_stage:
            if offset:
                pending.append(dist.isend(x.contiguous(), mesh.peer_rank(mesh.pp_index + 1)))
            return
        sampling = [(c, s) for c, s in zip(chunks, spans, strict=True) if c.samples]
        rows = torch.tensor(
            [s.offset + s.length - 1 for _, s in sampling], dtype=torch.long, device=mesh.device
        )
        logits = model.head(model.final_norm(x[rows]))
        seqs = [c.seq for c, _ in sampling]
        for seq, token in zip(seqs, sample_next(logits.cpu(), seqs, self.eos_id), strict=True):
            sampled[seq.seq_id] = token

    def _share(self, plan: list[ScheduledChunk], sampled: dict[int, SampledToken]) -> dict[int, SampledToken]:
        """Broadcast the last stage's tokens to the whole replica (every rank must update alike)."""
        mesh = self.mesh
        ids = [c.seq.seq_id for c in plan if c.samples]
        if mesh.replica.size == 1:
            return sampled
        tokens = torch.tensor([sampled[i].token if i in sampled else -1 for i in ids], dtype=torch.long)
        source = (mesh.shape.pp - 1) * mesh.shape.tp  # last stage, tp index 0, in replica order
        tokens = mesh.replica.broadcast(tokens.to(mesh.device), source).tolist()
        return {i: sampled.get(i, SampledToken(t)) for i, t in zip(ids, tokens, strict=True)}
