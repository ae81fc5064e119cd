"""This project's engine on a benchmark case: every request added at once, then engine steps until
all are done; the engine's own first-token and finish timestamps give TTFT and TPOT."""

from __future__ import annotations

import time

from moelaunch.engine.drive import Request, drive
from moelaunch.engine.llm import LLM
from moelaunch.engine.memory import peak_rss_bytes, reset_peak_rss
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.measure.bench.metrics import MB, CaseRun, RequestTiming
from moelaunch.measure.bench.workloads import Case


def run_case(llm: LLM, case: Case) -> CaseRun:
    engine = llm.engine
    reset_peak_rss()
    start = time.perf_counter()
    requests = []
    for i, r in enumerate(case.requests):  # every system generates exactly output_len tokens
        params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
        requests.append(Request(f"{case.name}-{i}", r.prompt_ids, params))
    timings = []
    for outputs in drive(engine, requests):
        for out in outputs:
            if out.finished:
                m, n_out = out.metrics, len(out.outputs[0].token_ids)
                timings.append(
                    RequestTiming(start, m.first_token, m.finished, len(out.prompt_token_ids), n_out)
                )
    return CaseRun(timings, time.perf_counter() - start, peak_rss_bytes() / MB)
