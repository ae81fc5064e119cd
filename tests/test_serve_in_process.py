"""The server's engine loop and app on the bundled model's real engine, in process: clients take turns
at the engine's free slots, a request dropped before it reached the engine frees its place in the
queue, and a bug in a handler is one 500 in OpenAI's shape, counted once in /metrics."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient

from moelaunch.engine.drive import Request
from moelaunch.launcher import LLM, SamplingParams
from moelaunch.launcher.serve import handlers
from moelaunch.launcher.serve.app import build_app
from moelaunch.launcher.serve.engine_loop import EngineLoop, OutputStream, Progress, QueueFull
from moelaunch.launcher.serve.handlers import ServerState
from moelaunch.launcher.serve.metrics import ServeMetrics
from moelaunch.measure.scoring import DEFAULT_CHECKPOINT

ROOM = 4  # the engine's running batch: max_num_seqs x dp
BIG = SamplingParams(n=16, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True)
CHAT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
FOUR = SamplingParams(n=4, temperature=1.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM(str(DEFAULT_CHECKPOINT), max_num_seqs=ROOM) as llm:
        yield llm


def serving(llm, max_queue: int, finished: list[str]) -> EngineLoop:
    def on_progress(progress: Progress) -> None:
        if progress.finished:
            finished.append(progress.request_id)

    loop = EngineLoop(
        llm.engine, ROOM, max_queue, keepalive_s=60, stall_timeout_s=60, on_progress=on_progress
    )
    loop.start()
    return loop


async def until_finished(stream: OutputStream, count: int) -> None:
    while count:
        count -= (await stream.get()).finished


def test_a_later_client_gets_the_next_free_slot_not_the_end_of_the_queue(llm):
    """One client's 8 prompts x n=16 (128 sequences against a batch of 4), then another client's
    one-prompt chat: the chat enters when the first big request leaves, not after all eight."""
    prompt = llm.tokenizer.encode("hello")
    finished: list[str] = []
    loop = serving(llm, max_queue=200, finished=finished)

    async def scenario() -> None:
        events = asyncio.get_running_loop()
        big, chat = OutputStream(events, loop.check_alive), OutputStream(events, loop.check_alive)
        loop.submit([Request(f"big-{i}", prompt, BIG) for i in range(8)], big, client="batch")
        loop.submit([Request("chat", prompt, CHAT)], chat, client="chat")
        await asyncio.gather(until_finished(big, 8), until_finished(chat, 1))

    try:
        asyncio.run(scenario())
    finally:
        loop.stop(30)
    assert sorted(finished) == sorted(["chat", *(f"big-{i}" for i in range(8))])
    big_before_chat = finished.index("chat")
    # First come, first served would finish all eight first; one turn each finishes at most two.
    assert big_before_chat <= 2, finished


def test_a_request_aborted_before_it_reached_the_engine_frees_its_place(llm):
    prompt = llm.tokenizer.encode("hello")
    finished: list[str] = []
    loop = serving(llm, max_queue=16, finished=finished)  # capacity: 20 sequences

    async def scenario() -> None:
        events = asyncio.get_running_loop()
        first, second, third = (OutputStream(events, loop.check_alive) for _ in range(3))
        loop.submit([Request("running", prompt, BIG)], first, client="a")  # 16 of 20
        loop.submit([Request("dropped", prompt, FOUR)], second, client="b")  # 20 of 20
        with pytest.raises(QueueFull, match="20 sequences outstanding"):
            loop.submit([Request("refused", prompt, CHAT)], third, client="c")
        loop.abort("dropped")  # its client went away while it waited
        deadline = time.monotonic() + 10
        while True:  # the engine thread takes the abort between two steps
            try:
                loop.submit([Request("after", prompt, CHAT)], third, client="c")
                break
            except QueueFull:
                assert time.monotonic() < deadline, "the dropped request kept its place"
                await asyncio.sleep(0.05)
        await asyncio.gather(until_finished(first, 1), until_finished(third, 1))

    try:
        asyncio.run(scenario())
    finally:
        loop.stop(30)
    assert sorted(finished) == ["after", "running"]  # "dropped" never ran


@contextmanager
def app(llm) -> Iterator[TestClient]:
    metrics = ServeMetrics()
    loop = EngineLoop(llm.engine, ROOM, 16, 60, 60, metrics.progress, metrics.engine_stats)
    vocab = llm.engine.model.args.vocab_size
    state = ServerState(loop, llm.tokenizer, "small", llm.engine.max_model_len, metrics, None, 2**20, vocab)
    loop.start()
    try:
        with TestClient(build_app(state), raise_server_exceptions=False) as client:
            yield client
    finally:
        loop.stop(30)


def test_a_bug_is_one_500_in_openais_shape_counted_once(llm, monkeypatch):
    """500s were never counted; a bug mid-stream must not be counted twice (the stream and the app)."""

    def bug(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(handlers, "_choice", bug)
    body = {"model": "small", "prompt": "hi", "max_tokens": 3}
    with app(llm) as client:
        whole = client.post("/v1/completions", json=body)
        assert whole.status_code == 500, whole.text
        error = whole.json()["error"]
        assert (
            error["type"] == "server_error"
            and "RuntimeError" in error["message"]
            and "a bug" not in error["message"]
        )
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
            assert streamed.status_code == 200
            assert "[DONE]" not in "".join(streamed.iter_lines())
        text = client.get("/metrics").text
    counted = dict(re.findall(r'^moelaunch_requests_total\{status="(\w+)"\} (\S+)$', text, re.M))
    assert counted == {"500": "2.0"}
