"""The device mesh: world = tp x dp x pp, with expert parallelism over dp x tp inside each stage.

Sizes and coordinates are always given in the order tp, dp, pp. Rank order puts tp innermost (a TP
group is contiguous, so it packs within a node) and pp outermost (each pipeline stage is a contiguous
block of ranks, so stages map to nodes):
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
    tp: int = 1
    dp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise LayoutError(f"{name}={value!r} must be an integer >= 1")

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def ep(self) -> int:
        return self.dp * self.tp

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_index, dp_index, pp_index) of a global rank."""
        return rank % self.tp, rank // self.tp % self.dp, rank // (self.dp * self.tp)

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group of each family (named as ParallelMesh's fields), as mesh positions in group order."""
        stages, replicas, slices = range(self.pp), range(self.dp), range(self.tp)
        return {
            "world": [list(range(self.world))],
            "tp": [[self.rank(t, d, p) for t in slices] for p in stages for d in replicas],
            "ep": [[self.rank(t, d, p) for d in replicas for t in slices] for p in stages],
            "pp": [[self.rank(t, d, p) for p in stages] for d in replicas for t in slices],
            "dp_replica": [[self.rank(t, d, p) for p in stages for t in slices] for d in replicas],
        }


@dataclass
class ParallelMesh:
    shape: MeshShape
    rank: int  # position in the mesh (equal to the global rank unless the mesh is a sub-world)
    tp: Group  # same stage and replica: attention heads, dense MLP, vocab
    ep: Group  # same stage: routed experts, token all-to-all
    pp: Group  # same replica and tp index, across stages in stage order: hidden states
    dp_replica: Group  # same DP replica: every stage and tp rank (sampled tokens)
    world: Group
    device: torch.device
    global_ranks: list[int]  # job rank of each mesh position

    @property
    def tp_index(self) -> int:
        return self.shape.coords(self.rank)[0]

    @property
    def dp_index(self) -> int:
        return self.shape.coords(self.rank)[1]

    @property
    def pp_index(self) -> int:
        return self.shape.coords(self.rank)[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_index == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_index == self.shape.pp - 1

    def recv_from_previous_stage(self, x: torch.Tensor) -> torch.Tensor:
        """Fill `x` with the hidden states the previous pipeline stage sent (same replica and tp index)."""
        return self.pp.recv(x, self.pp_index - 1)

    def send_to_next_stage(self, x: torch.Tensor) -> dist.Work:
        """Start sending hidden states to the next pipeline stage; wait on the result before reusing x."""
        return self.pp.isend(x, self.pp_index + 1)

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
                f"tp*dp*pp = {shape.tp}*{shape.dp}*{shape.pp} = {shape.world} but {len(ranks)} processes "
                f"were started; start {shape.world} processes or change --tp/--dp/--pp"
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
