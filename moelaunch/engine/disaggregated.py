"""Prefill/decode disaggregation's router: one front door over prefill and decode engines.

A request first runs on a prefill engine with max_tokens=1: it computes the prompt's latents and the
first token, and keeps the prompt's cache blocks. Unless that token already ends the request, the
request moves to a decode engine with a KVHandoff; the decode engine reads the blocks it lacks
(engine/kv_peer.py) when it admits the request, then generates the rest. Once the decode side has
read them (its first output for the request), the prefill side releases the blocks.

Each prefill engine steps on its own thread (engine/prefill_worker.py), so a long prompt's prefill
runs beside the decode steps instead of between them.

It has the front-end methods of LLMEngine (add_request, step, abort, release...), so chat, batch and
serve jobs drive it unchanged. Engines are LLMEngines or proxies of them (the Ray backend).
"""

from __future__ import annotations

import queue
import time
from dataclasses import replace
from typing import Any

from moelaunch.engine.kv_handoff import CacheEndpoint
from moelaunch.engine.outputs import ABORT, ERROR, CompletionOutput, RequestMetrics, RequestOutput
from moelaunch.engine.prefill_worker import PrefillWorker
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.engine.stats import EngineStats

WAIT_S = 0.05  # nothing to decode: how long a step waits for a prefill to finish


class DisaggregatedEngine:
    def __init__(self, prefill: list[Any], decode: list[Any]) -> None:
        self.decode = decode
        self.config = decode[0].config
        self.max_model_len = min(e.max_model_len for e in prefill + decode)
        _check_caches(prefill[0].kv_endpoints, decode[0].kv_endpoints)
        self.transport = prefill[0].kv_endpoints[0].transport
        for engine in decode:  # while the prefill ranks are known to be up
            engine.connect_kv([e for p in prefill for e in p.kv_endpoints])
            engine.step()
        self._results: queue.Queue = queue.Queue()
        self.prefill = [PrefillWorker(e, i, self._results) for i, e in enumerate(prefill)]
        self._params: dict[str, SamplingParams] = {}
        self._metrics: dict[str, RequestMetrics] = {}
        self._where: dict[str, Any] = {}  # request -> the PrefillWorker or decode engine holding it now
        self._from: dict[str, PrefillWorker] = {}  # request -> the worker whose blocks it still needs
        self._unfinished: set[str] = set()

    # ---- front end ----
    def check_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """The decode side's checks (same model; a prompt too long for a prefill engine fails there)."""
        if params.n != 1:
            raise ValueError(
                f"request {request_id!r}: n={params.n} with prefill/decode disaggregation: give n=1 "
                "(send the request n times for several samples)"
            )
        if request_id in self._where:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.decode[0].check_request(request_id, prompt_ids, params)

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> None:
        self.check_request(request_id, prompt_ids, params)
        worker = min(self.prefill, key=lambda w: w.in_flight)
        first_only = _first_token_only(params)

        def add(engine: Any) -> list[RequestOutput] | None:
            try:
                engine.add_request(request_id, prompt_ids, first_only, prompt)
            except ValueError as e:  # this prefill engine's own limits: the request ends here
                error = CompletionOutput(0, "", [], ERROR, error=f"the prefill engine refused it: {e}")
                return [RequestOutput(request_id, prompt, prompt_ids, [error], finished=True)]
            return None

        worker.submit(add)
        worker.in_flight += 1
        self._params[request_id] = params
        self._metrics[request_id] = RequestMetrics(time.perf_counter())
        self._where[request_id] = worker
        self._unfinished.add(request_id)

    def step(self) -> list[RequestOutput]:
        """Hand on what the prefill workers finished, then one step of each busy decode engine. With
        nothing to decode, waits (briefly) for a prefill instead of spinning."""
        outputs = []
        for worker, prefilled in self._finished_prefills(wait=not self._decoding()):
            outputs += [self._prefilled(worker, out) for out in prefilled]
        for engine in self.decode:
            if engine.has_unfinished():
                outputs += [self._decoded(out) for out in engine.step()]
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def abort(self, request_id: str) -> None:
        holder = self._where.get(request_id)
        if isinstance(holder, PrefillWorker):
            holder.submit(lambda engine: engine.abort(request_id))
        elif holder is not None:
            holder.abort(request_id)

    def release(self, request_id: str) -> None:
        holder = self._where.pop(request_id)
        if isinstance(holder, PrefillWorker):
            holder.submit(lambda engine: engine.release(request_id))
        else:
            holder.release(request_id)
        del self._params[request_id], self._metrics[request_id]

    def keepalive(self) -> None:
        for worker in self.prefill:
            worker.submit(lambda engine: engine.keepalive())
        for engine in self.decode:
            engine.keepalive()

    @property
    def stats(self) -> EngineStats:
        """The decode engines' figures (a prefill engine's would wait for its step to end)."""
        return sum((e.stats for e in self.decode), EngineStats())

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the prefill workers' threads (after their current step)."""
        for worker in self.prefill:
            worker.close(timeout_s)

    # ---- moving requests along ----
    def _decoding(self) -> bool:
        return any(not isinstance(holder, PrefillWorker) for holder in self._where.values())

    def _finished_prefills(self, wait: bool) -> list[tuple[PrefillWorker, list[RequestOutput]]]:
        found = []
        try:
            waiting = wait and self._unfinished
            item = self._results.get(timeout=WAIT_S) if waiting else self._results.get_nowait()
            while True:
                worker, outputs = item
                if isinstance(outputs, BaseException):
                    raise outputs
                found.append((worker, outputs))
                item = self._results.get_nowait()
        except queue.Empty:
            return found

    def _prefilled(self, worker: PrefillWorker, out: RequestOutput) -> RequestOutput:
        request_id, params = out.request_id, self._params[out.request_id]
        metrics = self._metrics[request_id]
        metrics.first_token = metrics.first_token or time.perf_counter()
        if not out.finished:
            return replace(out, metrics=metrics)
        worker.in_flight -= 1
        first = out.outputs[0]
        last_position = len(out.prompt_token_ids) + 1 >= self.max_model_len
        ends_here = first.finish_reason in (ABORT, ERROR, "stop") or params.max_tokens == 1 or last_position
        if ends_here or out.kv_handoff is None:
            worker.submit(lambda engine: engine.release_kv(request_id))
            return self._ended(replace(out, metrics=metrics))
        decode = min(self.decode, key=lambda e: e.stats.running + e.stats.waiting)
        try:
            decode.add_request(request_id, out.prompt_token_ids, params, out.prompt, out.kv_handoff)
        except ValueError as e:  # e.g. a prompt the decode side's cache cannot hold
            worker.submit(lambda engine: engine.release_kv(request_id))
            done = replace(first, finish_reason=ERROR, error=f"the decode engine refused the request: {e}")
            return self._ended(replace(out, outputs=[done], metrics=metrics))
        worker.submit(lambda engine: engine.release(request_id))
        self._where[request_id], self._from[request_id] = decode, worker
        # The first token, streamed now; the request goes on on the decode side.
        return replace(out, finished=False, outputs=[replace(first, finish_reason=None)], kv_handoff=None,
                       metrics=metrics)  # fmt: skip

    def _decoded(self, out: RequestOutput) -> RequestOutput:
        request_id = out.request_id
        source = self._from.pop(request_id, None)
        if source is not None:  # admitted, so the blocks were read (or the read failed): free them there
            source.submit(lambda engine: engine.release_kv(request_id))
        out = replace(out, metrics=self._metrics[request_id])
        return self._ended(out) if out.finished else out

    def _ended(self, out: RequestOutput) -> RequestOutput:
        out.metrics.finished = time.perf_counter()
        self._unfinished.discard(out.request_id)
        return out


def _first_token_only(params: SamplingParams) -> SamplingParams:
    return params.model_copy(update={"max_tokens": 1, "min_tokens": 0})


def _least_busy(engines: list[Any]) -> Any:
    return min(engines, key=lambda e: e.stats.running + e.stats.waiting)


def _check_caches(prefill: list[CacheEndpoint], decode: list[CacheEndpoint]) -> None:
    problem = decode[0].compatible(prefill[0])
    if problem:
        raise ValueError(f"prefill/decode disaggregation: {problem}")
