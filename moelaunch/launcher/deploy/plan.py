"""The launch plan: where each rank runs, which groups it joins, which layers and experts it holds, and
how much device memory it needs. Built from the deployment file and the model's config.json alone; it
starts nothing, so `launch plan` can check a 671B deployment on a laptop.

Memory per rank (1 GB = 1e9 B, as GPU vendors quote it):
- weights: the tensors of the rank's shard as the real builder makes it (parallel.MeshShard, on the meta
  device): its stage's layers; of those its 1/tp slice of attention heads (q_b, kv_b, o_proj), dense
  MLPs, shared experts and vocab (embedding on the first stage, lm_head on the last); its EP share of
  routed experts; and in full what every TP rank replicates (q_a and kv_a projections, norms, the router
  gate). Bytes per parameter: float32 4, bfloat16 2; fp8 stores projections in 1 byte plus one fp32 scale
  per 128x128 block and keeps embedding, lm_head, norms and gate in bf16. `quantization` (or an int8/int4
  checkpoint) stores projections as int8 (1 B/param + one fp32 scale per output row) or int4 (0.5 B/param +
  one fp32 scale and a 1-byte zero point per 128-column group). The router bias is fp32
  always. The MTP layer is not counted (it is loaded only for speculative decoding).
- KV cache: MLA caches (kv_lora_rank + qk_rope_head_dim) values per token per layer; every TP rank of a
  replica holds its replica's whole latent cache (the latent is shared by all heads). 2 bytes per value
  (4 under float32); with engine.kv_cache_dtype fp8, 1 byte per value plus two fp32 scales per token; top-k
  attention adds one fp32 mean latent per block and layer. The cache takes what the weights and
  activations leave of the usable memory (engine.kv_cache_memory when given), in whole blocks, up to the
  most it could use: engine.max_num_seqs sequences of engine.max_model_len tokens; as in vLLM,
  max_num_seqs bounds the batch, and sequences beyond what the cache holds at full length wait or are
  preempted. A deployment fits when the cache holds one sequence of max_model_len. The launcher gives
  the engine this budget (LaunchPlan.engine_kv_budget), so the plan's figure is the engine's.
- activations: engine.max_num_batched_tokens x hidden_size x 2 bytes (4 under float32) x ACTIVATION_BUFFERS,
  plus the latent-wide buffers of a prefill step: (LATENT_BUFFERS x max_num_batched_tokens + 2 x the key
  segment, `prefill_attention.KEY_SEGMENT` or max_model_len if shorter) x (kv_lora_rank + qk_rope_head_dim)
  x the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moelaunch.engine.config import default_kv_cache_fraction
from moelaunch.engine.eplb import check_eplb
from moelaunch.launcher.deploy.config import DeployConfig
from moelaunch.launcher.deploy.weights import WeightPart, is_fp8, weight_parts
from moelaunch.model import prefill_attention
from moelaunch.model.config import ModelArgs, load_args
from moelaunch.model.kv_cache import PagedLatentCache
from moelaunch.model.quantization import IntQuant, resolve_quantization
from moelaunch.parallel.eplb import balanced_placements
from moelaunch.parallel.expert_parallel import ExpertPlacement
from moelaunch.parallel.mesh import LayoutError, MeshShape
from moelaunch.parallel.parallelize import check_layout
from moelaunch.parallel.placement_file import read_placement_file
from moelaunch.parallel.shard_tensors import check_int4_slices, shard_tensors
from moelaunch.parallel.stages import assign_stages

GB = 10**9
MB = 10**6
# Hidden-sized buffers alive at once per step token: residual, normed input, attention and MLP outputs,
# q/kv intermediates, and the MoE dispatch/combine send and receive copies; a round, generous figure.
ACTIVATION_BUFFERS = 16
# Latent-wide buffers per step token in a prefill: kv_a_proj's output, the normed and rotated latent, and
# the contiguous c_kv that kv_b_proj expands; per key of a cached segment: the gathered latents and their
# c_kv. Negligible beside the hidden-sized ones for DeepSeek-V3 (576 vs 7168), not for narrow test models.
LATENT_BUFFERS = 3


@dataclass(frozen=True)
class RankPlan:
    rank: int
    node: int
    local_device: int
    pp: int
    dp: int
    tp: int
    ep: int
    layers: tuple[int, ...]
    experts: tuple[int, ...]  # under the global placement
    # Its MoE layers' experts (copies included) where parallel.expert_placement_file places them.
    layer_experts: dict[int, tuple[int, ...]]
    weight_parts: tuple[WeightPart, ...]
    weight_bytes: int
    kv_block_bytes: int  # one KV block over the rank's layers
    kv_blocks: int
    activation_bytes: int

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_blocks * self.kv_block_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes + self.activation_bytes


@dataclass(frozen=True)
class LaunchPlan:
    config: DeployConfig
    args: ModelArgs
    mesh: MeshShape
    dtype: str  # resolved: float32 | bfloat16 | fp8
    device: str  # resolved: cuda | cpu
    block: tuple[int, int]  # fp8 scale block
    max_model_len: int  # resolved: engine.max_model_len or the model's default
    device_bytes: int
    stages: list[list[int]]
    ranks: list[RankPlan]
    quant: IntQuant | None = None  # resolved: projections stored as int8 / int4, or None
    placement: ExpertPlacement | None = None  # the global expert placement (None: no routed experts)
    layer_placements: dict[int, ExpertPlacement] = field(default_factory=dict)  # from the placement file

    def placement_of(self, layer_id: int) -> ExpertPlacement | None:
        return self.layer_placements.get(layer_id, self.placement)

    @property
    def usable_bytes(self) -> int:
        return int(self.device_bytes * self.config.cluster.memory_fraction)

    @property
    def heaviest(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.total_bytes)

    @property
    def fits(self) -> bool:
        return self.heaviest.total_bytes <= self.usable_bytes

    @property
    def kv_blocks(self) -> int:
        """KV blocks the engine allocates on every rank: the fewest any rank affords."""
        return min(r.kv_blocks for r in self.ranks)

    @property
    def full_length_sequences(self) -> float:
        """Sequences of max_model_len tokens the cache holds at once."""
        return self.kv_blocks / blocks_per_sequence(self.max_model_len, self.config.engine.block_size)

    @property
    def engine_kv_budget(self) -> int:
        """The engine's kv_cache_memory (bytes per rank) that gives every rank kv_blocks: the engine
        divides it by its own block size and keeps the fewest blocks any rank gets."""
        return self.kv_blocks * max(r.kv_block_bytes for r in self.ranks)

    @property
    def value_bytes(self) -> int:
        return value_bytes(self.dtype)

    def groups(self) -> dict[str, list[list[int]]]:
        """The process groups the mesh forms (those of ParallelMesh.build)."""
        g = self.mesh.groups()
        return {family: g[family] for family in ("tp", "dp_replica", "ep", "pp")}

    def verdict(self) -> str:
        r = self.heaviest
        c = self.config.cluster
        need = (
            f"rank {r.rank} needs {size_text(r.total_bytes)} (weights {size_text(r.weight_bytes)} + KV cache "
            f"{size_text(r.kv_cache_bytes)} + activations {size_text(r.activation_bytes)})"
        )
        have = (
            f"{size_text(self.usable_bytes)} usable per {self.device} device "
            f"({size_text(self.device_bytes)} x cluster.memory_fraction {c.memory_fraction})"
        )
        if self.fits:
            sequences = f"{self.full_length_sequences:.1f} sequences of {self.max_model_len} tokens"
            return f"fits: {need} of {have}; the KV cache holds {sequences}"
        return (
            f"{self.config.source}: does not fit: {need} but there are {have} (the KV cache counted for one "
            "sequence of max_model_len, the least that runs); lower engine.max_model_len, pick a smaller "
            "dtype or kv_cache_dtype fp8, or spread the model over more devices (dp, pp)"
        )


def value_bytes(dtype: str) -> int:
    """Bytes of one KV-cache value or activation: fp8 models keep both in bf16."""
    return 4 if dtype == "float32" else 2


def blocks_per_sequence(max_model_len: int, block_size: int) -> int:
    return -(-max_model_len // block_size)


def latent_segment(max_model_len: int) -> int:
    """Cached keys a prefill chunk attends to at once (see model/prefill_attention.py)."""
    return min(prefill_attention.KEY_SEGMENT, max_model_len)


def activation_bytes(args: ModelArgs, step_tokens: int, max_model_len: int, value: int) -> int:
    hidden = step_tokens * args.hidden_size * ACTIVATION_BUFFERS
    latent = (LATENT_BUFFERS * step_tokens + 2 * latent_segment(max_model_len)) * (
        args.kv_lora_rank + args.qk_rope_head_dim
    )
    return (hidden + latent) * value


def size_text(n: int) -> str:
    """44.26 GB; below 1 GB (small test models) in MB, so it does not read 0.00."""
    return f"{n / GB:.2f} GB" if n >= GB else f"{n / MB:.2f} MB"


def build_plan(cfg: DeployConfig) -> LaunchPlan:
    """Check the layout against the model and the cluster and place every rank; raises DeployConfigError
    or LayoutError with the fix when it cannot work. A plan that does not fit memory is still returned
    (plan.fits is False) so its tables can show why."""
    if cfg.disaggregation is not None:  # each part is a deployment of its own: plan those
        raise cfg.error(
            "disaggregation",
            "prefill and decode parts",
            "one layout here: `launch plan` and `launch CONFIG` plan each part, while `launch slurm` and "
            "`launch k8s` do not take disaggregated deployments yet (run one on a Ray cluster: "
            "cluster.backend: ray)",
        )
    if not Path(cfg.model).exists():
        raise cfg.error("model", cfg.model, "an existing checkpoint directory or config.json (no such path)")
    try:
        args = load_args(cfg.model)
    except ValueError as e:
        raise cfg.error("model", cfg.model, f"a DeepSeek checkpoint directory or config.json ({e})") from None
    p = cfg.parallel
    mesh = MeshShape(p.tp, p.dp, p.pp)
    _check_devices(cfg, mesh)
    try:
        check_layout(args, mesh)
    except LayoutError as e:
        raise LayoutError(
            f"{cfg.source}: parallel tp={p.tp} dp={p.dp} pp={p.pp} does not split the model: {e}"
        ) from None
    device = _resolve_device(cfg)
    dtype = _resolve_dtype(cfg, args, device)
    quant = _resolve_quantization(cfg, args)
    block = args.fp8_block_size or (128, 128)
    max_model_len = cfg.engine.max_model_len or min(args.max_position_embeddings, 8192)  # the engine's rule
    if max_model_len > args.max_position_embeddings:
        raise cfg.error(
            "engine.max_model_len",
            max_model_len,
            f"<= the model's max_position_embeddings = {args.max_position_embeddings}",
        )
    max_tokens = getattr(cfg.job, "max_tokens", None)
    if "max_tokens" in cfg.job.model_fields_set and max_tokens >= max_model_len:
        # Given, not defaulted: clamped silently, a setting no request could reach would say nothing.
        raise cfg.error(
            "job.max_tokens", max_tokens, f"< engine.max_model_len {max_model_len} (a prompt takes a token)"
        )
    placement = _placement(cfg, args, mesh.ep)
    layer_placements = _layer_placements(cfg, args, mesh.ep)
    if cfg.engine.eplb is not None:  # every layer planned at the expert slots a rebalance gives
        placement, layer_placements = _eplb_placement(cfg, args, mesh), {}
    stages = assign_stages(args, mesh.pp)
    device_bytes = _device_bytes(cfg, device)
    usable = int(device_bytes * cfg.cluster.memory_fraction)
    shards: dict[tuple[int, int], tuple[WeightPart, ...]] = {}
    ranks = [
        _rank_plan(
            cfg,
            args,
            mesh,
            stages,
            (placement, layer_placements),
            shards,
            dtype,
            block,
            max_model_len,
            quant,
            device,
            usable,
            r,
        )
        for r in range(mesh.world)
    ]
    if dtype == "fp8":
        _check_fp8_blocks(cfg, shards.values(), block)
    if quant is not None and quant.method == "int4":
        _check_int4_groups(cfg, shards.values(), quant)
    return LaunchPlan(
        cfg,
        args,
        mesh,
        dtype,
        device,
        block,
        max_model_len,
        device_bytes,
        stages,
        ranks,
        quant,
        placement,
        layer_placements,
    )


def _check_devices(cfg: DeployConfig, mesh: MeshShape) -> None:
    c, p = cfg.cluster, cfg.parallel
    have = c.nodes * c.devices_per_node
    if mesh.world != have:
        if mesh.world % c.devices_per_node == 0:
            fix = f"set cluster.nodes: {mesh.world // c.devices_per_node} or change parallel"
        else:
            fix = "change parallel or cluster.devices_per_node"
        raise LayoutError(
            f"{cfg.source}: the layout needs dp*pp*tp = {p.dp}*{p.pp}*{p.tp} = {mesh.world} devices but the "
            f"cluster has nodes*devices_per_node = {c.nodes}*{c.devices_per_node} = {have}: {fix}"
        )
    if c.devices_per_node % p.tp:
        fits = [t for t in range(1, c.devices_per_node + 1) if c.devices_per_node % t == 0]
        raise LayoutError(
            f"{cfg.source}: parallel.tp={p.tp} does not divide "
            f"cluster.devices_per_node={c.devices_per_node}, so a TP group would straddle nodes (TP "
            f"all-reduces twice per layer and needs one node's links): use tp in {fits}"
        )


def _resolve_device(cfg: DeployConfig) -> str:
    # `auto` is decided where the workers run; the plan can only look at this machine.
    if cfg.cluster.device != "auto":
        return cfg.cluster.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_dtype(cfg: DeployConfig, args: ModelArgs, device: str) -> str:
    """auto: FP8 checkpoints stay fp8 on GPUs, other checkpoints run bf16 there; the CPU path runs fp32."""
    fp8_checkpoint = args.fp8_block_size is not None
    if cfg.dtype == "auto":
        return "float32" if device == "cpu" else ("fp8" if fp8_checkpoint else "bfloat16")
    if cfg.dtype == "fp8" and not fp8_checkpoint:
        raise cfg.error(
            "dtype",
            "fp8",
            "bfloat16 or float32 for this checkpoint, which is not block-FP8 (convert it first with "
            "`launch convert quantize-fp8 SRC DST`)",
        )
    return cfg.dtype


def _resolve_quantization(cfg: DeployConfig, args: ModelArgs) -> IntQuant | None:
    try:
        return resolve_quantization(cfg.quantization, args.quantization, cfg.model)
    except ValueError as e:
        raise cfg.error("quantization", cfg.quantization, f"a method this checkpoint allows ({e})") from None


def _check_int4_groups(cfg: DeployConfig, shards: Iterable[tuple[WeightPart, ...]], quant: IntQuant) -> None:
    try:
        check_int4_slices((t for parts in shards for part in parts for t in part.tensors), quant)
    except ValueError as e:
        raise LayoutError(f"{cfg.source}: parallel.tp={cfg.parallel.tp}: {e}") from None


def _placement(cfg: DeployConfig, args: ModelArgs, ep: int) -> ExpertPlacement | None:
    owners = cfg.parallel.expert_placement
    if not args.n_routed_experts:
        return None
    if owners is None:
        return ExpertPlacement.contiguous(args.n_routed_experts, ep)
    try:
        return ExpertPlacement.from_map(owners, args.n_routed_experts, ep)
    except ValueError as e:
        given = f"{len(owners)} expert owner lists"
        raise cfg.error("parallel.expert_placement", given, f"one owner list per expert ({e})") from None


def _layer_placements(cfg: DeployConfig, args: ModelArgs, ep: int) -> dict[int, ExpertPlacement]:
    path = cfg.parallel.expert_placement_file
    if path is None:
        return {}
    try:
        return read_placement_file(Path(path), args, ep)
    except ValueError as e:
        raise cfg.error(
            "parallel.expert_placement_file", path, f"a placement file for this deployment ({e})"
        ) from None


def _eplb_placement(cfg: DeployConfig, args: ModelArgs, mesh: MeshShape) -> ExpertPlacement:
    """Under engine.eplb every rank comes to hold (experts + redundant) / ep experts per layer: the plan
    budgets for that (a placement from an even load has those slot counts)."""
    eplb = cfg.engine.eplb
    try:
        check_eplb(eplb, args, mesh)
    except ValueError as e:
        raise cfg.error("engine.eplb", eplb.model_dump(), str(e)) from None
    even = torch.zeros(1, args.n_routed_experts)
    (placement,) = balanced_placements(even, mesh.ep, eplb.redundant_experts, 1, 1)
    return placement


def _device_bytes(cfg: DeployConfig, device: str) -> int:
    c = cfg.cluster
    if c.device_memory_gb is not None:
        return int(c.device_memory_gb * GB)
    if device == "cpu":
        # CPU worker slots of a node share its RAM; the plan sees only this machine's.
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // c.devices_per_node
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    raise cfg.error(
        "cluster.device_memory_gb",
        None,
        "the memory of one GPU in GB, required for cuda when no GPU is visible here (H200: 141, H100: 80)",
    )


def _rank_plan(
    cfg: DeployConfig,
    args: ModelArgs,
    mesh: MeshShape,
    stages: list[list[int]],
    placements: tuple[ExpertPlacement | None, dict[int, ExpertPlacement]],
    shards: dict[tuple[int, tuple[int, ...]], tuple[WeightPart, ...]],
    dtype: str,
    block: tuple[int, int],
    max_model_len: int,
    quant: IntQuant | None,
    device: str,
    usable: int,
    rank: int,
) -> RankPlan:
    """`shards` caches weight parts by (stage, experts held per layer): ranks alike in both hold the
    same shapes, so one shard is built on the meta device for all of them."""
    tp, dp, pp = mesh.coords(rank)
    ep = rank % mesh.ep  # position in its stage's EP group (dp-major, tp-minor)
    layers = stages[pp]
    placement, layer_placements = placements
    experts = placement.experts_of(ep) if placement else []
    layer_experts = {i: tuple(p.experts_of(ep)) for i, p in layer_placements.items() if i in layers}
    key = (pp, tuple(len(layer_experts.get(i, experts)) for i in layers if args.is_moe_layer(i)))
    if key not in shards:
        shards[key] = weight_parts(shard_tensors(args, mesh, rank, placement, layer_placements))
    parts = shards[key]
    v, e = value_bytes(dtype), cfg.engine
    weights = sum(part.nbytes(dtype, block, quant) for part in parts)
    activations = activation_bytes(args, e.max_num_batched_tokens, max_model_len, v)
    kv_dtype = torch.float32 if v == 4 else torch.bfloat16
    per_block = PagedLatentCache.bytes_per_block(
        args, len(layers), e.block_size, kv_dtype, e.kv_cache_dtype == "fp8", e.attention.sparse()
    )
    one_sequence = blocks_per_sequence(max_model_len, e.block_size)
    if e.kv_cache_memory is not None and e.kv_cache_memory < one_sequence * per_block:
        raise cfg.error(
            "engine.kv_cache_memory",
            e.kv_cache_memory,
            f">= {one_sequence * per_block:,} B, one sequence of max_model_len {max_model_len} tokens in "
            f"{one_sequence} blocks of {per_block:,} B on rank {rank}'s {len(layers)} layers (or a lower "
            "max_model_len)",
        )
    budget = _kv_budget(cfg, device, usable - weights - activations)
    # At least one sequence: a plan whose memory cannot hold it does not fit, and its total says by how much.
    blocks = min(max(budget // per_block, one_sequence), e.max_num_seqs * one_sequence)
    devices = cfg.cluster.devices_per_node
    return RankPlan(
        rank=rank,
        node=rank // devices,
        local_device=rank % devices,
        pp=pp,
        dp=dp,
        tp=tp,
        ep=ep,
        layers=tuple(layers),
        experts=tuple(experts),
        layer_experts=layer_experts,
        weight_parts=parts,
        weight_bytes=weights,
        kv_block_bytes=per_block,
        kv_blocks=blocks,
        activation_bytes=activations,
    )


def kv_share_of_left(cfg: DeployConfig, device: str) -> float | None:
    """The share of what a rank's weights and activations leave that its KV cache takes; None when
    engine.kv_cache_memory gives the bytes."""
    e = cfg.engine
    if e.kv_cache_memory is not None:
        return None
    if e.kv_cache_fraction is not None:
        return e.kv_cache_fraction
    # On a GPU cluster.memory_fraction already keeps the headroom; a host's RAM is shared (the engine's rule).
    return 1.0 if device == "cuda" else default_kv_cache_fraction(device)


def _kv_budget(cfg: DeployConfig, device: str, left: int) -> int:
    """Bytes for a rank's KV cache, given what its weights and activations leave of the usable memory."""
    share = kv_share_of_left(cfg, device)
    return cfg.engine.kv_cache_memory if share is None else int(left * share)


def _check_fp8_blocks(
    cfg: DeployConfig, shards: Iterable[tuple[WeightPart, ...]], block: tuple[int, int]
) -> None:
    """FP8 scales cover 128x128 blocks; a TP slice must not cut through one (the loader refuses it)."""
    for t in (t for parts in shards for part in parts for t in part.tensors):
        split = t.split_dim
        if is_fp8(t, "fp8") and t.tp > 1 and t.shape[split] % block[split]:
            raise LayoutError(
                f"{cfg.source}: dtype fp8 with parallel.tp={t.tp}: {t.name}'s slice {t.full_shape[split]}/"
                f"{t.tp} = {t.shape[split]} is not a multiple of the {block[split]}-wide FP8 scale block: "
                "choose a tp that keeps slices block-aligned, or dtype bfloat16"
            )
