"""Generation on a sharded model, run identically (SPMD) by every rank of the mesh.

Requests are dealt to DP replicas round-robin; each replica keeps its own sequences and latent
cache. A step runs every active sequence of the replica once (the whole prompt first, then one
token), split into micro-batches that flow through the pipeline stages so stages overlap. The last
stage samples, and the tokens are broadcast to every rank of the replica. All replicas take the same
number of steps and micro-batches, an idle one with empty batches, so every MoE all-to-all has all
its members.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from model.batch import BatchLayout, SeqSpan
from model.sampling import sample
from model.transformer import Transformer

from .mesh import ParallelMesh


@dataclass(frozen=True)
class GenRequest:
    id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()


@dataclass
class GenResult:
    id: int
    token_ids: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)  # per generated token, when recorded


@dataclass
class _Sequence:
    request: GenRequest
    row: int  # cache row
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    prefilled: bool = False
    done: bool = False

    def next_chunk(self) -> tuple[list[int], int]:
        """Tokens to feed this step and the position of the first."""
        if not self.prefilled:
            return self.request.prompt, 0
        return self.tokens[-1:], len(self.request.prompt) + len(self.tokens) - 1

    def accept(self, token: int) -> None:
        self.tokens.append(token)
        r = self.request
        self.done = token in r.stop_ids or len(self.tokens) >= r.max_new_tokens


TokenCallback = Callable[[int, int], None]  # (request id, token id)


class SpmdGenerator:
    def __init__(
        self,
        model: Transformer,
        mesh: ParallelMesh,
        micro_batches: int | None = None,
        record_logits: bool = False,
    ) -> None:
        self.model = model
        self.mesh = mesh
        self.micro_batches = micro_batches or mesh.shape.pp
        self.record_logits = record_logits
        self.dtype = next(iter(model.model.layers.values())).input_layernorm.weight.dtype

    @torch.inference_mode()
    def generate(self, requests: list[GenRequest], on_token: TokenCallback | None = None) -> list[GenResult]:
        """Every rank passes the same requests; every rank gets every result back."""
        mesh = self.mesh
        for r in requests:
            if not r.prompt:
                raise ValueError(f"request {r.id} has an empty prompt")
        mine = [r for i, r in enumerate(requests) if i % mesh.shape.dp == mesh.dp_index]
        max_len = max((len(r.prompt) + r.max_new_tokens for r in mine), default=1)
        cache = self.model.new_cache(max(len(mine), 1), max_len)
        seqs = [_Sequence(r, i, torch.Generator().manual_seed(r.seed)) for i, r in enumerate(mine)]
        while self._anyone_active(seqs):
            active = [s for s in seqs if not s.done]
            sampled: dict[int, int] = {}
            pending_sends: list[dist.Work] = []
            for m in range(self.micro_batches):
                self._micro_step(active[m :: self.micro_batches], cache, sampled, pending_sends)
            for work in pending_sends:
                work.wait()
            tokens = self._share_tokens(active, sampled)
            for seq, token in zip(active, tokens, strict=True):
                seq.accept(token)
                if on_token is not None:
                    on_token(seq.request.id, token)
        return self._collect(requests, seqs)

    def _anyone_active(self, seqs: list[_Sequence]) -> bool:
        flag = torch.tensor([int(any(not s.done for s in seqs))])
        return bool(self.mesh.world.all_reduce(flag).item())

    def _micro_step(
        self, group: list[_Sequence], cache, sampled: dict[int, int], pending_sends: list[dist.Work]
    ) -> None:
        mesh, model = self.mesh, self.model
        ids, spans, offset = [], [], 0
        for seq in group:
            chunk, start = seq.next_chunk()
            spans.append(SeqSpan(offset, len(chunk), start))
            ids.extend(chunk)
            offset += len(chunk)
        layout = BatchLayout.build(spans, cache, [[s.row] for s in group], mesh.device)
        if mesh.is_first_stage:
            x = model.embed(torch.tensor(ids, dtype=torch.long, device=mesh.device))
        else:
            x = torch.empty(offset, model.args.hidden_size, dtype=self.dtype, device=mesh.device)
            if offset:  # both sides know the size: nothing is sent for an empty micro-batch
                dist.recv(x, mesh.peer_rank(mesh.pp_index - 1))
        x = model.run_layers(x, layout)
        for seq in group:
            seq.prefilled = True
        if not mesh.is_last_stage:
            if offset:
                pending_sends.append(dist.isend(x.contiguous(), mesh.peer_rank(mesh.pp_index + 1)))
            return
        last_rows = torch.tensor(
            [s.offset + s.length - 1 for s in spans], dtype=torch.long, device=mesh.device
        )
        logits = model.head(model.final_norm(x[last_rows]))
        for i, seq in enumerate(group):
            r = seq.request
            sampled[id(seq)] = int(sample(logits[i : i + 1], r.temperature, seq.generator))
            if self.record_logits:
                seq.logits.append(logits[i].cpu())

    def _share_tokens(self, active: list[_Sequence], sampled: dict[int, int]) -> list[int]:
        """The last stage's sampled tokens, broadcast to every rank of the replica."""
        mesh = self.mesh
        tokens = torch.tensor([sampled.get(id(s), -1) for s in active], dtype=torch.long)
        source = (mesh.shape.pp - 1) * mesh.shape.tp  # last stage, tp index 0, in replica-group order
        return mesh.replica.broadcast(tokens.to(mesh.device), source).tolist()

    def _collect(self, requests: list[GenRequest], seqs: list[_Sequence]) -> list[GenResult]:
        mesh = self.mesh
        reporter = mesh.is_last_stage and mesh.tp_index == 0  # one rank per replica reports
        local = [GenResult(s.request.id, s.tokens, s.logits) for s in seqs] if reporter else []
        gathered = [local]
        if mesh.world.size > 1:
            gathered = [None] * mesh.world.size
            dist.all_gather_object(gathered, local, group=mesh.world.pg)
        by_id = {res.id: res for part in gathered for res in part}
        return [by_id[r.id] for r in requests]
