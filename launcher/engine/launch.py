"""Everything needed to build the same engine on every rank, as one serializable spec."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import torch

from moelaunch import kernels
from moelaunch.cluster.rendezvous import RankEnv, init_distributed
from moelaunch.launcher.engine.config import EngineConfig
from moelaunch.launcher.engine.engine import LLMEngine
from moelaunch.parallel.expert_parallel import ExpertPlacement
from moelaunch.parallel.mesh import MeshShape, ParallelMesh

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": None}


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

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {', '.join(DTYPES)}")
        MeshShape(self.dp, self.pp, self.tp)  # validates sizes

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
    return LLMEngine(spec.model, mesh, spec.engine, dtype, spec.fp8, placement)


def build_engine_from_json(spec_json: str) -> LLMEngine:
    """build_engine for a rank that a cluster backend started (the torchrun env contract is set)."""
    return build_engine(EngineSpec.from_json(spec_json))
