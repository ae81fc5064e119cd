"""The server's Prometheus metrics (GET /metrics), in vLLM's spirit with a `moelaunch_` prefix.

Latencies are measured on the server's clock, from the moment a request is accepted to the moment its
tokens leave the engine thread, which is what a client sees minus the network. Engine-side figures
(running and waiting sequences, KV cache use, prefix hits, preemptions, MTP acceptance) come from the
engine's own stats, summed over its DP replicas.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from moelaunch.engine.routed_load import LoadReport
from moelaunch.engine.stats import EngineStats
from moelaunch.launcher.serve.engine_loop import Progress

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)  # fmt: skip


class _Timing:
    """One request's clock: when it was accepted, when its last token came, tokens so far per choice."""

    def __init__(self, accepted: float) -> None:
        self.accepted = accepted
        self.first: float | None = None
        self.last = accepted
        self.tokens: dict[int, int] = {}


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        counter, gauge, histogram = self._counter, self._gauge, self._histogram
        self.requests = Counter(
            "moelaunch_requests",
            "calls to the completion routes, each counted once by how it ended",
            ["status"],
            registry=self.registry,
        )
        self.ttft = histogram("time_to_first_token_seconds", "acceptance to first token")
        self.tpot = histogram("time_per_output_token_seconds", "(last token - first token) / (tokens - 1)")
        self.itl = histogram("inter_token_latency_seconds", "gap before each token after the first")
        self.e2e = histogram("e2e_request_latency_seconds", "acceptance to finish")
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens of accepted requests")
        self.generation_tokens = counter("generation_tokens", "tokens generated")
        self.running = gauge("num_requests_running", "sequences in the running batches")
        self.waiting = gauge("num_requests_waiting", "sequences waiting for room")
        self.kv_usage = gauge("kv_cache_usage_ratio", "share of KV cache blocks in use")
        self.prefix_queries = counter("prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "prompt tokens found in the prefix cache")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "hits / queries since start")
        self.preemptions = counter("num_preemptions", "sequences preempted for room")
        self.spec_drafted = counter("spec_decode_draft_tokens", "MTP draft tokens verified")
        self.spec_accepted = counter("spec_decode_accepted_tokens", "MTP draft tokens kept")
        self.spec_acceptance = gauge("spec_decode_acceptance_rate", "accepted / drafted since start")
        # Routed load over the engine's window (engine.expert_load_window or eplb): per layer and per
        # EP rank, not per expert (58 layers x 256 experts would be 15K series).
        self.expert_imbalance = Gauge(
            "moelaunch_expert_load_imbalance",
            "max/mean tokens per routed expert over the window (1.0 is even)",
            ["layer"],
            registry=self.registry,
        )
        self.ep_imbalance = Gauge(
            "moelaunch_ep_rank_load_imbalance",
            "max/mean routed rows per EP rank over the window, under the layer's placement (1.0 is even)",
            ["layer"],
            registry=self.registry,
        )
        self.ep_rows = Gauge(
            "moelaunch_ep_rank_routed_rows",
            "routed (token, expert) rows each EP rank ran over the window, all MoE layers",
            ["ep_rank"],
            registry=self.registry,
        )
        self.load_tokens = gauge("expert_load_window_tokens", "tokens routed in the window")
        self.rebalances = gauge("eplb_rebalances", "expert placements applied since the start")
        self._load_steps = -1
        self._timings: dict[str, _Timing] = {}
        self._lock = threading.Lock()
        self._last_stats = EngineStats()

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(f"moelaunch_{name}", doc, registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"moelaunch_{name}", doc, registry=self.registry)

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(f"moelaunch_{name}", doc, buckets=LATENCY_BUCKETS, registry=self.registry)

    def accepted(self, request_ids: list[str]) -> None:
        now = time.perf_counter()
        with self._lock:
            for rid in request_ids:
                self._timings[rid] = _Timing(now)

    def forget(self, request_ids: list[str]) -> None:
        """Requests accepted here but refused by the engine loop (queue full, engine failed)."""
        with self._lock:
            for rid in request_ids:
                self._timings.pop(rid, None)

    def progress(self, p: Progress) -> int:
        """Called on the engine thread with every snapshot; returns the tokens it brought."""
        now = time.perf_counter()
        with self._lock:
            t = self._timings.get(p.request_id)
            if p.finished:
                self._timings.pop(p.request_id, None)
        if t is None:
            return 0
        arrived = {c.index: len(c.token_ids) - t.tokens.get(c.index, 0) for c in p.choices}
        for c in p.choices:
            t.tokens[c.index] = len(c.token_ids)
        if sum(arrived.values()):
            self.generation_tokens.inc(sum(arrived.values()))
            first = t.first is None
            if first:
                t.first = now
                self.ttft.observe(now - t.accepted)
            for new in arrived.values():
                # Tokens of one step (a kept MTP draft and the next) share the step's gap; the first
                # step's extra tokens came with the first token.
                gap = 0.0 if first else (now - t.last) / max(new, 1)
                for _ in range(new - 1 if first else new):
                    self.itl.observe(gap)
            t.last = now
        if p.finished:
            self.e2e.observe(now - t.accepted)
            produced = max(t.tokens.values(), default=0)
            if t.first is not None and produced > 1:
                self.tpot.observe((t.last - t.first) / (produced - 1))
        return sum(arrived.values())

    def engine_stats(self, s: EngineStats) -> None:
        """The engine's cumulative stats: gauges set, counters advanced by what changed."""
        before, self._last_stats = self._last_stats, s
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.kv_usage.set(s.kv_usage)
        self.prefix_queries.inc(max(s.prompt_tokens_admitted - before.prompt_tokens_admitted, 0))
        self.prefix_hits.inc(max(s.prefix_hit_tokens - before.prefix_hit_tokens, 0))
        self.prefix_hit_rate.set(s.prefix_hit_rate)
        self.preemptions.inc(max(s.preemptions - before.preemptions, 0))
        self.spec_drafted.inc(max(s.spec_drafted - before.spec_drafted, 0))
        self.spec_accepted.inc(max(s.spec_accepted - before.spec_accepted, 0))
        if s.spec_acceptance is not None:
            self.spec_acceptance.set(s.spec_acceptance)

    def expert_load(self, report: LoadReport | None) -> None:
        """The engine's last routed-load read (every window steps); gauges set when it is a new one."""
        if report is None or report.steps == self._load_steps:
            return
        self._load_steps = report.steps
        w = report.window
        for layer, ratio in report.expert_imbalance(w).items():
            self.expert_imbalance.labels(layer=str(layer)).set(ratio)
        for layer, ratio in report.rank_imbalance(w).items():
            self.ep_imbalance.labels(layer=str(layer)).set(ratio)
        for rank, rows in enumerate(report.rank_rows(w)):
            self.ep_rows.labels(ep_rank=str(rank)).set(rows)
        self.load_tokens.set(report.tokens(w))
        self.rebalances.set(report.rebalances)
