"""What moves from a prefill engine to a decode engine, and which bytes a decode rank reads.

A prefill rank publishes a CacheEndpoint: where its latent cache lives (addresses of the registered
pool and fp8 scales), which layers it holds, and its block geometry. A finished prefill hands off a
KVHandoff: the prompt, its first token and the prefill replica's block ids. A decode rank reads, for
each layer it holds, the rows of the blocks it does not already have (a prefix hit), from the prefill
rank of that replica holding the layer; only the prompt's rows travel, never a whole last block.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moelaunch.model.kv_cache import PagedLatentCache


@dataclass(frozen=True)
class CacheEndpoint:
    transport: str  # which library moves the bytes, e.g. mooncake-tcp
    session: str  # the rank's transfer engine, host:port
    replica: int
    tp_index: int
    layer_slots: dict[int, int]  # layer id -> index in the pool's first dimension
    pool: int  # address of the pool [layers, blocks + 1, block_size, width]
    scales: int | None  # address of the fp8 scales [layers, blocks + 1, block_size, 2], or None
    held_blocks: int  # the pool's second dimension
    block_size: int
    row_bytes: int  # one token's latent in the pool
    scale_row_bytes: int  # one token's scales (0 without fp8)

    @classmethod
    def of(
        cls, cache: PagedLatentCache, transport: str, session: str, replica: int, tp_index: int
    ) -> CacheEndpoint:
        scales = cache.scales
        return cls(
            transport,
            session,
            replica,
            tp_index,
            dict(cache.slot_of_layer),
            cache.pool.data_ptr(),
            None if scales is None else scales.data_ptr(),
            cache.pool.shape[1],
            cache.block_size,
            cache.pool.shape[-1] * cache.pool.element_size(),
            0 if scales is None else scales.shape[-1] * scales.element_size(),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CacheEndpoint:
        return cls(**{**d, "layer_slots": {int(k): v for k, v in d["layer_slots"].items()}})

    def compatible(self, other: CacheEndpoint) -> str | None:
        """Why blocks of `other`'s cache cannot be copied into this one, or None."""
        if (self.block_size, self.row_bytes, self.scale_row_bytes) != (
            other.block_size,
            other.row_bytes,
            other.scale_row_bytes,
        ):
            return (
                f"KV caches differ (block_size {self.block_size} vs {other.block_size}, bytes per token "
                f"{self.row_bytes}+{self.scale_row_bytes} vs {other.row_bytes}+{other.scale_row_bytes}): "
                "prefill and decode need the same engine cache settings and dtype"
            )
        return None


@dataclass(frozen=True)
class KVHandoff:
    """A prompt prefilled on `replica` of the prefill engine, its cache held until released."""

    request_id: str
    prompt: list[int]
    first_token: int
    replica: int
    block_ids: list[int]
    endpoints: list[CacheEndpoint]  # the prefill replica's ranks

    def to_dict(self) -> dict:
        return {**asdict(self), "endpoints": [e.to_dict() for e in self.endpoints]}

    @classmethod
    def from_dict(cls, d: dict) -> KVHandoff:
        return cls(**{**d, "endpoints": [CacheEndpoint.from_dict(e) for e in d["endpoints"]]})


@dataclass(frozen=True)
class Reads:
    """One batch of reads from one peer: local and remote addresses and byte counts."""

    peer: str
    local: list[int]
    remote: list[int]
    lengths: list[int]


def source_for_layer(handoff: KVHandoff, layer: int, tp_index: int) -> CacheEndpoint:
    """The prefill rank this decode rank reads `layer` from: TP ranks hold the same latents, so the
    decode TP ranks spread their reads over the prefill TP ranks."""
    holders = sorted((e for e in handoff.endpoints if layer in e.layer_slots), key=lambda e: e.tp_index)
    if not holders:
        raise ValueError(f"no prefill rank of replica {handoff.replica} holds layer {layer}")
    return holders[tp_index % len(holders)]


def plan_reads(
    handoff: KVHandoff, local: CacheEndpoint, dest_blocks: list[int], first_block: int
) -> list[Reads]:
    """The reads that fill dest_blocks[first_block:] with the prompt's rows, grouped by peer
    (blocks before first_block are a prefix this side already holds)."""
    n, size = len(handoff.prompt), local.block_size
    by_peer: dict[str, Reads] = {}
    for layer, slot in sorted(local.layer_slots.items()):
        src = source_for_layer(handoff, layer, local.tp_index)
        reads = by_peer.setdefault(src.session, Reads(src.session, [], [], []))
        src_slot = src.layer_slots[layer]
        for b in range(first_block, -(-n // size)):
            if handoff.block_ids[b] < 0:  # left behind by the prefill side's sliding window: never read
                continue
            rows = min(size, n - b * size)
            here = (slot * local.held_blocks + dest_blocks[b]) * size
            there = (src_slot * src.held_blocks + handoff.block_ids[b]) * size
            reads.local.append(local.pool + here * local.row_bytes)
            reads.remote.append(src.pool + there * src.row_bytes)
            reads.lengths.append(rows * local.row_bytes)
            if local.scales is not None:
                reads.local.append(local.scales + here * local.scale_row_bytes)
                reads.remote.append(src.scales + there * src.scale_row_bytes)
                reads.lengths.append(rows * local.scale_row_bytes)
    return list(by_peer.values())
