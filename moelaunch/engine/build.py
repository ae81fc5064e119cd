"""Everything needed to build the same engine on every rank, as one serializable spec."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import get_args

import torch

from moelaunch import kernels
from moelaunch.cluster.rendezvous import RankEnv, init_distributed
from moelaunch.engine.config import EngineConfig
from moelaunch.engine.engine import LLMEngine
from moelaunch.model.checkpoint import CheckpointReader
from moelaunch.model.config import load_args
from moelaunch.model.loading import Fp8Mode, has_mtp_weights
from moelaunch.model.quantization import check_quantization
from moelaunch.parallel.expert_parallel import ExpertPlacement
from moelaunch.parallel.mesh import MeshShape, ParallelMesh
from moelaunch.parallel.parallelize import check_layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": None}
FP8_MODES = get_args(Fp8Mode)


@dataclass
class EngineSpec:
    """The engine's settings plus where and how its model is placed: what every rank needs to build it."""

    model: str
    tp: int = 1
    dp: int = 1
    pp: int = 1
    dtype: str = "auto"  # auto: bfloat16 on GPUs, float32 on the CPU (bf16 matmuls are slow there)
    fp8: str = "auto"
    engine: EngineConfig = field(default_factory=EngineConfig)
    expert_placement: list[list[int]] | None = None  # expert -> EP ranks holding it (copies allowed)
    timeout_s: float = 300.0  # longest wait on a peer: rendezvous and every collective
    quantization: str = "none"  # none | int8 | w8a8 | int4 (projections quantized at load)

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {', '.join(DTYPES)}")
        if self.fp8 not in FP8_MODES:
            raise ValueError(f"fp8={self.fp8!r} must be one of {', '.join(FP8_MODES)}")
        check_quantization(self.quantization)
        if type(self.timeout_s) not in (int, float) or not 0 < self.timeout_s < math.inf:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be a number of seconds > 0")

    def check_against_model(self) -> None:
        """What can be checked from config.json alone, before any weight loads or worker starts: the
        checkpoint exists, the layout divides the model, max_model_len fits its positions."""
        args = load_args(self.model)
        shape = MeshShape(self.dp, self.pp, self.tp)
        check_layout(args, shape.tp, shape.ep, shape.pp)
        if self.engine.speculative == "mtp" and not has_mtp_weights(args, CheckpointReader(self.model)):
            raise ValueError(
                f"speculative='mtp' but {self.model} has no MTP weights (num_nextn_predict_layers): leave "
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
        return self.tp * self.dp * self.pp

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "engine": self.engine.model_dump()})

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        data = json.loads(text)
        return cls(**{**data, "engine": EngineConfig(**data["engine"])})


def build_engine(spec: EngineSpec, rank_env: RankEnv | None = None) -> LLMEngine:
    """Join the job (if several ranks), build the mesh and this rank's engine."""
    spec.check_against_model()  # a layout that cannot work fails on every rank before any collective
    env = rank_env or RankEnv.from_env()
    if not torch.cuda.is_available():
        kernels.prepare_cpu_kernels()  # before any collective: a first build takes a minute
    backend = init_distributed(env, spec.timeout_s)
    if spec.world > 1:
        mesh = ParallelMesh.build(MeshShape(spec.dp, spec.pp, spec.tp), spec.timeout_s)
    else:
        mesh = ParallelMesh.single("cuda" if backend == "nccl" else "cpu")
    dtype = DTYPES[spec.dtype] or (torch.bfloat16 if mesh.device.type == "cuda" else torch.float32)
    placement = None
    if spec.expert_placement is not None:
        owners = spec.expert_placement
        placement = ExpertPlacement.from_map(owners, len(owners), mesh.shape.ep)
    return LLMEngine(spec.model, mesh, spec.engine, dtype, spec.fp8, placement, spec.quantization)


def build_engine_from_json(spec_json: str) -> LLMEngine:
    """build_engine for a rank that a cluster backend started (the torchrun env contract is set)."""
    return build_engine(EngineSpec.from_json(spec_json))
