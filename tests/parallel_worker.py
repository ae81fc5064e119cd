"""Run under torchrun by test_parallel_layouts.py: each layout of the plan file, one after another,
on the first tp*dp*pp ranks of the job (the others only help create process groups), from the
checkpoint given or the one the layout names. The layout's rank 0 drives the engine and saves tokens and
top log-probabilities; every rank reports how many checkpoint bytes it read."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moelaunch.cluster.rendezvous import RankEnv, init_distributed
from moelaunch.engine.config import EngineConfig
from moelaunch.engine.drive import run_to_completion
from moelaunch.engine.engine import LLMEngine
from moelaunch.engine.routed_load import moe_layers
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.model.weight_spec import WeightSpec
from moelaunch.parallel.mesh import MeshShape, ParallelMesh


def run_layout(ckpt: str, out_dir: Path, name: str, plan: dict) -> None:
    shape = MeshShape(*plan["shape"])
    mesh = ParallelMesh.build(shape, timeout_s=120, ranks=list(range(shape.world)))
    if mesh is None:
        return
    config = EngineConfig.model_validate(
        {"kv_cache_memory": 2_000_000, "block_size": 4, **plan.get("engine", {})}, strict=False
    )
    weights = WeightSpec(
        plan.get("checkpoint", ckpt),
        quantization=plan.get("quantization", "none"),
        expert_placement=plan.get("placement"),
        layer_expert_placement=plan.get("layer_placement"),
    )
    engine = LLMEngine(weights, mesh, config)
    read = [None] * mesh.world.size
    dist.all_gather_object(read, engine.model.checkpoint_bytes_read, group=mesh.world.pg)
    if mesh.rank != 0:
        engine.worker_loop()
        gather_experts(engine)
        return
    if "swap" in plan:  # an explicit placement, applied before the first step
        engine.set_expert_placement({int(k): v for k, v in plan["swap"].items()})
    for r in plan["requests"]:
        params = SamplingParams(temperature=r.get("temperature", 0.0), max_tokens=r["max_new_tokens"],
                                seed=r.get("seed", 0), ignore_eos=True, logprobs=20)  # fmt: skip
        engine.add_request(str(r["id"]), r["prompt"], params)
    done = run_to_completion(engine)
    load = engine.read_expert_load() if engine.load is not None else None  # every rank joins the sum
    engine.shutdown()
    results = {int(k): (v.outputs[0].token_ids, v.outputs[0].logprobs) for k, v in done.items()}
    saved = {"results": results, "bytes_read": read, "experts": gather_experts(engine)}
    if load is not None:
        saved["load_tokens"] = load.tokens(load.total)
    torch.save(saved, out_dir / f"{name}.pt")


def gather_experts(engine: LLMEngine) -> list[dict]:
    """Every rank's routed experts (their tensors by layer and expert id) and placements applied."""
    mine = {
        "rebalances": engine.rebalances,
        "placements": {i: p.owners for i, p in engine.placements().items()},
        "tensors": {
            i: {int(e): expert.state_dict() for e, expert in moe.experts.items()}
            for i, moe in moe_layers(engine.model).items()
        },
    }
    every = [None] * engine.mesh.world.size
    dist.all_gather_object(every, mine, group=engine.mesh.world.pg)
    return every


def main(ckpt: str, out_dir: str, plan_file: str) -> None:
    init_distributed(RankEnv.from_env(), timeout_s=120)
    for name, plan in json.loads(Path(plan_file).read_text()).items():
        run_layout(ckpt, Path(out_dir), name, plan)
        dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:4])
