"""Long context through the engine: chunked prefill of a 4K / 32K / 128K-token prompt over the paged
latent cache, then 32 greedy decodes, at tp=1 and tp=2, with peak memory against `launch plan`'s
prediction; and the checks of fidelity at length.

    python -m benchmarks.long_context                        # the engine table (tp 1 and 2, 4K/32K/128K)
    python -m benchmarks.long_context --lengths 4096,32768 --tp 1
    python -m benchmarks.long_context --versus-transformers 12288,16384   # logits, greedy, prefill time
    python -m benchmarks.long_context --absorbed-check       # decode forms at 4K/32K/64K/131K
    python -m benchmarks.long_context --drift                # fp8 cache, window, top-k vs the full cache

The model is the "long-context" random checkpoint of `moelaunch.measure.random_checkpoint` (DeepSeek-V3's
YaRN, positions and 576-wide latent; written once to --ckpt). Every engine run is its own process, so
its peak RSS (VmHWM) is that run's; memory growth is the peak minus the RSS right before the engine
started (imports and the CPU kernels loaded), which is what the plan predicts (weights + KV cache sized
for max_model_len + activations). A prompt is max_model_len - 32 tokens, so prompt and output together
fill the context.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from moelaunch.engine.memory import peak_rss_bytes, rss_bytes
from moelaunch.measure.random_checkpoint import write_random_checkpoint

MB = 2**20
NEW_TOKENS = 32
VOCAB_FLOOR = 2  # prompt ids from here up: clear of the byte tokenizer's special ids


def checkpoint(path: Path) -> Path:
    if not (path / "config.json").exists():
        write_random_checkpoint(path, "long-context", decisive_routing=True)
    return path


def random_prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(VOCAB_FLOOR, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def planned_bytes(ckpt: Path, tp: int, max_model_len: int, chunk: int, engine: dict) -> int:
    """`launch plan`'s memory for the heaviest rank of this run's deployment."""
    from moelaunch.launcher.deploy.config import DeployConfig
    from moelaunch.launcher.deploy.plan import build_plan

    cfg = DeployConfig.model_validate(
        {
            "model": str(ckpt),
            "dtype": "float32",
            "parallel": {"tp": tp},
            "engine": {"max_model_len": max_model_len, "max_num_seqs": 1, "max_num_batched_tokens": chunk,
                       **engine},
            "cluster": {"device": "cpu", "devices_per_node": tp},
        }
    )  # fmt: skip
    return build_plan(cfg).heaviest.total_bytes


def child_peaks(llm) -> list[int]:
    """VmHWM of the worker processes (ranks 1..) in bytes, read before they stop."""
    peaks = []
    for proc in llm._workers:
        with open(f"/proc/{proc.pid}/status") as f:
            peaks += [int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")]
    return peaks


def engine_run(ckpt: Path, tp: int, max_model_len: int, chunk: int, engine: dict) -> dict:
    """One engine: the prompt, then NEW_TOKENS greedy tokens; timings, memory and the tokens."""
    from moelaunch import kernels
    from moelaunch.engine.llm import LLM
    from moelaunch.engine.sampling_params import SamplingParams

    kernels.prepare_cpu_kernels()
    prompt = random_prompt(max_model_len - NEW_TOKENS)
    before = rss_bytes()
    with LLM(str(ckpt), tp=tp, max_model_len=max_model_len, max_num_seqs=1, max_num_batched_tokens=chunk,
             skip_tokenizer_init=True, kv_cache_memory=4 << 30, **engine) as llm:  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        workers = child_peaks(llm)
    m, completion = out.metrics, out.outputs[0]
    return {
        "tp": tp,
        "max_model_len": max_model_len,
        "prompt": len(prompt),
        "prefill_s": m.ttft,
        "decode_s": m.finished - m.first_token,
        "tokens": completion.token_ids,
        "first_logprobs": {str(k): v for k, v in completion.logprobs[0].items()},
        "rss_before": before,
        "peak_rank0": peak_rss_bytes(),
        "peak_workers": workers,
        "planned": planned_bytes(ckpt, tp, max_model_len, chunk, engine),
    }


def in_process(args: argparse.Namespace, tp: int, length: int, engine: dict) -> dict:
    """engine_run in a fresh Python, so that its peak RSS is this run's alone."""
    run = json.dumps({"tp": tp, "length": length, "engine": engine})
    command = [sys.executable, "-m", "benchmarks.long_context", "--ckpt", str(args.ckpt), "--chunk",
               str(args.chunk), "--one-run", run]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode:
        raise RuntimeError(f"run tp={tp} length={length} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def engine_table(args: argparse.Namespace) -> None:
    print("| tp | max_model_len | prompt | prefill s | prefill tok/s | decode tok/s | RSS before MB "
          "| peak RSS MB (rank 0 / others) | growth MB | plan MB | growth / plan |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for tp in args.tp:
        for length in args.lengths:
            r = in_process(args, tp, length, {})
            growth = r["peak_rank0"] - r["rss_before"]
            others = "/".join(f"{p / MB:.0f}" for p in r["peak_workers"]) or "-"
            print(f"| {tp} | {length} | {r['prompt']} | {r['prefill_s']:.1f} | "
                  f"{r['prompt'] / r['prefill_s']:.0f} | {(NEW_TOKENS - 1) / r['decode_s']:.1f} | "
                  f"{r['rss_before'] / MB:.0f} | "
                  f"{r['peak_rank0'] / MB:.0f} / {others} | {growth / MB:.0f} | {r['planned'] / MB:.0f} | "
                  f"{growth / r['planned']:.3f} |", flush=True)  # fmt: skip


def drift(args: argparse.Namespace) -> None:
    """The approximations against the full cache at the longest length: greedy tokens kept, and the
    first generated position's top log-probabilities (same prompt, so any difference is the option's)."""
    length = max(args.lengths)
    options = {"fp8 cache": {"kv_cache_dtype": "fp8"}, "window 4096": {"attention": {"window": 4096}},
               "top-k 256 blocks": {"attention": {"topk_blocks": 256}}}  # fmt: skip
    full = in_process(args, 1, length, {})
    print(f"full cache: prefill {full['prefill_s']:.1f} s; greedy tokens {full['tokens'][:8]}...")
    print("| option | prefill s | greedy tokens equal to the full cache's (of 32) "
          "| first token's top-5 logprob max abs diff |")  # fmt: skip
    print("|---|---:|---:|---:|")
    for name, engine in options.items():
        r = in_process(args, 1, length, engine)
        same = next(
            (i for i, (a, b) in enumerate(zip(r["tokens"], full["tokens"], strict=True)) if a != b),
            NEW_TOKENS,
        )
        common = set(r["first_logprobs"]) & set(full["first_logprobs"])
        diff = max(abs(r["first_logprobs"][k] - full["first_logprobs"][k]) for k in common)
        print(f"| {name} | {r['prefill_s']:.1f} | first {same} | {diff:.2e} |", flush=True)


def versus_transformers(args: argparse.Namespace, lengths: list[int]) -> None:
    """Logits at every prompt position (chunked prefill over the latent cache) and the next 8 greedy
    tokens against transformers' DeepseekV3ForCausalLM (sdpa), with each side's prefill time."""
    import transformers

    from moelaunch.model import load_model
    from moelaunch.model.single_sequence import generate

    ours = load_model(args.ckpt)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        args.ckpt, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    print("| prompt | our prefill s (median of 3, min-max) | transformers s | max abs logit diff "
          "| at positions (diff) | 8 greedy tokens equal |")  # fmt: skip
    print("|---:|---:|---:|---:|---|---|")
    for length in lengths:
        ids = torch.tensor([random_prompt(length, seed=length)])
        times = []
        with torch.inference_mode():
            for _ in range(3):
                start = time.perf_counter()
                cache = ours.new_cache(1, length + 8)
                logits = torch.cat(
                    [ours(ids[:, a : a + args.chunk], a, cache) for a in range(0, length, args.chunk)], dim=1
                )[0]
                times.append(time.perf_counter() - start)
        tokens = generate(ours, ids[0].tolist(), 8)
        with torch.inference_mode():
            start = time.perf_counter()
            expected = theirs(torch.cat([ids, torch.tensor([tokens])], dim=1)).logits[0]
            hf_s = time.perf_counter() - start
        err = (logits - expected[:length]).abs().amax(dim=-1)
        picks = [p for p in (0, 4095, 4096, length // 2, length - 1) if p < length]
        at = ", ".join(f"{p}: {err[p]:.1e}" for p in picks)
        greedy = expected[length - 1 :].argmax(dim=-1).tolist()[:8] == tokens
        ours_s = f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})"
        print(f"| {length} | {ours_s} | {hf_s:.2f} | {err.max():.1e} | {at} | {greedy} |", flush=True)


def absorbed_check(args: argparse.Namespace) -> None:
    """At positions near 4K/32K/64K/131K, after a chunked (naive-form) prefill over the latent cache: the
    absorbed decode (paged decode kernel) against the unabsorbed form (per-head keys expanded from the same
    cache), logits and greedy tokens, 2 decoded tokens at each point."""
    from moelaunch.model import load_model

    ours = load_model(args.ckpt)
    total = max(args.lengths)
    points = [p for p in (4096, 32768, 65536, total - 2) if p <= total - 2]
    prompt = torch.tensor([random_prompt(total)])
    cache = ours.new_cache(1, total)
    print("| position | max abs logit diff (absorbed - naive) | greedy token equal |")
    print("|---:|---:|---|")
    pos = 0
    with torch.inference_mode():
        for point in points:
            for a in range(pos, point, args.chunk):
                ours(prompt[:, a : min(point, a + args.chunk)], a, cache)
            token = prompt[:, point : point + 1]
            for p in (point, point + 1):
                logits = {}
                for impl in ("absorbed", "naive"):  # both store the same position's latent; naive last
                    ours.attn_impl = impl
                    logits[impl] = ours(token, p, cache)[0, -1]
                ours.attn_impl = "auto"
                diff = (logits["absorbed"] - logits["naive"]).abs().max().item()
                same = int(logits["absorbed"].argmax()) == int(logits["naive"].argmax())
                print(f"| {p} | {diff:.2e} | {same} |", flush=True)
                token = logits["naive"].argmax().view(1, 1)
            pos = point + 2


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt", type=Path, default=Path("/tmp/moelaunch-long-context"))
    parser.add_argument("--lengths", default="4096,32768,131072", help="max_model_len of each run")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (prefill chunk)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one engine run may take")
    parser.add_argument("--versus-transformers", default=None, help="prompt lengths, e.g. 12288,16384")
    parser.add_argument("--absorbed-check", action="store_true")
    parser.add_argument("--drift", action="store_true")
    parser.add_argument("--one-run", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.tp = [int(n) for n in args.tp.split(",")]
    checkpoint(args.ckpt)
    if args.one_run:
        run = json.loads(args.one_run)
        print(json.dumps(engine_run(args.ckpt, run["tp"], run["length"], args.chunk, run["engine"])))
    elif args.versus_transformers:
        versus_transformers(args, [int(n) for n in args.versus_transformers.split(",")])
    elif args.absorbed_check:
        absorbed_check(args)
    elif args.drift:
        drift(args)
    else:
        engine_table(args)


if __name__ == "__main__":
    main()
