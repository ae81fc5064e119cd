"""torchrun-style generation, with the reference's flags:

    torchrun --nnodes N --nproc-per-node M [...] -m launcher.generate --ckpt-path DIR \\
        (--interactive | --input-file FILE) [--max-new-tokens 200] [--temperature 0.2] \\
        [--tp T --dp D --pp P] [--output-file OUT.jsonl]

Ranks come from the torchrun env; one process (`python -m launcher.generate ...`) works the same.
Only global rank 0 reads prompts and prints; everything it reads is broadcast to the other ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cluster.rendezvous import RankEnv, init_distributed
from model.tokenizer import Tokenizer
from parallel.mesh import MeshShape, ParallelMesh
from parallel.sharded_model import load_shard
from parallel.spmd_generator import GenRequest, SpmdGenerator

from .streaming import TextStreamer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launcher.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-path", required=True, help="Hugging Face checkpoint directory")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--interactive", action="store_true", help="chat on the terminal (rank 0)")
    mode.add_argument("--input-file", help="one prompt per line")
    p.add_argument("--output-file", help="write one JSON line per prompt: prompt, completion, token_ids")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (request i uses seed + i)")
    p.add_argument("--tp", type=int, help="tensor parallel size (default: what the world leaves)")
    p.add_argument("--dp", type=int, default=1, help="data parallel attention replicas")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any wait on a peer may take")
    p.add_argument("--config", help="accepted for compatibility; the model config is the checkpoint's")
    return p.parse_args(argv)


def mesh_shape(args: argparse.Namespace, world: int) -> MeshShape:
    tp = args.tp or max(world // (args.dp * args.pp), 1)
    return MeshShape(dp=args.dp, pp=args.pp, tp=tp)


class Job:
    """The pieces every rank holds: mesh, sharded model, tokenizer, generator."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        env = RankEnv.from_env()
        init_distributed(env, args.timeout)
        shape = mesh_shape(args, env.world_size)
        self.mesh = ParallelMesh.build(shape, args.timeout) if env.world_size > 1 else ParallelMesh.single()
        self.tokenizer = Tokenizer.from_dir(args.ckpt_path)
        model = load_shard(args.ckpt_path, self.mesh, DTYPES[args.dtype])
        self.generator = SpmdGenerator(model, self.mesh)
        self.is_printer = self.mesh.rank == 0

    def broadcast(self, obj: object) -> object:
        """Rank 0's object, on every rank."""
        if self.mesh.world.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def request(self, index: int, prompt_ids: list[int]) -> GenRequest:
        a = self.args
        stop = (self.tokenizer.eos_id,) if self.tokenizer.eos_id is not None else ()
        return GenRequest(index, prompt_ids, a.max_new_tokens, a.temperature, a.seed + index, stop)

    def completion_ids(self, ids: list[int]) -> list[int]:
        return ids[:-1] if ids and ids[-1] == self.tokenizer.eos_id else ids


def run_file(job: Job) -> None:
    prompts = None
    if job.is_printer:
        prompts = [
            line.rstrip("\n") for line in Path(job.args.input_file).read_text().splitlines() if line.strip()
        ]
    prompts = job.broadcast(prompts)
    tok = job.tokenizer
    requests = [
        job.request(i, tok.encode_chat([{"role": "user", "content": p}])) for i, p in enumerate(prompts)
    ]
    results = job.generator.generate(requests)
    if not job.is_printer:
        return
    lines = []
    for prompt, result in zip(prompts, results, strict=True):
        ids = job.completion_ids(result.token_ids)
        completion = tok.decode(ids)
        print(f"Prompt: {prompt}\nCompletion: {completion}\n", flush=True)
        lines.append(json.dumps({"prompt": prompt, "completion": completion, "token_ids": ids}) + "\n")
    if job.args.output_file:
        Path(job.args.output_file).write_text("".join(lines))


def run_interactive(job: Job) -> None:
    tok = job.tokenizer
    messages: list[dict[str, str]] = []
    while True:
        line = None
        if job.is_printer:
            try:
                line = input(">>> ")
            except EOFError:
                line = "/exit"
        line = job.broadcast(line)
        if line == "/exit":
            return
        if line == "/clear":
            messages.clear()
            continue
        messages.append({"role": "user", "content": line})
        streamer = TextStreamer(tok) if job.is_printer else None
        result = job.generator.generate([job.request(0, tok.encode_chat(messages))], streamer)
        if job.is_printer:
            print(flush=True)
        messages.append({"role": "assistant", "content": tok.decode(job.completion_ids(result[0].token_ids))})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    job = Job(args)
    try:
        run_interactive(job) if args.interactive else run_file(job)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
