"""Peak memory per rank when loading a sharded checkpoint, against one process loading the full model.

    python -m benchmarks.shard_memory [--ckpt DIR] [--layouts single,tp2,dp2,tp2xdp2,pp2,full]

Writes (once) a random DeepSeek-V3-shaped HF checkpoint of about 450 MB fp32 to --ckpt (the
"shard-memory" shape of `moelaunch.measure.random_checkpoint`), then starts one job per layout: `full`
and `single` as one process, the others under torchrun, e.g.
    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        -m benchmarks.shard_memory --worker tp2xdp2 --ckpt DIR --result FILE
Each rank reports the checkpoint bytes it read, the bytes of parameters it holds, its peak RSS
(VmHWM) during the load and its RSS once every weight has been read once (safetensors maps the
file, so weights become resident on first use), both minus its RSS right before loading, so torch's
import footprint is left out.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moelaunch.cluster.rendezvous import RankEnv, init_distributed
from moelaunch.engine.memory import peak_rss_bytes, process_memory
from moelaunch.measure.random_checkpoint import write_random_checkpoint
from moelaunch.model.checkpoint import CheckpointReader
from moelaunch.model.loading import load_model
from moelaunch.model.weight_spec import WeightSpec
from moelaunch.parallel.mesh import MeshShape, ParallelMesh
from moelaunch.parallel.parallelize import load_shard

MB = 1 << 20
# name: (tp, dp, pp); "full" is a single process running the unsharded loader.
LAYOUTS: dict[str, tuple[int, int, int]] = {
    "full": (1, 1, 1),
    "single": (1, 1, 1),
    "tp2": (2, 1, 1),
    "dp2": (1, 2, 1),
    "tp2xdp2": (2, 2, 1),
    "pp2": (1, 1, 2),
}


def build_mesh(layout: str) -> ParallelMesh:
    shape = MeshShape(*LAYOUTS[layout])
    return ParallelMesh.build(shape, timeout_s=120) if shape.world > 1 else ParallelMesh.single()


def warm_up_imports() -> None:
    """The first nn.Embedding init imports torch._dynamo (sympy, triton): ~150 MB of import, not load."""
    with torch.device("meta"):
        torch.nn.Embedding(2, 2)


def touch(model: torch.nn.Module) -> None:
    """Read every weight once, as a first forward would: safetensors hands out views of the mmapped
    file, so a weight becomes resident only when first used."""
    for p in model.parameters():
        p.sum()


def worker(layout: str, ckpt: str, result: Path) -> None:
    """One rank: measure around the load, gather every rank's numbers, rank 0 writes them."""
    env = RankEnv.from_env()
    init_distributed(env, timeout_s=120)
    mesh = None if layout == "full" else build_mesh(layout)
    warm_up_imports()
    gc.collect()
    before, peak_before = process_memory("VmRSS", "RssFile"), peak_rss_bytes()
    model = load_model(ckpt) if mesh is None else load_shard(WeightSpec(ckpt), mesh)
    load_peak = peak_rss_bytes()
    touch(model)
    after = process_memory("VmRSS", "RssFile")
    mine = {
        "rank": env.rank,
        "bytes_read": model.checkpoint_bytes_read,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "rss_before": before["VmRSS"],
        # The loader's own peak, valid when it exceeds every earlier peak of the process.
        "load_peak_delta": load_peak - before["VmRSS"],
        "peak_set_by_load": load_peak > peak_before,
        "touched_delta": after["VmRSS"] - before["VmRSS"],
        "touched_file_delta": after["RssFile"] - before["RssFile"],  # page cache, shared on a node
    }
    ranks = [mine]
    if dist.is_initialized():
        ranks = [{} for _ in range(env.world_size)]
        dist.all_gather_object(ranks, mine)
    if env.rank == 0:
        result.write_text(json.dumps(ranks))
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(layout: str, ckpt: Path, result: Path) -> list[dict[str, Any]]:
    world = MeshShape(*LAYOUTS[layout]).world
    cmd = [sys.executable]
    if world > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    cmd += ["-m", "benchmarks.shard_memory", "--worker", layout, "--ckpt", str(ckpt), "--result", str(result)]
    subprocess.run(cmd, check=True, timeout=600)
    return json.loads(result.read_text())


def report(ckpt_bytes: int, results: dict[str, list[dict[str, Any]]]) -> None:
    print(f"checkpoint: {ckpt_bytes / MB:.1f} MB of tensors; RSS columns are MB above the RSS before loading")
    print("layout    rank  read MB  read/ckpt  params MB  load peak  after touching (file-backed)")
    for layout, ranks in results.items():
        for r in ranks:
            flag = "" if r["peak_set_by_load"] else "  (peak predates load)"
            print(
                f"{layout:<8}  {r['rank']:>4}  {r['bytes_read'] / MB:>7.1f}"
                f"  {r['bytes_read'] / ckpt_bytes:>9.2f}  {r['param_bytes'] / MB:>9.1f}"
                f"  {r['load_peak_delta'] / MB:>9.1f}"
                f"  {r['touched_delta'] / MB:>14.1f} ({r['touched_file_delta'] / MB:.1f}){flag}"
            )
    print(json.dumps({"checkpoint_bytes": ckpt_bytes, "layouts": results}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_ckpt = Path(tempfile.gettempdir()) / "moelaunch-shard-memory-ckpt"
    p.add_argument("--ckpt", type=Path, default=default_ckpt, help="checkpoint dir (written if empty)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {list(LAYOUTS)}")
    p.add_argument("--worker", choices=list(LAYOUTS), help=argparse.SUPPRESS)  # set by launch()
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    unknown = set(a.layouts.split(",")) - set(LAYOUTS)
    if unknown:
        p.error(f"unknown layouts {sorted(unknown)}: choose from {list(LAYOUTS)}")
    if a.worker:
        worker(a.worker, str(a.ckpt), a.result)
        return
    if not (a.ckpt / "config.json").exists():
        write_random_checkpoint(a.ckpt, "shard-memory")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in a.layouts.split(","):
            results[layout] = launch(layout, a.ckpt, Path(tmp) / f"{layout}.json")
    report(CheckpointReader(a.ckpt).total_bytes(), results)


if __name__ == "__main__":
    main()
