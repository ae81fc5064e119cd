"""The torchrun env contract: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.

Every launcher (torchrun, Ray actors, Slurm tasks) hands a worker these variables, so the worker
cannot tell who started it. With none of them set, the worker is a single process.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on this machine now, for MASTER_PORT ("" checks every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RendezvousError(RuntimeError):
    """The process environment does not describe a valid place in a job."""


@dataclass(frozen=True)
class RankEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RankEnv:
        env = os.environ if env is None else env
        present = [k for k in REQUIRED if k in env]
        if not present:
            return cls()
        missing = [k for k in REQUIRED if k not in env]
        if missing:
            raise RendezvousError(
                f"{', '.join(present)} set but {', '.join(missing)} missing: start workers with torchrun "
                "or the launcher, which set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
            )
        try:
            rank_env = cls(
                rank=int(env["RANK"]),
                local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                world_size=int(env["WORLD_SIZE"]),
                local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
            )
        except ValueError as e:
            raise RendezvousError(f"a torchrun variable is not an integer: {e}") from e
        if not 0 <= rank_env.rank < rank_env.world_size:
            raise RendezvousError(f"RANK={rank_env.rank} is outside WORLD_SIZE={rank_env.world_size}")
        return rank_env

    def as_env(self) -> dict[str, str]:
        """The variables to hand a worker process."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def init_distributed(rank_env: RankEnv, timeout_s: float = 300.0) -> str:
    """Join the job's process group (NCCL with GPUs, gloo without); returns the backend.

    Every later collective inherits the timeout, so a dead peer ends the job instead of hanging it.
    """
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank_env.local_rank)
    if rank_env.world_size > 1 and not dist.is_initialized():
        # Under torchrun the agent already serves the store at MASTER_PORT: join it through env://.
        under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        init_method = "env://" if under_torchrun else f"tcp://{rank_env.master_addr}:{rank_env.master_port}"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank_env.rank,
            world_size=rank_env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return backend
