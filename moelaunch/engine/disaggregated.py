"""Prefill/decode disaggregation's router: one front door over prefill and decode engines.

A request first runs on a prefill engine with max_tokens=1: it computes the prompt's latents and the
first token, and keeps the prompt's cache blocks. Unless that token already ends the request, the
request moves to a decode engine with a KVHandoff; the decode engine reads the blocks it lacks
(engine/kv_peer.py) when it admits the request, then generates the rest. Once the decode side has
read them (its first output for the request), the prefill side releases the blocks.

It has the front-end methods of LLMEngine (add_request, step, abort, release...), so chat, batch and
serve jobs drive it unchanged. Engines are LLMEngines or proxies of them (the Ray backend).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from moelaunch.engine.kv_handoff import CacheEndpoint
from moelaunch.engine.outputs import ABORT, ERROR, RequestMetrics, RequestOutput
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.engine.stats import EngineStats


class DisaggregatedEngine:
    def __init__(self, prefill: list[Any], decode: list[Any]) -> None:
        self.prefill, self.decode = prefill, decode
        self.config = decode[0].config
        self.max_model_len = min(e.max_model_len for e in prefill + decode)
        _check_caches(prefill[0].kv_endpoints, decode[0].kv_endpoints)
        self.transport = prefill[0].kv_endpoints[0].transport
        self._params: dict[str, SamplingParams] = {}
        self._metrics: dict[str, RequestMetrics] = {}
        self._where: dict[str, Any] = {}  # request -> the engine holding it now
        self._from: dict[str, Any] = {}  # request -> the prefill engine whose blocks it still needs

    # ---- front end ----
    def check_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if params.n != 1:
            raise ValueError(
                f"request {request_id!r}: n={params.n} with prefill/decode disaggregation: give n=1 "
                "(send the request n times for several samples)"
            )
        if request_id in self._where:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.prefill[0].check_request(request_id, prompt_ids, _first_token_only(params))
        self.decode[0].check_request(request_id, prompt_ids, params)

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> None:
        self.check_request(request_id, prompt_ids, params)
        engine = _least_busy(self.prefill)
        engine.add_request(request_id, prompt_ids, _first_token_only(params), prompt)
        self._params[request_id] = params
        self._metrics[request_id] = RequestMetrics(time.perf_counter())
        self._where[request_id] = engine

    def step(self) -> list[RequestOutput]:
        outputs = []
        for engine in self.prefill:
            if engine.has_unfinished():
                outputs += [self._prefilled(engine, out) for out in engine.step()]
        for engine in self.decode:
            if engine.has_unfinished():
                outputs += [self._decoded(out) for out in engine.step()]
        return outputs

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.prefill + self.decode)

    def abort(self, request_id: str) -> None:
        if request_id in self._where:
            self._where[request_id].abort(request_id)

    def release(self, request_id: str) -> None:
        self._where.pop(request_id).release(request_id)
        del self._params[request_id], self._metrics[request_id]

    def keepalive(self) -> None:
        for engine in self.prefill + self.decode:
            engine.keepalive()

    @property
    def stats(self) -> EngineStats:
        return sum((e.stats for e in self.prefill + self.decode), EngineStats())

    # ---- moving requests along ----
    def _prefilled(self, engine: Any, out: RequestOutput) -> RequestOutput:
        request_id, params = out.request_id, self._params[out.request_id]
        metrics = self._metrics[request_id]
        metrics.first_token = metrics.first_token or time.perf_counter()
        if not out.finished:
            return replace(out, metrics=metrics)
        first = out.outputs[0]
        ends_here = first.finish_reason in (ABORT, ERROR, "stop") or params.max_tokens == 1
        if ends_here or out.kv_handoff is None:
            engine.release_kv(request_id)
            metrics.finished = time.perf_counter()
            return replace(out, metrics=metrics)
        decode = _least_busy(self.decode)
        try:
            decode.add_request(request_id, out.prompt_token_ids, params, out.prompt, out.kv_handoff)
        except ValueError as e:  # e.g. a prompt the decode side's cache cannot hold
            engine.release_kv(request_id)
            metrics.finished = time.perf_counter()
            done = replace(first, finish_reason=ERROR, error=f"the decode engine refused the request: {e}")
            return replace(out, outputs=[done], metrics=metrics)
        engine.release(request_id)
        self._where[request_id], self._from[request_id] = decode, engine
        # The first token, streamed now; the request goes on on the decode side.
        return replace(out, finished=False, outputs=[replace(first, finish_reason=None)], kv_handoff=None,
                       metrics=metrics)  # fmt: skip

    def _decoded(self, out: RequestOutput) -> RequestOutput:
        request_id = out.request_id
        source = self._from.pop(request_id, None)
        if source is not None:  # admitted, so the blocks were read (or the read failed): free them there
            source.release_kv(request_id)
        metrics = self._metrics[request_id]
        if out.finished:
            metrics.finished = time.perf_counter()
        return replace(out, metrics=metrics)


def _first_token_only(params: SamplingParams) -> SamplingParams:
    return params.model_copy(update={"max_tokens": 1, "min_tokens": 0})


def _least_busy(engines: list[Any]) -> Any:
    return min(engines, key=lambda e: e.stats.running + e.stats.waiting)


def _check_caches(prefill: list[CacheEndpoint], decode: list[CacheEndpoint]) -> None:
    problem = decode[0].compatible(prefill[0])
    if problem:
        raise ValueError(f"prefill/decode disaggregation: {problem}")
