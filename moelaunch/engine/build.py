"""Everything needed to build the same engine on every rank, as one serializable spec."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from moelaunch import kernels
from moelaunch.cluster.rendezvous import RankEnv, init_distributed
from moelaunch.engine.config import EngineConfig
from moelaunch.engine.engine import LLMEngine
from moelaunch.model.checkpoint import CheckpointReader
from moelaunch.model.config import load_args
from moelaunch.model.loading import has_mtp_weights
from moelaunch.model.quantization import resolve_quantization
from moelaunch.model.weight_spec import WeightSpec
from moelaunch.parallel.mesh import MeshShape, ParallelMesh
from moelaunch.parallel.parallelize import check_layout
from moelaunch.parallel.shard_tensors import check_int4_slices, shard_tensors
from moelaunch.text.tokenizer import Tokenizer


@dataclass
class EngineSpec:
    """The weights, the parallel layout and the engine's settings: what every rank needs to build it."""

    weights: WeightSpec
    parallel: MeshShape = field(default_factory=MeshShape)
    engine: EngineConfig = field(default_factory=EngineConfig)
    timeout_s: float = 300.0  # longest wait on a peer: rendezvous and every collective
    kv_role: Literal["prefill", "decode"] | None = None  # a part of a disaggregated deployment

    def __post_init__(self) -> None:
        if type(self.timeout_s) not in (int, float) or not 0 < self.timeout_s < math.inf:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be a number of seconds > 0")

    def check_against_model(self) -> None:
        """What can be checked before any weight loads or worker starts: the checkpoint exists and its
        files are readable, the layout divides the model (int4 slices included), max_model_len fits its
        positions."""
        model = self.weights.model
        args = load_args(model)
        check_layout(args, self.parallel)
        quant = resolve_quantization(self.weights.quantization, args.quantization, model)
        if quant is not None and quant.method == "int4" and self.parallel.tp > 1:
            check_int4_slices(shard_tensors(args, self.parallel, 0, None), quant)
        if not self.engine.skip_tokenizer_init:
            Tokenizer.check_files(model)
        reader = CheckpointReader(model)  # every weights file there and readable
        if self.engine.speculative == "mtp" and not has_mtp_weights(args, reader):
            raise ValueError(
                f"speculative='mtp' but {model} has no MTP weights (num_nextn_predict_layers): leave "
                "speculative unset for this checkpoint"
            )
        asked = self.engine.max_model_len
        if asked is not None and asked > args.max_position_embeddings:
            raise ValueError(
                f"max_model_len={asked} exceeds the model's max_position_embeddings="
                f"{args.max_position_embeddings}: give at most that"
            )

    @property
    def world(self) -> int:
        return self.parallel.world

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "engine": self.engine.model_dump()})

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        data = json.loads(text)
        parts = {"weights": WeightSpec(**data["weights"]), "parallel": MeshShape(**data["parallel"])}
        return cls(**{**data, **parts, "engine": EngineConfig(**data["engine"])})


def build_engine(spec: EngineSpec, rank_env: RankEnv | None = None) -> LLMEngine:
    """Join the job (if several ranks), build the mesh and this rank's engine."""
    spec.check_against_model()  # a layout that cannot work fails on every rank before any collective
    env = rank_env or RankEnv.from_env()
    if not torch.cuda.is_available():
        kernels.prepare_cpu_kernels()  # before any collective: a first build takes a minute
    backend = init_distributed(env, spec.timeout_s)
    if spec.world > 1:
        mesh = ParallelMesh.build(spec.parallel, spec.timeout_s)
    else:
        mesh = ParallelMesh.single("cuda" if backend == "nccl" else "cpu")
    return LLMEngine(spec.weights, mesh, spec.engine, spec.kv_role, spec.timeout_s)


def build_engine_from_json(spec_json: str) -> LLMEngine:
    """build_engine for a rank that a cluster backend started (the torchrun env contract is set)."""
    return build_engine(EngineSpec.from_json(spec_json))
