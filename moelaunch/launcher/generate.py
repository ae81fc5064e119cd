"""torchrun-style generation, with the reference's flags:

    torchrun --nnodes N --nproc-per-node M [...] -m moelaunch.launcher.generate --ckpt-path DIR \\
        (--interactive | --input-file FILE) [--max-new-tokens 200] [--temperature 0.2] \\
        [--tp T --dp D --pp P] [--output-file OUT.jsonl]

Ranks come from the torchrun env; one process (`python -m moelaunch.launcher.generate ...`) works the same.
Only global rank 0 reads prompts and prints; the engine sends the requests to the other ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

from moelaunch.cluster.rendezvous import RankEnv
from moelaunch.engine.build import EngineSpec, build_engine
from moelaunch.engine.config import EngineConfig
from moelaunch.engine.drive import run_to_completion
from moelaunch.engine.engine import LLMEngine
from moelaunch.engine.outputs import raise_if_failed
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.launcher.commands import count, sampling_value
from moelaunch.launcher.jobs.chat import chat_loop, terminal_lines
from moelaunch.launcher.jobs.output_path import check_writable
from moelaunch.model.weight_spec import WEIGHT_DTYPES, WeightSpec
from moelaunch.parallel.mesh import MeshShape
from moelaunch.tasks.capabilities import capabilities_line
from moelaunch.text.files import check_readable, read_text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m moelaunch.launcher.generate", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--ckpt-path", required=True, help="Hugging Face checkpoint directory")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--interactive", action="store_true", help="chat on the terminal (rank 0)")
    mode.add_argument("--input-file", help="one prompt per line")
    p.add_argument("--output-file", help="write one JSON line per prompt: prompt, completion, token_ids")
    p.add_argument("--max-new-tokens", type=sampling_value("max_tokens"), default=200)
    p.add_argument("--temperature", type=sampling_value("temperature"), default=0.2)
    p.add_argument(
        "--seed", type=sampling_value("seed"), default=0, help="sampling seed (prompt i uses seed + i)"
    )
    p.add_argument("--tp", type=count, help="tensor parallel size (default: what the world leaves)")
    p.add_argument("--dp", type=count, default=1, help="data parallel attention replicas")
    p.add_argument("--pp", type=count, default=1, help="pipeline stages")
    p.add_argument("--dtype", choices=WEIGHT_DTYPES, default="auto")
    p.add_argument("--speculative", choices=["mtp"], help="draft with the checkpoint's MTP layer")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any wait on a peer may take")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> LLMEngine:
    world = RankEnv.from_env().world_size
    tp = args.tp or max(world // (args.dp * args.pp), 1)
    config = EngineConfig(speculative=args.speculative, seed=args.seed)
    weights = WeightSpec(args.ckpt_path, args.dtype)
    spec = EngineSpec(weights, MeshShape(tp, args.dp, args.pp), config, args.timeout)
    return build_engine(spec)


def params(args: argparse.Namespace, index: int) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, max_tokens=args.max_new_tokens, seed=args.seed + index
    )


def completion_ids(engine: LLMEngine, ids: list[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] == engine.tokenizer.eos_id else ids


def run_file(engine: LLMEngine, args: argparse.Namespace) -> None:
    text = read_text(Path(args.input_file), "--input-file")
    prompts = [line for line in text.splitlines() if line.strip()]
    tok = engine.tokenizer
    for i, prompt in enumerate(prompts):
        engine.add_request(
            str(i), tok.encode_chat([{"role": "user", "content": prompt}]), params(args, i), prompt
        )
    done = run_to_completion(engine)
    raise_if_failed([done[str(i)] for i in range(len(prompts))])
    lines = []
    for i, prompt in enumerate(prompts):
        ids = completion_ids(engine, done[str(i)].outputs[0].token_ids)
        completion = tok.decode(ids)
        print(f"Prompt: {prompt}\nCompletion: {completion}\n", flush=True)
        lines.append(json.dumps({"prompt": prompt, "completion": completion, "token_ids": ids}) + "\n")
    if args.output_file:
        Path(args.output_file).write_text("".join(lines))


def run_interactive(engine: LLMEngine, args: argparse.Namespace) -> None:
    if (line := capabilities_line(args.ckpt_path)) is not None:
        print(line)
    chat_loop(
        engine,
        engine.tokenizer,
        lambda turn: params(args, turn),
        terminal_lines(on_idle=engine.keepalive, idle_s=args.timeout / 3),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.output_file:
            check_writable(Path(args.output_file), "--output-file")
        if args.input_file:
            check_readable(Path(args.input_file), "--input-file")
        engine = build(args)
    except ValueError as e:  # bad input, layout or checkpoint: one line (from global rank 0)
        if RankEnv.from_env().rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        if engine.mesh.rank != 0:
            engine.worker_loop()  # rank 0 reads, prints and drives every step
        elif args.interactive:
            run_interactive(engine, args)
        else:
            run_file(engine, args)
    finally:
        if engine.mesh.rank == 0:
            engine.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
