"""The device mesh: world = dp x pp x tp, with expert parallelism over dp x tp inside each stage.

Rank order puts tp innermost (a TP group is contiguous, so it packs within a node) and pp outermost
(each pipeline stage is a contiguous block of ranks, so stages map to nodes):
    rank = pp_index * (dp * tp) + dp_index * tp + tp_index
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moelaunch.parallel.group import Group, make_group


class LayoutError(ValueError):
    """A parallel layout that does not fit the world or the model; the message says what to change."""


@dataclass(frozen=True)
class MeshShape:
    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)}: every parallel size must be >= 1")

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def ep(self) -> int:
        return self.dp * self.tp

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_index, dp_index, tp_index) of a global rank."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group of each family (named as ParallelMesh's fields), as mesh positions in group order."""
        stages, replicas, slices = range(self.pp), range(self.dp), range(self.tp)
        return {
            "world": [list(range(self.world))],
            "tp": [[self.rank(p, d, t) for t in slices] for p in stages for d in replicas],
            "ep": [[self.rank(p, d, t) for d in replicas for t in slices] for p in stages],
            "pp": [[self.rank(p, d, t) for p in stages] for d in replicas for t in slices],
            "dp_replica": [[self.rank(p, d, t) for p in stages for t in slices] for d in replicas],
        }


@dataclass
class ParallelMesh:
    shape: MeshShape
    rank: int  # position in the mesh (equal to the global rank unless the mesh is a sub-world)
    tp: Group  # same stage and replica: attention heads, dense MLP, vocab
    ep: Group  # same stage: routed experts, token all-to-all
    pp: Group  # same replica and tp index, across stages: hidden states
    dp_replica: Group  # same DP replica: every stage and tp rank (sampled tokens)
    world: Group
    device: torch.device
    global_ranks: list[int]  # job rank of each mesh position

    @property
    def pp_index(self) -> int:
        return self.shape.coords(self.rank)[0]

    @property
    def dp_index(self) -> int:
        return self.shape.coords(self.rank)[1]

    @property
    def tp_index(self) -> int:
        return self.shape.coords(self.rank)[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_index == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_index == self.shape.pp - 1

    def peer_rank(self, stage: int) -> int:
        """The job rank with this rank's replica and tp index in another pipeline stage."""
        return self.global_ranks[self.shape.rank(stage, self.dp_index, self.tp_index)]

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelMesh:
        """The one-process mesh: no process group needed."""
        return cls.planned(MeshShape(), 0, device)

    @classmethod
    def planned(cls, shape: MeshShape, rank: int, device: torch.device | str = "meta") -> ParallelMesh:
        """Mesh position `rank` without process groups: enough to build that rank's shard (its shapes)
        before or without starting a job. Groups of more than one member cannot communicate."""
        mine = {
            name: next(Group(members, members.index(rank), None) for members in family if rank in members)
            for name, family in shape.groups().items()
        }
        return cls(shape, rank, device=torch.device(device), global_ranks=list(range(shape.world)), **mine)

    @classmethod
    def build(
        cls, shape: MeshShape, timeout_s: float = 300.0, ranks: list[int] | None = None
    ) -> ParallelMesh | None:
        """Create every sub-group; every process of the job must call this, in the same order.

        `ranks` (default: the whole job) are the job ranks forming the mesh; other processes get None.
        """
        job_rank = dist.get_rank()
        ranks = list(range(dist.get_world_size())) if ranks is None else ranks
        if len(ranks) != shape.world:
            raise LayoutError(
                f"dp*pp*tp = {shape.dp}*{shape.pp}*{shape.tp} = {shape.world} but {len(ranks)} processes "
                f"were started; start {shape.world} processes or change --dp/--pp/--tp"
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        mine: dict[str, Group] = {}
        for name, groups in shape.groups().items():
            for positions in groups:
                members = [ranks[p] for p in positions]
                # new_group is collective over the job: every process creates every group.
                pg = dist.new_group(members, timeout=timeout) if len(members) > 1 else None
                group = make_group(members, job_rank, pg)
                if group is not None:
                    mine[name] = group
        if job_rank not in ranks:
            return None
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        return cls(shape, ranks.index(job_rank), device=torch.device(device), global_ranks=ranks, **mine)
