"""Which files one decode step runs through, and which package boundaries it crosses; and what one
decode step dispatches (`print_step_profile`, behind `launch bench --step-profile`).

    python -m moelaunch.measure.step_trace [--model checkpoints/small] [--batch 4] [--tp 2]

Runs the bundled model (or any checkpoint) through the engine, prefills `--batch` prompts, then profiles
one decode step (`LLMEngine.step`; rank 0's when --tp/--dp/--pp start more ranks) with sys.setprofile.
Prints the moelaunch files in the order the step first enters them, and every call from one subpackage
into another with its count: the decode step as docs/architecture.md draws it. A call from a lower
layer into a higher one (per .importlinter) is marked as going back up.
"""

from __future__ import annotations

import argparse
import configparser
import sys
from collections import Counter
from pathlib import Path

import torch

from moelaunch.engine.llm import LLM
from moelaunch.engine.routed_load import TOTAL_ONLY_WINDOW
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.engine.static_decode import StaticDecode
from moelaunch.engine.step_ops import StepOps

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
REPO = PACKAGE_ROOT.parent


def layer_order() -> dict[str, int]:
    """Subpackage -> depth in .importlinter's layers contract (0 is the top)."""
    config = configparser.ConfigParser()
    config.read(REPO / ".importlinter")
    layers = config["importlinter:contract:layers"]["layers"].split("\n")
    order: dict[str, int] = {}
    for depth, line in enumerate(x for x in layers if x.strip()):
        for name in line.split("|"):
            order[name.strip().removeprefix("moelaunch.")] = depth
    return order


def subpackage(filename: str) -> tuple[str, str] | None:
    """(subpackage, path inside moelaunch/) of a moelaunch source file, else None."""
    path = Path(filename)
    if not path.is_relative_to(PACKAGE_ROOT):
        return None
    rel = path.relative_to(PACKAGE_ROOT)
    return rel.parts[0], str(rel)


def trace_step(llm: LLM) -> tuple[list[str], Counter]:
    files: list[str] = []
    crossings: Counter = Counter()

    def profile(frame, event, _arg) -> None:
        if event != "call":
            return
        callee = subpackage(frame.f_code.co_filename)
        if callee is None:
            return
        if callee[1] not in files:
            files.append(callee[1])
        caller_frame = frame.f_back
        while caller_frame is not None and subpackage(caller_frame.f_code.co_filename) is None:
            caller_frame = caller_frame.f_back  # through torch's and the stdlib's frames
        caller = subpackage(caller_frame.f_code.co_filename) if caller_frame is not None else None
        if caller is not None and caller[0] != callee[0]:
            crossings[(caller[0], callee[0])] += 1

    sys.setprofile(profile)
    try:
        llm.engine.step()
    finally:
        sys.setprofile(None)
    return files, crossings


def trace_decode_step(llm: LLM, batch: int) -> tuple[list[str], Counter]:
    """Prefill `batch` short prompts, take a first decode step, then trace the next one."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i in range(batch):
        llm.engine.add_request(f"trace{i}", [1, 5 + i, 6, 7], params)
    for _ in range(2):
        llm.engine.step()  # the prompts' prefill, then a first decode step (lazy set-up done)
    return trace_step(llm)


def decode_step_ops(llm: LLM, batch: int) -> tuple[StepOps, StepOps]:
    """The ops of one decode engine step at `batch` sequences, taken as the engine is configured, then
    of one through the static decode step (not compiled: the ops a compiled step would trace)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"profile-{batch}-{i}", [1, 5 + i % 50, 6, 7], params)
    for _ in range(2):
        engine.step()  # the prompts' prefill, then a first decode step (lazy set-up done)
    with StepOps() as configured:
        engine.step()
    runner, before = engine.runner, engine.runner.static
    runner.static = StaticDecode(
        engine.model, engine.cache, batch, engine.max_model_len, llm.engine.mesh.device, False
    )
    try:
        with StepOps() as static:
            engine.step()
    finally:
        runner.static = before
    while engine.has_unfinished():
        engine.step()
    return configured, static


def print_step_profile(
    model: str,
    batch_sizes: tuple[int, ...],
    threads: int,
    expert_load: bool = False,
    dtypes: tuple[str, ...] = ("float32",),
) -> None:
    """Device ops (aten ops and custom-op calls; views and bare allocations left out), dtype conversions
    and host syncs of one decode engine step per dtype and batch size: the engine as configured (with
    whether it runs the static step), then the static step (expert_load: with the engine recording
    routed load)."""
    torch.set_num_threads(threads)
    window = TOTAL_ONLY_WINDOW if expert_load else None
    for dtype in dtypes:
        with LLM(
            model,
            dtype=dtype,
            max_num_seqs=max(batch_sizes),
            skip_tokenizer_init=True,
            expert_load_window=window,
        ) as llm:
            layers = len(llm.engine.model.layer_ids())
            static = "static" if llm.engine.runner.static is not None else "eager"
            print(
                f"{dtype}: ops per decode engine step ({layers} layers; the engine's steps: {static}; conv: "
                "dtype conversions; syncs: ops that read values back or give value-dependent shapes; "
                ".tolist()/.cpu() on CPU tensors are not seen)"
            )
            print(f"{'batch':>5}  {'step':<8}  {'ops':>6}  {'per layer':>9}  {'conv':>5}  syncs")
            for batch in batch_sizes:
                for name, ops in zip(("engine", "static"), decode_step_ops(llm, batch), strict=True):
                    syncs = ", ".join(f"{n} x{c}" for n, c in Counter(ops.syncs).most_common()) or "0"
                    print(
                        f"{batch:>5}  {name:<8}  {ops.total:>6}  {ops.total / layers:>9.1f}  "
                        f"{ops.conversions.total():>5}  {syncs}"
                    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "checkpoints" / "small"))
    p.add_argument("--batch", type=int, default=4)
    for name in ("tp", "dp", "pp"):
        p.add_argument(f"--{name}", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM(model=args.model, max_num_seqs=args.batch, tp=args.tp, dp=args.dp, pp=args.pp)
    files, crossings = trace_decode_step(llm, args.batch)
    order = layer_order()
    print(f"decode step at batch {args.batch}: {len(files)} moelaunch files, in the order first entered")
    for f in files:
        print(f"  {f}")
    print("calls between subpackages (caller -> callee: count)")
    for (caller, callee), n in sorted(crossings.items(), key=lambda kv: (order[kv[0][0]], order[kv[0][1]])):
        back = "  (back up a layer)" if order[callee] < order[caller] else ""
        print(f"  {caller} -> {callee}: {n}{back}")
    print(f"package boundaries crossed: {len(crossings)}")
    llm.shutdown()


if __name__ == "__main__":
    main()
