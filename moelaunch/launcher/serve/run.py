"""The serve job: the engine loop, the HTTP app, and uvicorn on rank 0 until Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path

import uvicorn

from moelaunch.engine.progress_log import ProgressLog
from moelaunch.engine.stats import EngineStats
from moelaunch.engine.warm_up import warm_up_decode
from moelaunch.launcher.deploy.config import API_KEY_ENV, DeployConfig
from moelaunch.launcher.serve.app import build_app
from moelaunch.launcher.serve.engine_loop import EngineLoop, Progress
from moelaunch.launcher.serve.handlers import ServerState
from moelaunch.launcher.serve.metrics import ServeMetrics
from moelaunch.model.config import load_args

STOP_TIMEOUT_S = 30.0


def run_serve(client, cfg: DeployConfig, sock: socket.socket) -> int:
    """Serve `client` (an LLM or the Ray client) as cfg.server describes, on `sock` (bound before the
    model loaded: serve/listen.py)."""
    s = cfg.server
    metrics = ServeMetrics()
    log = ProgressLog("serve", s.log_interval_s)

    def on_progress(progress: Progress) -> None:
        log.count(metrics.progress(progress), int(progress.finished))

    def on_stats(stats: EngineStats) -> None:
        metrics.engine_stats(stats)
        if engine.config.load_window:
            metrics.expert_load(engine.expert_load)
        log.maybe_write(lambda: stats)

    engine = client.engine
    room = client.capacity
    # A third of the collective timeout: the other ranks wait for rank 0's next command that long.
    keepalive_s = cfg.cluster.timeouts.collective_s / 3
    loop = EngineLoop(engine, room, s.max_queue, keepalive_s, s.stall_timeout_s, on_progress, on_stats)
    state = ServerState(
        engine_loop=loop,
        tokenizer=client.tokenizer,
        model_name=s.served_model_name or Path(cfg.model).name,
        max_model_len=engine.max_model_len,
        metrics=metrics,
        api_key=s.api_key_in_effect(),
        max_body_bytes=s.max_body_bytes,
        vocab_size=load_args(cfg.model).vocab_size,
        strict=s.strict,
        # Either section's switch: the engine's is what batch jobs and LLM.chat read in the same file.
        special_tokens_in_content=s.allow_special_tokens_in_content
        or cfg.engine.allow_special_tokens_in_content,
    )
    if cfg.engine.compile == "on":
        print(
            "serve: compiling the decode step for every batch size (engine.compile: on)...", file=sys.stderr
        )
        sizes, seconds = warm_up_decode(engine, cfg.engine, cfg.parallel.dp)
        print(f"serve: decode step compiled for batch sizes {sizes} in {seconds:.0f} s", file=sys.stderr)
    host, port = sock.getsockname()[:2]
    loop.start()
    key_note = "API key required" if state.api_key else f"no API key (set server.api_key or {API_KEY_ENV})"
    print(
        f"serve: http://{host}:{port}/v1 serving {state.model_name!r}; {key_note}",
        file=sys.stderr,
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", lifespan="off"))
    # uvicorn shuts down gracefully on SIGINT or SIGTERM, then raises the signal again; both end here
    # as KeyboardInterrupt, so the ranks are released and stopped by the caller either way.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        loop.stop(STOP_TIMEOUT_S)
    print("serve: stopped", file=sys.stderr, flush=True)
    return 1 if loop.failure is not None else 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
