"""Run under torchrun by test_parallel_layouts.py: each layout of the plan file, one after another,
on the first dp*pp*tp ranks of the job (the others only help create process groups). Rank 0 of each
layout saves its results; every rank reports how many checkpoint bytes it read."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cluster.rendezvous import RankEnv, init_distributed
from parallel.expert_parallel import ExpertPlacement
from parallel.mesh import MeshShape, ParallelMesh
from parallel.sharded_model import load_shard
from parallel.spmd_generator import GenRequest, SpmdGenerator


def run_layout(ckpt: str, out_dir: Path, name: str, plan: dict) -> None:
    dp, pp, tp = plan["shape"]
    shape = MeshShape(dp=dp, pp=pp, tp=tp)
    mesh = ParallelMesh.build(shape, timeout_s=120, ranks=list(range(shape.world)))
    if mesh is None:
        return
    placement = None
    if "placement" in plan:
        placement = ExpertPlacement.from_map(plan["placement"], len(plan["placement"]), shape.ep)
    model = load_shard(ckpt, mesh, placement=placement)
    requests = [GenRequest(**r) for r in plan["requests"]]
    results = SpmdGenerator(model, mesh, record_logits=True).generate(requests)
    read = [None] * mesh.world.size
    dist.all_gather_object(read, model.checkpoint_bytes_read, group=mesh.world.pg)
    if mesh.rank == 0:
        tokens = {r.id: r.token_ids for r in results}
        logits = {r.id: torch.stack(r.logits) for r in results}
        torch.save({"tokens": tokens, "logits": logits, "bytes_read": read}, out_dir / f"{name}.pt")


def main(ckpt: str, out_dir: str, plan_file: str) -> None:
    init_distributed(RankEnv.from_env(), timeout_s=120)
    for name, plan in json.loads(Path(plan_file).read_text()).items():
        run_layout(ckpt, Path(out_dir), name, plan)
        dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:4])
