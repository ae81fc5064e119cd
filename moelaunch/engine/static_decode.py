"""The static decode step: a decode-only batch's whole forward (embedding, every layer, final norm, LM
head) as one function over a preallocated device buffer padded to a batch bucket, reading nothing back.

The host writes each step's token ids, positions, cache slots, lengths and block tables into one
(pinned) tensor per bucket, copied into the bucket's device buffer in one transfer; the function reads
only that buffer, so its shapes depend on the bucket alone. Padding rows decode token 0 at position 0
in the cache's scratch block (`PagedLatentCache.scratch_block`), touching no sequence.

That makes it compile with torch.compile(fullgraph=True, dynamic=False), one graph per bucket, and
capture on CUDA as one CUDA graph per bucket (`cuda_graphs.capture`). Batches above the largest
bucket, prefill and mixed steps, MTP drafts, pipeline stages, top-k block attention and expert
parallelism across data-parallel replicas (its all-to-all has uneven, host-read counts; EP inside one
tensor-parallel group sums the experts with an all-reduce instead) stay eager.

The step ends with the sampler (`engine.sampler.device_tokens`, the one the eager path runs): each
row's temperature, top-k, top-p, min-p and seed are more columns of the same buffer (floats stored as
their float64 bits), the draw is keyed on (seed, position), so only the token ids come back, in one
transfer. Four variants per bucket (a Python flag, one graph each): GREEDY (argmax only), SAMPLED
(the filters and the draw for every row, greedy rows by argmax), LOGPROBS (SAMPLED with each token's
log-probability and the top 20, packed with the ids) and LOGITS, for the steps whose rows have per-row
controls (penalties, bans, grammar: lists of varying width); those sample after the step, eagerly, with
the same function. CUDA graphs capture GREEDY and SAMPLED.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import numpy as np
import torch

from moelaunch.engine.config import EngineConfig
from moelaunch.engine.cuda_graphs import capture
from moelaunch.engine.sampler import device_tokens, packed_logprobs
from moelaunch.engine.scheduler import ScheduledChunk
from moelaunch.engine.step_ops import StepOps
from moelaunch.model.batch import BatchLayout
from moelaunch.model.kv_cache import PagedLatentCache
from moelaunch.model.moe import MoE
from moelaunch.model.sampling import RowSampling
from moelaunch.model.transformer import Transformer

# Columns of a bucket's buffer before the block table: token id, position, cache slot, length, then the
# draw's temperature, top-k, top-p, min-p (floats as float64 bits) and seed.
FIELDS = 9
GREEDY, SAMPLED, LOGPROBS, LOGITS = "greedy", "sampled", "logprobs", "logits"  # see the module's text
CAPTURED = (GREEDY, SAMPLED)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a step is padded to: 1, 2, 4, 8, then steps of 8, up to the first that holds
    max_num_seqs."""
    sizes = [1, 2, 4, *range(8, max_num_seqs + 8, 8)]
    return [b for b in sizes if b < max_num_seqs] + [next(b for b in sizes if b >= max_num_seqs)]


def bucket_sizes(max_num_seqs: int, sizes: list[int] | None) -> list[int]:
    """The buckets a step is padded to: the configured sizes (engine.cuda_graph_sizes), else
    `decode_buckets`."""
    return sorted(sizes) if sizes else decode_buckets(max_num_seqs)


def static_decode_supported(model: Transformer, cache: PagedLatentCache, single_stage: bool) -> str | None:
    """Why this model shard cannot take the static step, or None when it can."""
    if not single_stage:
        return "pipeline stages exchange hidden states between steps"
    if cache.sparse.topk_blocks is not None:
        return "top-k block attention selects blocks from values"
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if any(not m.routes_on_device for m in moes):
        return "experts spread over data-parallel replicas (dp > 1), or integer experts off the CPU"
    return None


class StaticDecode:
    """One buffer and one step function per bucket; `run` pads a decode-only batch into the smallest
    bucket that holds it."""

    def __init__(
        self,
        model: Transformer,
        cache: PagedLatentCache,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        compile: bool,
        sizes: list[int] | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        # Routed load is counted (engine/routed_load.py): the step tells padding rows apart for it.
        self.mark_padding = any(m.counted is not None for m in model.modules() if isinstance(m, MoE))
        self.device = device
        self.buckets = bucket_sizes(max_num_seqs, sizes)
        self.width = -(-max_model_len // cache.block_size)  # block table columns
        self.buffers: dict[int, torch.Tensor] = {}
        self.hosts: dict[int, torch.Tensor] = {}
        self.strict = os.environ.get("MOELAUNCH_STRICT_DECODE") == "1"
        self.step_fn: Callable[[torch.Tensor, str], torch.Tensor] = self.forward
        if compile:
            # One graph per bucket and variant: the same function recompiles once per pair.
            variants = 4 * len(self.buckets)
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, variants)
            dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * variants)
            # On the CPU the graph's wrapper is C++ too: the step runs without Python between its ops
            # (4.2-4.5 ms a step against 4.5-4.7 with the Python wrapper at batch 16; docs/benchmarks.md).
            options: dict[str, object] = {"cpp_wrapper": True} if device.type == "cpu" else {}
            # The model's modules do not change under a compiled step: what changes them (an expert
            # placement) resets compilation and builds a new StaticDecode (Engine.rebuild_static_decode).
            # So the step's guards skip them: ~700 checks of module attributes, 0.05-0.1 ms a step
            # (batch 1 bf16 on the bench model +3-8%, docs/benchmarks.md, issue 30).
            options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
            self.step_fn = torch.compile(self.forward, fullgraph=True, dynamic=False, options=options)
        # Set by CUDA graph capture: replay(bucket, variant) for the CAPTURED variants.
        self.replay: Callable[[int, str], torch.Tensor] | None = None

    @torch.inference_mode()
    def prime(self) -> None:
        """One eager step of padding rows at the smallest and the largest bucket, before any is traced:
        it makes the model's decode-time caches (MLA's absorbed per-head stacks of each form, a quantized
        kv_b's dequantized matrix), which compiled steps then read instead of remaking on every call."""
        for bucket in sorted({self.buckets[0], self.buckets[-1]}):
            self.forward(self.buffer(bucket), GREEDY)

    def takes(self, chunks: list[ScheduledChunk]) -> bool:
        """Decode-only (one token per sequence, no draft), and within the largest bucket."""
        return 0 < len(chunks) <= self.buckets[-1] and all(c.length == 1 and not c.draft for c in chunks)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def buffer(self, bucket: int) -> torch.Tensor:
        """The bucket's device buffer, made (every row padding) on first use."""
        if bucket not in self.buffers:
            size = bucket * (FIELDS + self.width)
            pin = self.device.type == "cuda"
            self.hosts[bucket] = torch.empty(size, dtype=torch.long, pin_memory=pin)
            self.fill(bucket, [])
            self.buffers[bucket] = self.hosts[bucket].to(self.device)
        return self.buffers[bucket]

    def fill(self, bucket: int, chunks: list[ScheduledChunk]) -> None:
        """Write the chunks' rows, then padding rows, into the bucket's host tensor."""
        host = self.hosts[bucket].numpy()
        fields = host[: FIELDS * bucket].reshape(FIELDS, bucket)
        floats = fields.view(np.float64)  # the same memory: the float columns' bits
        tables = host[FIELDS * bucket :].reshape(bucket, self.width)
        bs, scratch = self.cache.block_size, self.cache.scratch_block
        tables[:] = scratch
        fields[:4] = np.array([0, 0, scratch * bs, 1])[:, None]
        floats[4], fields[5], floats[6], floats[7], fields[8] = 0.0, -1, 1.0, 0.0, 0  # greedy
        for i, c in enumerate(chunks):
            pos, blocks, q = c.start, c.seq.block_ids, c.seq.params
            fields[0, i] = c.seq.tokens[pos]
            fields[1, i] = pos
            fields[2, i] = blocks[pos // bs] * bs + pos % bs
            fields[3, i] = pos + 1
            floats[4, i], fields[5, i], floats[6, i], floats[7, i] = q.temperature, q.top_k, q.top_p, q.min_p
            fields[8, i] = c.seq.seed
            tables[i, : len(blocks)] = blocks

    def run(self, chunks: list[ScheduledChunk], variant: str) -> torch.Tensor:
        """On the device, for the chunks' next tokens: their ids [len(chunks)] (NON_FINITE_TOKEN where
        the logits are not finite) for GREEDY and SAMPLED, `packed_logprobs` rows for LOGPROBS, their
        fp32 logits [len(chunks), vocab] for LOGITS."""
        n = len(chunks)
        bucket = self.bucket(n)
        buf = self.buffer(bucket)
        self.fill(bucket, chunks)
        buf.copy_(self.hosts[bucket], non_blocking=True)
        if self.replay is not None and variant in CAPTURED:
            return self.replay(bucket, variant)[:n]
        if self.strict:
            with StepOps(strict=True):
                return self.step_fn(buf, variant)[:n]
        return self.step_fn(buf, variant)[:n]

    def forward(self, buf: torch.Tensor, variant: str) -> torch.Tensor:
        """The step over one bucket's buffer: what `run` returns, for every row of the bucket."""
        bucket = buf.shape[0] // (FIELDS + self.width)
        fields = buf[: FIELDS * bucket].view(FIELDS, bucket)
        ids, positions, slots, seq_lens = fields[:4]
        tables = buf[FIELDS * bucket :].view(bucket, self.width)
        layout = BatchLayout.static_decode(positions, self.cache, tables, slots, seq_lens, self.mark_padding)
        model = self.model
        logits = model.head(model.final_norm(model.run_layers(model.embed(ids), layout)))
        if variant == LOGITS:
            return logits
        floats = fields.view(torch.float64).float()
        settings = RowSampling(
            temperature=floats[4], seed=fields[8], position=positions + 1, top_k=fields[5], top_p=floats[6],
            min_p=floats[7],
        )  # fmt: skip
        tokens = device_tokens(logits, logits, settings, sampled=variant != GREEDY)
        return packed_logprobs(logits, tokens) if variant == LOGPROBS else tokens


def build_static_decode(
    config: EngineConfig,
    model: Transformer,
    cache: PagedLatentCache,
    device: torch.device,
    single_stage: bool,
    max_model_len: int,
    use_mtp: bool,
) -> StaticDecode | None:
    """The static step when compile or CUDA graphs ask for it (or MOELAUNCH_STRICT_DECODE=1, which
    checks it for syncs) and this shard can take it; None keeps every step eager."""
    on_cuda = device.type == "cuda"
    compile = config.compile == "on" or (config.compile == "auto" and on_cuda)
    graphs = on_cuda and (config.cuda_graphs if config.cuda_graphs is not None else True)
    if not (compile or graphs or os.environ.get("MOELAUNCH_STRICT_DECODE") == "1"):
        return None
    reason = "MTP drafts every step" if use_mtp else static_decode_supported(model, cache, single_stage)
    if reason is not None:
        print(f"moelaunch: decode steps stay eager ({reason})", file=sys.stderr)
        return None
    static = StaticDecode(
        model, cache, config.max_num_seqs, max_model_len, device, compile, config.cuda_graph_sizes
    )
    if compile:
        static.prime()
    if graphs:
        buffers = {b: static.buffer(b) for b in static.buckets}
        static.replay = capture(static.step_fn, buffers, CAPTURED, device)
    return static
