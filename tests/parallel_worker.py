"""Run under torchrun by test_parallel_layouts.py: every layout given on the command line, one after
another, on the first dp*pp*tp ranks (the others wait), writing each layout's results to a file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cluster.rendezvous import RankEnv, init_distributed
from parallel.mesh import MeshShape, ParallelMesh
from parallel.sharded_model import load_shard
from parallel.spmd_generator import GenRequest, SpmdGenerator


def requests_from(spec: list[dict]) -> list[GenRequest]:
    return [GenRequest(**{**r, "stop_ids": tuple(r.get("stop_ids", ()))}) for r in spec]


def main(ckpt: str, out_dir: str, layouts: list[str], requests_file: str) -> None:
    env = RankEnv.from_env()
    init_distributed(env, timeout_s=120)
    all_requests = json.loads(Path(requests_file).read_text())
    for name in layouts:
        dp, pp, tp = (int(v) for v in name.split("x"))
        shape = MeshShape(dp=dp, pp=pp, tp=tp)
        # A layout smaller than the job runs on its first ranks; the others only help create groups.
        mesh = ParallelMesh.build(shape, timeout_s=120, ranks=list(range(shape.world)))
        if mesh is not None:
            model = load_shard(ckpt, mesh)
            requests = requests_from(all_requests[name])
            results = SpmdGenerator(model, mesh, record_logits=True).generate(requests)
            if env.rank == 0:
                torch.save(
                    {r.id: (r.token_ids, torch.stack(r.logits)) for r in results},
                    Path(out_dir) / f"{name}.pt",
                )
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4])
