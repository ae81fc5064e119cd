"""transformers' `generate` on the same checkpoint and requests: static batches, left-padded, greedy.

A batch runs until its longest request is done (min_new_tokens = max_new_tokens, the ignore_eos
equivalent); a request counts as finished when its own output length is reached, and only the
tokens it asked for count, so the padding and overrun work of static batching is charged to HF.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from moelaunch.engine.memory import peak_rss_bytes, reset_peak_rss
from moelaunch.measure.bench.metrics import MB, CaseRun, RequestTiming
from moelaunch.measure.bench.workloads import BenchRequest, Case


def load_hf_model(model_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ValueError("--compare needs transformers: pip install 'moelaunch[test]'") from e
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device)
    return model.eval()


class _TokenClock:
    """A stopping criterion that never stops: it notes when each new token exists."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def _run_batch(model: Any, batch: list[BenchRequest], arrival: float) -> list[RequestTiming]:
    from transformers import StoppingCriteriaList

    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids) :] = 1
    steps = max(r.output_len for r in batch)
    clock = _TokenClock()
    model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        pad_token_id=0,
        stopping_criteria=StoppingCriteriaList([clock]),
    )
    return [
        RequestTiming(arrival, clock.times[0], clock.times[r.output_len - 1], len(r.prompt_ids), r.output_len)
        for r in batch
    ]


def run_case(model: Any, case: Case, max_batch: int) -> CaseRun:
    size = case.batch_size or max_batch
    reset_peak_rss()
    start = time.perf_counter()
    timings = []
    for b in range(0, len(case.requests), size):
        timings += _run_batch(model, case.requests[b : b + size], start)
    return CaseRun(timings, time.perf_counter() - start, peak_rss_bytes() / MB)
