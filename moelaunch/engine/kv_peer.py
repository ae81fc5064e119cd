"""One rank's side of prefill/decode disaggregation: its cache registered with the transfer engine,
every rank's endpoint known on rank 0, and the reads that fill a prefilled sequence's blocks."""

from __future__ import annotations

import os

from moelaunch.engine.kv_handoff import CacheEndpoint, KVHandoff, plan_reads
from moelaunch.engine.kv_transport import MooncakeTransport, local_host
from moelaunch.engine.step_protocol import gather_json
from moelaunch.model.kv_cache import PagedLatentCache
from moelaunch.parallel.mesh import ParallelMesh


class KVPeer:
    def __init__(self, cache: PagedLatentCache, mesh: ParallelMesh, timeout_s: float) -> None:
        self.cache = cache
        self.transport = MooncakeTransport(local_host(os.environ.get("MASTER_ADDR")), timeout_s)
        self.transport.register(cache.pool)
        if cache.scales is not None:
            self.transport.register(cache.scales)
        t = self.transport
        self.endpoint = CacheEndpoint.of(cache, t.name, t.session, mesh.dp_index, mesh.tp_index)
        mine = self.endpoint.to_dict()
        if mesh.world.size == 1:
            every = [mine]
        else:
            every = gather_json(mine, mesh.global_ranks[0], mesh.world.pg, mesh.device)
        # Rank 0 hands these out with each prefilled prompt; elsewhere None.
        self.endpoints = None if every is None else [CacheEndpoint.from_dict(e) for e in every]

    def replica_endpoints(self, replica: int) -> list[CacheEndpoint]:
        return [e for e in self.endpoints if e.replica == replica]

    def connect(self, peer: CacheEndpoint) -> None:
        """Make first contact with a prefill rank: one row read between the two scratch blocks (which
        hold no sequence's tokens)."""
        local, scratch = self.endpoint, (peer.held_blocks - 1) * peer.block_size
        mine = local.pool + (local.held_blocks - 1) * local.block_size * local.row_bytes
        self.transport.read(peer.session, [mine], [peer.pool + scratch * peer.row_bytes], [local.row_bytes])

    def pull(self, handoff: KVHandoff, block_ids: list[int], have_blocks: int) -> int:
        """Read the handed-off prompt's rows into block_ids past the first have_blocks (already here);
        returns the bytes read."""
        total = 0
        for reads in plan_reads(handoff, self.endpoint, block_ids, have_blocks):
            self.transport.read(reads.peer, reads.local, reads.remote, reads.lengths)
            total += sum(reads.lengths)
        self.cache.refresh_block_means(block_ids[have_blocks : len(handoff.prompt) // self.cache.block_size])
        return total
