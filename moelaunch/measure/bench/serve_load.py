"""`launch bench serve`: load on any OpenAI-compatible server, measured as `vllm bench serve` does.

Requests go to POST /v1/completions, streamed, with random token-id prompts of --input-len tokens (ids
drawn from --token-range, which any vocabulary of that size holds), exactly --output-len tokens each
(ignore_eos) and greedy sampling. Arrivals are a Poisson process at --request-rate (inf: all at once),
at most --max-concurrency in flight. Per request: TTFT (send to the first chunk with a choice), ITL
(gaps between such chunks: a server streams one per step that brought tokens, whatever their text),
TPOT ((E2EL - TTFT) / (tokens - 1)) and E2EL (send to last byte).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class LoadOptions:
    url: str  # the server's base, e.g. http://127.0.0.1:8000 (with or without /v1)
    num_prompts: int = 100
    request_rate: float = math.inf
    max_concurrency: int | None = None
    input_len: int = 256
    output_len: int = 128
    token_range: tuple[int, int] = (3, 64)
    api_key: str | None = None
    model: str | None = None  # default: the server's first model
    seed: int = 0
    timeout_s: float = 600.0


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def _one(client: httpx.AsyncClient, body: dict[str, Any]) -> RequestResult:
    start = time.perf_counter()
    result, last = RequestResult(ok=False), start
    try:
        async with client.stream("POST", "/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):  # a step's tokens (the text may be empty or held back)
                    if not result.ttft:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2el = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no usage in the stream (the server ignored stream_options.include_usage?)"
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _run(opts: LoadOptions) -> tuple[list[RequestResult], float, str]:
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    async with httpx.AsyncClient(base_url=_base(opts.url), headers=headers, timeout=opts.timeout_s) as client:
        model = opts.model
        if model is None:
            listed = await client.get("/models")
            listed.raise_for_status()
            model = listed.json()["data"][0]["id"]
        rng = random.Random(opts.seed)
        low, high = opts.token_range
        bodies = [
            {
                "model": model,
                "prompt": [rng.randrange(low, high) for _ in range(opts.input_len)],
                "max_tokens": opts.output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for _ in range(opts.num_prompts)
        ]
        gate = asyncio.Semaphore(opts.max_concurrency or opts.num_prompts)

        async def limited(body: dict[str, Any]) -> RequestResult:
            async with gate:
                return await _one(client, body)

        start = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(limited(body)))
            if math.isfinite(opts.request_rate):
                await asyncio.sleep(rng.expovariate(opts.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start, model


def _spread(values: list[float]) -> dict[str, float | None]:
    """mean, median and p99 in milliseconds."""
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    ms = lambda v: round(1e3 * v, 2)  # noqa: E731
    return {"mean": ms(statistics.fmean(values)), "median": ms(statistics.median(values)), "p99": ms(p99)}


def run_load(opts: LoadOptions) -> dict[str, Any]:
    results, duration, model = asyncio.run(_run(opts))
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    return {
        "model": model,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": round(duration, 3),
        "request_throughput": round(len(done) / duration, 3),
        "output_tok_s": round(output / duration, 2),
        "total_tok_s": round((prompt + output) / duration, 2),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "ttft_ms": _spread([r.ttft for r in done]),
        "tpot_ms": _spread([(r.e2el - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]),
        "itl_ms": _spread([gap for r in done for gap in r.itl]),
        "e2el_ms": _spread([r.e2el for r in done]),
    }


def load_table(result: dict[str, Any]) -> str:
    lines = [
        f"model {result['model']}: {result['completed']} requests done, {result['failed']} failed "
        f"in {result['duration_s']} s",
        f"request throughput {result['request_throughput']} req/s, output {result['output_tok_s']} tok/s, "
        f"total {result['total_tok_s']} tok/s",
        f"{'ms':<6}{'mean':>10}{'median':>10}{'p99':>10}",
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = result[f"{name}_ms"]
        lines.append(f"{name.upper():<6}" + "".join(f"{s[k] if s[k] is not None else '-':>10}" for k in s))
    return "\n".join(lines + [f"error: {e}" for e in result["errors"]])
