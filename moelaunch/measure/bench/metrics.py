"""What a benchmark measures, computed the same way for every system from per-request timestamps.

Every request of a case arrives when the case starts. TTFT: arrival to first token. TPOT: time per
output token after the first. decode tok/s: for a case whose B requests decode together, B / TPOT,
the generation rate once prefill is over (the target figure). Peak memory: the process's peak RSS
during the case (Linux VmHWM, reset before each case: `engine.memory`), model weights included.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class RequestTiming:
    arrival: float
    first_token: float
    finished: float
    prompt_tokens: int
    output_tokens: int


MB = 1 << 20


@dataclass
class CaseRun:
    timings: list[RequestTiming]
    seconds: float
    peak_rss_mb: float


def summarize(run: CaseRun, batch_size: int | None) -> dict[str, float | int | None]:
    t = run.timings
    ttft = [r.first_token - r.arrival for r in t]
    tpot = [(r.finished - r.first_token) / (r.output_tokens - 1) for r in t if r.output_tokens > 1]
    prompt_tokens = sum(r.prompt_tokens for r in t)
    output_tokens = sum(r.output_tokens for r in t)
    mean_tpot = statistics.fmean(tpot) if tpot else None
    return {
        "requests": len(t),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "seconds": round(run.seconds, 3),
        "output_tok_s": round(output_tokens / run.seconds, 2),
        "total_tok_s": round((prompt_tokens + output_tokens) / run.seconds, 2),
        "decode_tok_s": round(batch_size / mean_tpot, 2) if batch_size and mean_tpot else None,
        "ttft_ms": round(1e3 * statistics.fmean(ttft), 2),
        "ttft_ms_max": round(1e3 * max(ttft), 2),
        "tpot_ms": round(1e3 * mean_tpot, 2) if mean_tpot else None,
        "peak_rss_mb": round(run.peak_rss_mb, 1),
    }
