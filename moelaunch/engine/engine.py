"""The engine: every rank runs it; rank 0 also faces the user.

Each step rank 0 broadcasts a command (new sequences with the DP replica each goes to, aborts, or
stop); every rank then schedules its replica's sequences with the same deterministic scheduler, runs
the step, and applies the same sampled tokens, so the replicas' ranks never disagree. The replica
reporters (last stage, tp index 0) send their tokens and log-probabilities to rank 0.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from moelaunch.engine.block_manager import BlockManager
from moelaunch.engine.config import EngineConfig, default_kv_cache_fraction
from moelaunch.engine.draft_policy import DraftPolicy
from moelaunch.engine.eplb import apply_placements, check_eplb, rebalanced, redundant_expert_bytes
from moelaunch.engine.host_heap import HostHeap, long_prompt
from moelaunch.engine.kv_handoff import CacheEndpoint, KVHandoff
from moelaunch.engine.kv_peer import KVPeer
from moelaunch.engine.kv_transport import KVTransferError
from moelaunch.engine.memory import available_bytes, num_blocks_for
from moelaunch.engine.model_runner import ModelRunner, StepResult
from moelaunch.engine.outputs import (
    ABORT,
    ERROR,
    NON_FINITE_TOKEN,
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    non_finite_logits_error,
)
from moelaunch.engine.routed_load import LoadRecorder, LoadReport, moe_layer_ids, moe_layers
from moelaunch.engine.sampling_params import MAX_SEED, SamplingParams
from moelaunch.engine.scheduler import ScheduledChunk, Scheduler
from moelaunch.engine.sequence import Sequence
from moelaunch.engine.static_decode import build_static_decode
from moelaunch.engine.stats import EngineStats
from moelaunch.engine.step_protocol import broadcast_json, gather_json
from moelaunch.model.config import load_args
from moelaunch.model.kv_cache import PagedLatentCache
from moelaunch.model.weight_spec import WeightSpec
from moelaunch.parallel.expert_parallel import AllToAllDispatch, ExpertPlacement
from moelaunch.parallel.mesh import ParallelMesh
from moelaunch.parallel.parallelize import load_shard, weight_placements
from moelaunch.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class NewSequence:
    seq_id: int
    request_id: str
    index: int
    prompt: list[int]
    params: SamplingParams
    replica: int
    handoff: dict | None = None  # KVHandoff: a prompt the prefill engine computed (decode role)


@dataclass
class StepCommand:
    new: list[NewSequence] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    kv_releases: list[str] = field(default_factory=list)  # handed-off prompts the decode side has read
    kv_connect: list[dict] = field(default_factory=list)  # CacheEndpoints of prefill ranks to connect to
    stop: bool = False
    keepalive: bool = False  # no step: only resets the peers' collective timeout (and reads the load)
    read_load: bool = False  # after the step (or instead, with keepalive), sum the routed load for rank 0
    # Before the step, move these MoE layers' experts: {layer id: owner ranks per expert}.
    placements: dict[str, list[list[int]]] | None = None
    # Rank 0's draft policy (speculative_policy auto): False stops every sequence's drafts, sequences
    # not started yet draft or not as it says (_set_drafts); None: no policy (every MTP sequence drafts).
    drafts: bool | None = None

    @classmethod
    def from_dict(cls, d: dict) -> StepCommand:
        new = [NewSequence(**{**n, "params": SamplingParams(**n["params"])}) for n in d["new"]]
        return cls(
            new,
            d["aborts"],
            d["kv_releases"],
            d["kv_connect"],
            d["stop"],
            d["keepalive"],
            d["read_load"],
            d["placements"],
            d["drafts"],
        )

    def to_dict(self) -> dict:
        return {**vars(self), "new": [{**vars(n), "params": n.params.model_dump()} for n in self.new]}


@dataclass
class SeqUpdate:
    seq_id: int
    token: int | None  # None: nothing sampled this step (aborted)
    logprob: float | None
    top_logprobs: dict[int, float] | None
    finish_reason: str | None
    error: str | None = None  # finish_reason "error": why, when not the sampler's non-finite logits
    kv_blocks: list[int] | None = None  # prefill role: the finished prompt's blocks, held for the decode side

    @classmethod
    def from_dict(cls, d: dict) -> SeqUpdate:
        top = d["top_logprobs"]  # JSON keys are strings
        return cls(**{**d, "top_logprobs": {int(k): v for k, v in top.items()} if top is not None else None})


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    replica: int
    unfinished: int
    kv_blocks: list[int] | None = None


class LLMEngine:
    def __init__(
        self,
        weights: WeightSpec,
        mesh: ParallelMesh,
        config: EngineConfig | None = None,
        kv_role: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        """kv_role: "prefill" (finished prompts keep their cache blocks for a decode engine to read) or
        "decode" (takes prompts with their KV from a prefill engine), for disaggregated serving."""
        self.config = config or EngineConfig()
        self.mesh = mesh
        self.tokenizer = None if self.config.skip_tokenizer_init else Tokenizer.from_dir(weights.model)
        use_mtp = self.config.speculative == "mtp"
        if use_mtp and mesh.shape.pp > 1:
            raise ValueError("speculative='mtp' needs pp=1 (the MTP layer reads the first stage's embedding)")
        if self.config.eplb is not None:
            check_eplb(self.config.eplb, load_args(weights.model), mesh.shape)
        self.model = load_shard(weights, mesh, with_mtp=use_mtp)
        # The placements loaded: what a layer on another stage keeps (placements() reports them).
        default, self._loaded_placements = weight_placements(weights, self.model.args, mesh.shape.ep)
        self._loaded_placement = default or ExpertPlacement.contiguous(
            self.model.args.n_routed_experts, mesh.shape.ep
        )
        self.model.stack_experts()
        if use_mtp and not len(self.model.mtp):
            raise ValueError(
                f"speculative='mtp' but {weights.model} has no MTP weights (num_nextn_predict_layers)"
            )
        args = self.model.args
        self.max_model_len = self.config.max_model_len or min(args.max_position_embeddings, 8192)
        self.cache = self._allocate_cache()
        self.blocks = BlockManager(self.cache.num_blocks, self.config.block_size)
        self.kv_role = kv_role
        self.kv = KVPeer(self.cache, mesh, timeout_s) if kv_role else None
        self.kv_hold_s = timeout_s  # a handoff nobody read by then is released (its decode side died)
        self.held: dict[str, list[int]] = {}  # prefill role: blocks of handed-off prompts, by request
        self.kv_bytes_received = 0
        self.scheduler = Scheduler(self.config, self.blocks)
        # Without a tokenizer, the end of a sequence is config.json's eos_token_id.
        self.eos_id = self.tokenizer.eos_id if self.tokenizer else self.model.args.eos_token_id
        window = self.config.load_window  # recording first: the static step is built for it
        self.load = LoadRecorder(self.model, use_mtp, window, mesh.device) if window else None
        micro = self.config.micro_batches or mesh.shape.pp
        self.runner = ModelRunner(
            self.model, mesh, self.cache, micro, self.eos_id, use_mtp, self.tokenizer, self._static_decode()
        )
        self.expert_load: LoadReport | None = None  # rank 0: the last routed load read (every window steps)
        self.rebalances = 0  # expert placements applied since the start (eplb or set_expert_placement)
        # This replica's draft tokens so far, and how many were kept: EngineStats.spec_* sums them.
        self.drafted = self.accepted = 0
        auto = use_mtp and self.config.speculative_policy == "auto"
        self.draft_policy = DraftPolicy() if auto and mesh.rank == 0 else None
        self._last_step: tuple[int, bool, int, int] | None = None  # rank 0: (batch, drafting, drafted, kept)
        self.stats = EngineStats()  # after each step, on rank 0: every replica's, summed
        self.seqs: dict[int, Sequence] = {}
        self._host_heap = HostHeap()
        # Front-end state, meaningful on rank 0 only.
        self.requests: dict[str, _RequestState] = {}
        self._seq_owner: dict[int, tuple[str, int]] = {}
        self._next_seq_id = 0
        self._pending = StepCommand()
        self._replica_load = [0] * mesh.shape.dp
        self._handed_off: dict[str, float] = {}  # rank 0, prefill role: request -> when handed off

    def _static_decode(self):
        return build_static_decode(
            self.config,
            self.model,
            self.cache,
            self.mesh.device,
            self.mesh.shape.pp == 1,
            self.max_model_len,
            self.config.speculative == "mtp",
        )

    # ---- cache sizing: every rank must end up with the same number of blocks ----
    def _allocate_cache(self) -> PagedLatentCache:
        cfg, model = self.config, self.model
        fp8 = cfg.kv_cache_dtype == "fp8"
        sparse = cfg.attention.sparse()
        per_block = PagedLatentCache.bytes_per_block(
            model.args, len(model.layer_ids()), cfg.block_size, model.weight_dtype(), fp8, sparse
        )
        fraction = cfg.kv_cache_fraction or default_kv_cache_fraction(self.mesh.device.type)
        # Room kept for the expert copies a rebalance will bring (engine.eplb's redundant experts).
        later = redundant_expert_bytes(model, cfg.eplb, self.mesh.shape.ep) if cfg.eplb else 0
        budget = cfg.kv_cache_memory or int((available_bytes(self.mesh.device) - later) * fraction)
        # More blocks than every sequence at full length could use are never touched.
        per_seq = -(-self.max_model_len // cfg.block_size)
        n = torch.tensor([min(num_blocks_for(budget, per_block), cfg.max_num_seqs * per_seq)])
        n = int(self.mesh.world.all_reduce_min(n).item())
        if cfg.max_model_len is not None and n < per_seq:
            # Asked for explicitly, the length must fit at least once; otherwise every prompt past the
            # cache would be refused only when it arrives.
            raise ValueError(
                f"max_model_len={self.max_model_len} needs {per_seq} KV blocks of {cfg.block_size} tokens "
                f"({per_seq * per_block:,} bytes per rank) for one sequence, but the KV cache holds {n} "
                f"blocks ({n * cfg.block_size} tokens; this rank's budget: {budget:,} bytes, {per_block:,} "
                "per block): "
                "raise kv_cache_memory or kv_cache_fraction, set kv_cache_dtype='fp8', or lower max_model_len"
            )
        return model.new_paged_cache(n, cfg.block_size, fp8=fp8, sparse=sparse)

    # ---- front end (rank 0) ----
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        handoff: KVHandoff | None = None,
    ) -> None:
        """Queue a request for the next step; one that cannot run raises ValueError, leaving nothing.
        handoff (decode role): the prompt was computed by a prefill engine; its first token is the
        output's first, and its latents are read from there when the request is admitted."""
        self.check_request(request_id, prompt_ids, params, handoff)
        replica = min(range(len(self._replica_load)), key=self._replica_load.__getitem__)
        first = [handoff.first_token] if handoff else []
        outputs = [CompletionOutput(i, "", list(first)) for i in range(params.n)]
        self.requests[request_id] = _RequestState(
            request_id,
            prompt,
            list(prompt_ids),
            params,
            outputs,
            RequestMetrics(time.perf_counter()),
            replica,
            params.n,
        )
        for i in range(params.n):
            seq_id = self._next_seq_id
            self._next_seq_id += 1
            self._seq_owner[seq_id] = (request_id, i)
            sent = handoff.to_dict() if handoff else None
            self._pending.new.append(
                NewSequence(seq_id, request_id, i, list(prompt_ids), params, replica, sent)
            )
        self._replica_load[replica] += params.n

    def check_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        handoff: KVHandoff | None = None,
    ) -> None:
        """add_request's checks alone: a caller queuing several requests checks them all first."""
        misplaced = self.kv_role != "decode" or handoff is not None and handoff.prompt != prompt_ids
        if handoff is not None and (misplaced or params.n != 1):
            raise ValueError(
                f"request {request_id!r}: a prefilled prompt goes to a decode-role engine, with its own "
                "prompt and n=1"
            )
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: sampling params must be SamplingParams: {params!r}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(prompt_ids, list) or not prompt_ids:
            raise ValueError(f"request {request_id!r}: the prompt must be a non-empty list of token ids")
        vocab = self.model.args.vocab_size
        outside = [t for t in prompt_ids if type(t) is not int or not 0 <= t < vocab]
        if outside:
            raise ValueError(
                f"request {request_id!r}: token id {outside[0]!r} is not in the vocabulary "
                f"(ids 0..{vocab - 1})"
            )
        self.runner.sampler.constraints.check(params)
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"request {request_id!r}: stop strings need the tokenizer, which skip_tokenizer_init=True "
                "left out; use stop_token_ids"
            )
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(prompt_ids)} tokens does not fit max_model_len="
                f"{self.max_model_len}; shorten it or raise max_model_len"
            )
        if self.blocks.blocks_needed(len(prompt_ids) + 1) > self.blocks.num_blocks:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(prompt_ids)} tokens needs more KV blocks than the "
                f"cache has ({self.blocks.num_blocks} of {self.blocks.block_size}); raise kv_cache_memory"
            )

    def abort(self, request_id: str) -> None:
        if request_id in self.requests:
            self._pending.aborts.append(request_id)

    @property
    def kv_endpoints(self) -> list[CacheEndpoint] | None:
        """Rank 0 of a disaggregated deployment's engine: every rank's cache, as peers read it."""
        return self.kv.endpoints if self.kv else None

    def connect_kv(self, endpoints: list[CacheEndpoint]) -> None:
        """Decode role: every rank connects to these prefill ranks in the next step, while they are known
        to be alive (a first contact with a peer that hangs waits out a fixed 60 s handshake)."""
        self._pending.kv_connect += [e.to_dict() for e in endpoints]

    def release_kv(self, request_id: str) -> None:
        """Prefill role: the decode side has read (or given up on) this request's blocks."""
        if self._handed_off.pop(request_id, None) is not None:
            self._pending.kv_releases.append(request_id)

    def has_unfinished(self) -> bool:
        """Whether a step has work: unfinished requests, or handed-off blocks to release."""
        self._expire_handoffs()
        return bool(self._pending.kv_releases) or any(r.unfinished for r in self.requests.values())

    def _expire_handoffs(self) -> None:
        """Prefill role: blocks no decode side read within kv_hold_s (it died, or gave up) are freed."""
        now = time.perf_counter()
        for request_id in [r for r, t in self._handed_off.items() if now - t > self.kv_hold_s]:
            self.release_kv(request_id)

    def step(self) -> list[RequestOutput]:
        """One engine step on every rank; returns the requests that progressed (rank 0)."""
        self._expire_handoffs()
        command, self._pending = self._pending, StepCommand()
        policy = self.draft_policy
        if policy is not None:
            # The batch this step will run: rank 0's replica stands for all (they see alike loads).
            batch = min(len(self.seqs) + len(command.new), self.config.max_num_seqs)
            command.drafts = policy.drafts(max(batch, 1))
        # Rank 0 reads the routed load every window steps, so /metrics is at most a window old.
        load = self.load
        command.read_load |= load is not None and (load.counts.steps + 1) % load.counts.window == 0
        self._broadcast(command)
        start = time.perf_counter()
        updates = self._execute(command)
        if policy is not None and self._last_step is not None:
            policy.record(*self._last_step[:2], time.perf_counter() - start, *self._last_step[2:])
        return self._apply(updates)

    def shutdown(self) -> None:
        """Release the worker ranks from their loop (rank 0)."""
        if self.mesh.world.size > 1:
            self._broadcast(StepCommand(stop=True))

    def keepalive(self) -> None:
        """While rank 0 waits on a person (a chat prompt), tell the peers it is alive: their wait for
        the next command is a collective with a timeout."""
        if self.mesh.world.size > 1:
            self._broadcast(StepCommand(keepalive=True))

    def worker_loop(self) -> None:
        """Ranks other than 0: follow rank 0's commands until it stops."""
        while True:
            command = self._broadcast(None)
            if command.stop:
                return
            if not command.keepalive:
                self._execute(command)
            elif command.read_load:
                self._read_load()

    def _broadcast(self, command: StepCommand | None) -> StepCommand:
        mesh = self.mesh
        if mesh.world.size == 1:
            return command
        sent = command.to_dict() if command is not None else None
        received = broadcast_json(sent, mesh.global_ranks[0], mesh.world.pg, mesh.device)
        return command if command is not None else StepCommand.from_dict(received)

    # ---- every rank ----
    def _execute(self, command: StepCommand) -> list[SeqUpdate]:
        updates: list[SeqUpdate] = []
        if command.placements is not None:
            ep, n = self.mesh.shape.ep, self.model.args.n_routed_experts
            self._place_experts(
                {int(k): ExpertPlacement.from_map(v, n, ep) for k, v in command.placements.items()}
            )
        for new in command.new:
            if new.replica == self.mesh.dp_index:
                seed = (
                    new.params.seed + new.index
                    if new.params.seed is not None
                    else self.config.seed + new.seq_id
                ) % (MAX_SEED + 1)
                handoff = KVHandoff.from_dict(new.handoff) if new.handoff else None
                seq = Sequence(
                    new.seq_id,
                    new.request_id,
                    new.index,
                    new.prompt,
                    new.params,
                    seed,
                    output=[handoff.first_token] if handoff else [],
                    handoff=handoff,
                )
                self.seqs[new.seq_id] = seq
                self.scheduler.add(seq)
        for request_id in command.aborts:
            for seq in [s for s in self.seqs.values() if s.request_id == request_id]:
                self._finish(seq, ABORT)
                updates.append(SeqUpdate(seq.seq_id, None, None, None, ABORT))
        for request_id in command.kv_releases:
            self.blocks.release(self.held.pop(request_id, []))
        for endpoint in command.kv_connect:
            self.kv.connect(CacheEndpoint.from_dict(endpoint))
        if command.drafts is not None:
            self._set_drafts(command.drafts)
        plan = self.scheduler.schedule()
        failed = self._read_prefilled()
        for chunk in [c for c in plan if c.seq.seq_id in failed]:
            plan.remove(chunk)
            self._finish(chunk.seq, ERROR)
            updates.append(SeqUpdate(chunk.seq.seq_id, None, None, None, ERROR, failed[chunk.seq.seq_id]))
        drafted, accepted, kind = self.drafted, self.accepted, self._timed_kind(plan)
        if self.mesh.device.type == "cpu":  # host RSS follows the plan, with few fresh pages
            self._host_heap.before_step(any(long_prompt(c) for c in plan))
        results = self.runner.step(plan)
        for chunk in plan:
            if not chunk.samples:
                self.scheduler.computed(chunk)
                continue
            seq_updates = self._accept(chunk, results[chunk.seq.seq_id])
            updates.extend(seq_updates)
            if seq_updates[-1].finish_reason:
                seq_updates[-1].kv_blocks = self._finish(chunk.seq, seq_updates[-1].finish_reason)
        if self.load is not None:
            self._after_step(command.read_load)
        self._last_step = kind and (*kind, self.drafted - drafted, self.accepted - accepted)
        return self._gather(updates)

    def _set_drafts(self, drafts: bool) -> None:
        """The draft policy's decision: sequences with nothing cached yet (new or preempted) take it;
        running ones can only stop drafting (the MTP layer's cache of a sequence that skipped it has
        holes, engine/draft_policy.py)."""
        for seq in self.seqs.values():
            if seq.num_computed == 0 or not drafts:
                seq.drafts = drafts
            if not seq.drafts:
                seq.draft = []

    @staticmethod
    def _timed_kind(plan: list[ScheduledChunk]) -> tuple[int, bool] | None:
        """Before the step: (batch, drafting) of a decode-only plan in which every sequence drafts or
        none does, the steps the draft policy compares; None for the others."""
        decode = plan and all(c.samples and c.length == 1 + len(c.draft) for c in plan)
        kinds = {c.seq.drafts for c in plan}
        if not decode or len(kinds) != 1:
            return None
        return len(plan), kinds.pop()

    # ---- routed load and expert placement (every rank, at the same step) ----
    def _after_step(self, read: bool) -> None:
        counts = self.load.counts
        counts.end_step()
        eplb = self.config.eplb
        rebalance = eplb is not None and counts.steps % eplb.interval == 0
        if not (read or rebalance):
            return
        window = self._read_load()
        if rebalance and window.sum() > 0:  # nothing routed in the window: keep the map
            self._place_experts(
                rebalanced(eplb, self.model.args, self.mesh.shape.ep, counts.layer_ids, window)
            )

    def _read_load(self) -> torch.Tensor:
        """Every rank: the routed load summed over the ranks (rank 0 keeps it as expert_load); returns
        the window's counts."""
        counts = self.load.counts
        window, total = self.load.summed(self.mesh.world)
        if self.mesh.rank == 0:
            self.expert_load = LoadReport(
                counts.layer_ids,
                window,
                total,
                counts.steps,
                min(counts.steps, counts.window),
                self.model.args.num_experts_per_tok,
                self.placements(),
                self.rebalances,
            )
        return window

    def _place_experts(self, placements: dict[int, ExpertPlacement]) -> None:
        received = apply_placements(self.model, self.mesh, placements)
        self.rebalances += 1
        if self.mesh.rank == 0:
            print(
                f"moelaunch: expert placement {self.rebalances} applied to {len(placements)} MoE layers "
                f"(rank 0 received {received / 2**20:.1f} MiB of expert weights)",
                file=sys.stderr,
            )
        # The static step's graphs hold the old stacks' shapes and the dispatcher's tables.
        self.rebuild_static_decode()

    def rebuild_static_decode(self) -> None:
        """After the model's modules changed: compiled steps do not check them (static_decode.py), so
        compilation is reset and the static step built again."""
        if self.runner.static is not None:
            torch.compiler.reset()
            self.runner.static = self._static_decode()

    def placements(self) -> dict[int, ExpertPlacement]:
        """Each MoE layer's expert placement (a layer on another stage: the placement it loaded with)."""
        layers = moe_layers(self.model)
        return {
            i: layers[i].dispatch.placement
            if i in layers and isinstance(layers[i].dispatch, AllToAllDispatch)
            else self._loaded_placements.get(i, self._loaded_placement)
            for i in moe_layer_ids(self.model, self.config.speculative == "mtp")
        }

    def set_expert_placement(self, owners: dict[int, list[list[int]]]) -> None:
        """Rank 0: before the next step, move these MoE layers' experts to the EP ranks listed per expert
        ({layer id: [[ranks of expert 0], ...]}, copies allowed); a map that cannot apply raises here."""
        shape, n = self.mesh.shape, self.model.args.n_routed_experts
        if shape.ep == 1 or shape.pp > 1:
            raise ValueError(
                f"expert placements change on layouts with tp*dp > 1 and pp = 1, not tp={shape.tp} "
                f"dp={shape.dp} pp={shape.pp}"
            )
        layers = set(self.placements())
        for layer, o in owners.items():
            if layer not in layers:
                raise ValueError(f"layer {layer} is not an MoE layer of this model (those: {sorted(layers)})")
            ExpertPlacement.from_map(o, n, shape.ep)
        self._pending.placements = {str(k): [list(r) for r in v] for k, v in owners.items()}

    def read_expert_load(self) -> LoadReport:
        """Rank 0: the routed load now, summed over the ranks (between steps: no step runs)."""
        if self.load is None:
            raise ValueError("the engine records no routed load: set expert_load_window (or eplb)")
        if self.mesh.world.size > 1:
            self._broadcast(StepCommand(keepalive=True, read_load=True))
        self._read_load()
        return self.expert_load

    def _read_prefilled(self) -> dict[int, str]:
        """Decode role: read the latents of the prefilled prompts just admitted. The ranks of a replica
        agree on the outcome (a read may fail on one rank only); returns the failed sequences' errors."""
        if self.kv_role != "decode":
            return {}
        errors: dict[int, str] = {}
        for seq, have_blocks in self.scheduler.imports:
            try:
                self.kv_bytes_received += self.kv.pull(seq.handoff, seq.block_ids, have_blocks)
            except KVTransferError as e:
                errors[seq.seq_id] = str(e)
        mesh = self.mesh
        if mesh.world.size > 1:  # every rank joins, whether or not its replica admitted a prefilled prompt
            ok = torch.ones(mesh.shape.dp, dtype=torch.long)
            ok[mesh.dp_index] = int(not errors)
            if not mesh.world.all_reduce_min(ok)[mesh.dp_index]:
                reason = next(iter(errors.values()), "another rank of this replica could not read its part")
                errors = {seq.seq_id: errors.get(seq.seq_id, reason) for seq, _ in self.scheduler.imports}
        for seq, _ in self.scheduler.imports:
            seq.handoff = None  # read, or failing: a preempted sequence is recomputed from its tokens
        return errors

    def _accept(self, chunk: ScheduledChunk, result: StepResult) -> list[SeqUpdate]:
        """Append the step's tokens (kept draft tokens, then the sampled one) up to any finish."""
        seq, updates, reason = chunk.seq, [], None
        for sampled in result.tokens:
            if sampled.token == NON_FINITE_TOKEN:  # broken weights: this sequence ends, the rest go on
                updates.append(SeqUpdate(seq.seq_id, None, None, None, ERROR))
                break
            seq.output.append(sampled.token)
            reason = self._finish_reason(seq, sampled.token)
            updates.append(
                SeqUpdate(seq.seq_id, sampled.token, sampled.logprob, sampled.top_logprobs, reason)
            )
            if reason:
                break
        kept = len(result.tokens) - 1
        self.drafted += len(chunk.draft)
        self.accepted += kept
        self.scheduler.computed(chunk, accepted_drafts=min(kept, len(updates) - 1))
        seq.draft = result.draft
        return updates

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (token == self.eos_id and not p.ignore_eos):
            return "stop"
        if p.stop:
            text = self.tokenizer.decode(seq.output)
            if any(s in text for s in p.stop):
                return "stop"
        if len(seq.output) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> list[int] | None:
        """End a sequence; in the prefill role a completed prompt's blocks stay held for the decode
        side (returned) until release_kv."""
        seq.finish_reason = reason
        held = None
        if self.kv_role == "prefill" and reason not in (ABORT, ERROR):
            held = self.held[seq.request_id] = seq.block_ids
            seq.block_ids = []
        self.scheduler.finish(seq)
        del self.seqs[seq.seq_id]
        return held

    def _gather(self, updates: list[SeqUpdate]) -> list[SeqUpdate]:
        """Rank 0 collects every replica's updates and stats, as its reporter rank saw them."""
        mesh = self.mesh
        if mesh.world.size == 1:
            self.stats = self._replica_stats()
            return updates
        reporter = mesh.is_last_stage and mesh.tp_index == 0
        mine = [[asdict(u) for u in updates], asdict(self._replica_stats())]
        parts = gather_json(mine if reporter else None, mesh.global_ranks[0], mesh.world.pg, mesh.device)
        if mesh.rank != 0:
            return []
        reports = [part for part in parts if part is not None]
        self.stats = sum((EngineStats(**stats) for _, stats in reports), EngineStats())
        return [SeqUpdate.from_dict(u) for part_updates, _ in reports for u in part_updates]

    def _replica_stats(self) -> EngineStats:
        s, blocks = self.scheduler, self.blocks
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_blocks_used=blocks.num_blocks - blocks.num_free,
            kv_blocks_total=blocks.num_blocks,
            prompt_tokens_admitted=s.admitted_tokens,
            prefix_hit_tokens=blocks.stats.prefix_hit_tokens,
            preemptions=s.preemptions,
            spec_drafted=self.drafted,
            spec_accepted=self.accepted,
            kv_bytes_received=self.kv_bytes_received,
        )

    # ---- rank 0: turn updates into outputs ----
    def _apply(self, updates: list[SeqUpdate]) -> list[RequestOutput]:
        now = time.perf_counter()
        touched: dict[str, _RequestState] = {}
        for u in updates:
            request_id, index = self._seq_owner[u.seq_id]
            state = self.requests[request_id]
            out = state.outputs[index]
            if u.token is not None:
                out.token_ids.append(u.token)
                state.metrics.first_token = state.metrics.first_token or now
                if state.params.logprobs is not None:
                    out.logprobs = (out.logprobs or []) + [u.top_logprobs or {}]
                    out.token_logprobs = (out.token_logprobs or []) + [u.logprob]
            if u.finish_reason:
                out.finish_reason = u.finish_reason
                if u.finish_reason == ERROR:
                    out.error = u.error or non_finite_logits_error(self.model.nonfinite_tensors)
                state.kv_blocks = u.kv_blocks
                state.unfinished -= 1
                self._replica_load[state.replica] -= 1
                if state.unfinished == 0:
                    state.metrics.finished = now
            touched[request_id] = state
        return [self._output(state) for state in touched.values()]

    def _output(self, state: _RequestState) -> RequestOutput:
        if state.unfinished == 0:  # text once, at the end; streaming callers decode token_ids themselves
            for out in state.outputs:
                out.text = self._text(out, state.params)
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_ids,
            state.outputs,
            finished=state.unfinished == 0,
            metrics=state.metrics,
            kv_handoff=self._handoff(state),
        )

    def _handoff(self, state: _RequestState) -> KVHandoff | None:
        """Prefill role: a finished prompt's blocks, for the decode side to read."""
        if state.kv_blocks is None or state.unfinished:
            return None
        self._handed_off[state.request_id] = time.perf_counter()
        endpoints = self.kv.replica_endpoints(state.replica)
        first = state.outputs[0].token_ids[0]
        return KVHandoff(state.request_id, state.prompt_ids, first, state.replica, state.kv_blocks, endpoints)

    def _text(self, out: CompletionOutput, params: SamplingParams) -> str:
        if self.tokenizer is None:  # skip_tokenizer_init: token ids only
            return ""
        text = self.tokenizer.decode(out.token_ids)
        for s in params.stop:  # the output ends before the first stop string
            at = text.find(s)
            if at >= 0:
                text = text[:at]
        return text

    def release(self, request_id: str) -> None:
        """Forget a finished request's front-end state."""
        state = self.requests.pop(request_id)
        for seq_id in [s for s, (r, _) in self._seq_owner.items() if r == state.request_id]:
            del self._seq_owner[seq_id]
