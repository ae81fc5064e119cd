"""`launch serve` as clients use it: the official `openai` client against a running server on a 2-rank
layout (local backend, tp=2), compared with the offline LLM API; errors, the API key, streaming, a
client that disconnects, metrics (each call counted once), a quiet server outliving the collective
timeout, a stopped rank (SIGSTOP) failing requests on the server's clock, and a rank failure."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from serve_process import served
from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch.cluster.rendezvous import free_port
from moelaunch.launcher import LLM, SamplingParams

pytestmark = pytest.mark.slow

KEY = "test-key"
MODEL = "tiny-served"
COLLECTIVE_S = 10  # the server must keep its worker rank alive through longer quiet spells
STALL_S = 3  # server.stall_timeout_s: well inside COLLECTIVE_S, so a stopped rank is the stall's to report
PROMPTS = ["hello", "What is 2+2?", "abc", "the quick brown fox", "x", "tell me"]
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return add_byte_tokenizer(make_hf_model(tmp_path_factory.mktemp("serve"), "v3", num_hidden_layers=2))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    port = free_port()
    config = tmp_path_factory.mktemp("serve-config") / "serve.yaml"
    config.write_text(
        f"model: {checkpoint}\n"
        "parallel: {tp: 2}\n"
        "engine: {max_num_seqs: 4, max_model_len: 256, expert_load_window: 4}\n"
        "cluster: {backend: local, devices_per_node: 2, device: cpu, timeouts: {collective_s: %d}}\n"
        "server: {port: %d, api_key: %s, served_model_name: %s, max_queue: 3, max_body_bytes: 20000,"
        " log_interval_s: 1, strict: true, stall_timeout_s: %d}\n" % (COLLECTIVE_S, port, KEY, MODEL, STALL_S)
    )
    with served(config, port) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(checkpoint):
    """The same prompts through the offline API in one process: what the server must answer."""
    with LLM(str(checkpoint), kv_cache_memory=2_000_000, max_model_len=256) as llm:
        chats = llm.chat(
            [[{"role": "user", "content": p}] for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12)
        )
        texts = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    return [o.outputs[0].text for o in chats], [o.outputs[0].text for o in texts]


def metric(server, name: str) -> float:
    text = httpx.get(f"{server['url']}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    values = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} is not in /metrics"
    return sum(values)


def test_concurrent_greedy_answers_equal_the_offline_api(client, offline):
    chat_expected, text_expected = offline

    def chat(prompt: str) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=12
        )
        return reply.choices[0].message.content

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(chat, PROMPTS)) == chat_expected
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[:3], temperature=0, max_tokens=8)
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == text_expected[:3]


def test_metrics_show_the_routed_load(client, server):
    """engine.expert_load_window: the load over the last 4 steps, summed over both ranks, per layer and
    per EP rank (layer 1 is the tiny model's one MoE layer)."""
    client.completions.create(model=MODEL, prompt="count the experts", max_tokens=12, temperature=0)
    deadline = time.monotonic() + 20
    while not metric(server, "moelaunch_expert_load_window_tokens"):  # read every 4 steps, sent every second
        assert time.monotonic() < deadline, "the routed load never reached /metrics"
        time.sleep(0.5)
    text = httpx.get(f"{server['url']}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert re.search(r'^moelaunch_expert_load_imbalance\{layer="1"\} [1-9]', text, re.M)
    rows = dict(re.findall(r'^moelaunch_ep_rank_routed_rows\{ep_rank="(\d)"\} (\S+)$', text, re.M))
    assert set(rows) == {"0", "1"} and sum(map(float, rows.values())) > 0


def test_streaming_with_usage_gives_the_whole_answer(client, offline):
    chat_expected, _ = offline
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[1]}],
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_expected[1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])


def test_stop_strings_streamed_and_whole_agree(client, offline):
    _, text_expected = offline
    full = text_expected[3]
    stop = full[3:5]
    whole = client.completions.create(
        model=MODEL, prompt=PROMPTS[3], temperature=0, max_tokens=8, stop=[stop]
    )
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPTS[3], temperature=0, max_tokens=8, stop=[stop], stream=True
    )
    pieces = "".join(c.choices[0].text for c in streamed if c.choices)
    assert whole.choices[0].text == pieces == full[: full.find(stop)]
    assert whole.choices[0].finish_reason == "stop"


def test_seeded_samples_repeat_and_n_gives_n_choices(client):
    def ask() -> list[str]:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            temperature=1.0,
            seed=7,
            n=3,
            max_tokens=10,
        )
        assert [c.index for c in reply.choices] == [0, 1, 2]
        return [c.message.content for c in reply.choices]

    first = ask()
    assert ask() == first and len(set(first)) > 1


def test_logprobs_in_both_shapes(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    text = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, logprobs=3, temperature=0)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == text.usage.completion_tokens
    # Greedy: each chosen token is the most likely one.
    rows = list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True))
    assert all(top[token] == chosen == max(top.values()) for token, chosen, top in rows)


def test_models_and_token_id_prompts(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.completions.create(model=MODEL, prompt=[0, 104, 105], max_tokens=3, temperature=0)
    assert reply.usage.prompt_tokens == 3


@pytest.mark.parametrize(
    ("body", "status", "named"),
    [
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -1},
            400,
            "temperature",
        ),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": "2"}, 400, "n"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "frobnicate": 1},
            400,
            "frobnicate",
        ),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000}, 400, "256"),
        ({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "gpt-4"),
    ],
    ids=["range", "type", "unknown", "empty", "context", "model"],
)
def test_bad_requests_get_openai_errors(server, body, status, named):
    done = httpx.post(
        f"{server['url']}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert done.status_code == status
    error = done.json()["error"]
    assert named in error["message"] and error["code"] == status and error["type"]


def test_raw_protocol_errors(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    url = f"{server['url']}/v1/completions"
    assert httpx.post(url, content=b"{not json", headers=auth).status_code == 400
    assert httpx.post(url, content=b"x" * 30_000, headers=auth).status_code == 413
    out_of_vocab = httpx.post(url, json={"model": MODEL, "prompt": [1, 10**6]}, headers=auth)
    assert out_of_vocab.status_code == 400 and "vocabulary" in out_of_vocab.json()["error"]["message"]
    assert httpx.post(url, json={"model": MODEL, "prompt": "x"}).status_code == 401
    assert (
        httpx.get(f"{server['url']}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    )
    assert httpx.get(f"{server['url']}/health").status_code == 200  # no key needed


def test_a_full_queue_answers_429_and_the_server_recovers(server, client):
    # Capacity: max_num_seqs 4 x dp 1 + max_queue 3 = 7 outstanding requests.
    def long_request(_: int) -> int:
        body = {"model": MODEL, "prompt": "go", "max_tokens": 48, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        return httpx.post(
            f"{server['url']}/v1/completions", json=body, headers=headers, timeout=120
        ).status_code

    with ThreadPoolExecutor(10) as pool:
        statuses = list(pool.map(long_request, range(10)))
    assert statuses.count(200) >= 7 and 429 in statuses
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason


def test_a_client_that_disconnects_frees_its_blocks(server):
    tokens_before = metric(server, "moelaunch_generation_tokens_total")
    body = {"model": MODEL, "prompt": "go", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{server['url']}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))
    deadline = time.monotonic() + 20
    while metric(server, "moelaunch_kv_cache_usage_ratio") > 0 or metric(
        server, "moelaunch_num_requests_running"
    ):
        assert time.monotonic() < deadline, "the aborted request kept its KV blocks"
        time.sleep(0.3)
    assert metric(server, 'moelaunch_requests_total{status="aborted"}') >= 1
    assert metric(server, "moelaunch_generation_tokens_total") - tokens_before < 240  # stopped early


def settled_metrics(server, names: tuple[str, ...], timeout_s: float = 20) -> tuple[float, ...]:
    """The metrics once nothing moves them: an earlier test's aborted request is recorded after its
    client left, on the engine's next step."""
    deadline = time.monotonic() + timeout_s
    values = tuple(metric(server, n) for n in names)
    while True:
        time.sleep(0.5)
        again = tuple(metric(server, n) for n in names)
        if again == values and not metric(server, "moelaunch_num_requests_running"):
            return values
        assert time.monotonic() < deadline, "the server's metrics kept moving with no request in flight"
        values = again


def statuses(server) -> dict[str, float]:
    text = httpx.get(f"{server['url']}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    found = re.findall(r'^moelaunch_requests_total\{status="(\w+)"\} (\S+)$', text, re.M)
    return {status: float(value) for status, value in found}


def settled_statuses(server, timeout_s: float = 20) -> dict[str, float]:
    """The calls counted so far, once nothing moves them (a stream's end is counted as it closes)."""
    deadline = time.monotonic() + timeout_s
    values = statuses(server)
    while True:
        time.sleep(0.5)
        again = statuses(server)
        if again == values and not metric(server, "moelaunch_num_requests_running"):
            return values
        assert time.monotonic() < deadline, "the request counts kept moving with no request in flight"
        values = again


def counted_since(server, before: dict[str, float]) -> dict[str, float]:
    after = settled_statuses(server)
    return {s: after[s] - before.get(s, 0) for s in after if after[s] != before.get(s, 0)}


def test_every_call_is_counted_once_by_how_it_ended(server):
    """Refused calls were counted twice, and a refused stream as 400 and aborted. (A whole call whose
    client left, once aborted and 200: in the SIGSTOP test, where it cannot finish first.)"""
    before = settled_statuses(server)
    url, auth = f"{server['url']}/v1/completions", {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    bad_regex = {**body, "structured_outputs": {"regex": "("}}  # refused by the grammar compiler
    assert httpx.post(url, json=body, headers=auth, timeout=60).status_code == 200
    streamed = httpx.post(url, json={**body, "stream": True}, headers=auth, timeout=60)
    assert streamed.text.endswith("data: [DONE]\n\n")
    assert httpx.post(url, json=bad_regex, headers=auth, timeout=60).status_code == 400
    refused = httpx.post(url, json={**bad_regex, "stream": True}, headers=auth, timeout=60)
    assert refused.status_code == 400  # before the stream starts
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    # Seven sequences fill the server (max_num_seqs 4 + max_queue 3): the next call gets 429. The worker
    # rank is stopped meanwhile (for less than the stall timeout), so that they cannot finish first.
    hold = {**body, "prompt": ["go"] * 7, "stream": True}
    worker = worker_rank(server)
    worker.suspend()
    try:
        with httpx.stream("POST", url, json=hold, headers=auth, timeout=60) as response:
            assert response.status_code == 200  # the stream has started; its client leaves below
            assert httpx.post(url, json=body, headers=auth, timeout=60).status_code == 429
    finally:
        worker.resume()
    until_healthy(server)
    assert counted_since(server, before) == {"200": 2, "400": 2, "401": 1, "429": 1, "aborted": 1}


def test_metrics_move_as_requests_are_served(server, client):
    names = ("moelaunch_generation_tokens_total", "moelaunch_e2e_request_latency_seconds_count")
    before = settled_metrics(server, names)
    client.completions.create(
        model=MODEL, prompt="hello there", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = (
        metric(server, "moelaunch_generation_tokens_total"),
        metric(server, "moelaunch_e2e_request_latency_seconds_count"),
    )
    assert after[0] - before[0] == 5 and after[1] - before[1] == 1
    for name in (
        "moelaunch_time_to_first_token_seconds_count",
        "moelaunch_prompt_tokens_total",
        "moelaunch_prefix_cache_queries_total",
        "moelaunch_inter_token_latency_seconds_count",
    ):
        assert metric(server, name) > 0
    assert "serve: " in server["log"].read_text()  # the periodic throughput line


def test_a_quiet_server_outlives_the_collective_timeout(server, client):
    time.sleep(COLLECTIVE_S + 3)
    assert httpx.get(f"{server['url']}/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_the_readme_client_snippet_works_as_written(server):
    text = README.read_text()
    snippet = text[text.index("# pip install openai; against `launch serve`") :].split("```")[0]
    port = server["url"].rsplit(":", 1)[1]
    snippet = snippet.replace("http://127.0.0.1:8000/v1", f"http://127.0.0.1:{port}/v1")
    snippet = snippet.replace('api_key="none"', f'api_key="{KEY}"').replace(
        'model="small"', f'model="{MODEL}"'
    )
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_bench_serve_measures_the_server(server, tmp_path):
    out = tmp_path / "load.json"
    load = "--num-prompts 6 --input-len 8 --output-len 5 --max-concurrency 3 --request-rate 50".split()
    args = ["bench", "serve", "--url", server["url"], "--api-key", KEY, *load, "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "moelaunch.launcher.cli", *args], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["output_tokens"]) == (6, 0, 30)
    assert result["prompt_tokens"] == 6 * 8 and result["model"] == MODEL
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        spread = result[name]
        assert 0 < spread["median"] <= spread["p99"], name
    assert result["ttft_ms"]["mean"] < result["e2el_ms"]["mean"]
    assert "TTFT" in done.stdout and "request throughput" in done.stdout


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["--set", "server.api_key="], {}, "server.api_key: given an empty key"),
        ([], {"MOELAUNCH_API_KEY": ""}, "MOELAUNCH_API_KEY is set but empty"),
    ],
)
def test_an_empty_api_key_is_refused_before_the_model_loads(args, env, says):
    """An empty key once started a server without authentication, with one log line as the only sign."""
    done = subprocess.run(
        [sys.executable, "-m", "moelaunch.launcher.cli", "serve", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "serve: http" not in done.stderr


def until_healthy(server, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{server['url']}/health").status_code != 200:  # a stalled step completes
        assert time.monotonic() < deadline, "the server did not come back after SIGCONT"
        time.sleep(0.2)


def worker_rank(server):
    workers = [p for p in server["workers"] if "moelaunch.engine.worker" in " ".join(p.cmdline())]
    assert workers, "no worker rank found"
    return workers[0]


def first_event(response: httpx.Response) -> dict:
    return json.loads(next(line for line in response.iter_lines() if line.startswith("data:"))[5:])


def test_a_stopped_rank_fails_requests_on_the_servers_clock_and_serving_resumes(server, client):
    """SIGSTOP on the rank-1 worker once hung every request for the collective timeout (600 s by
    default). A step stalled for server.stall_timeout_s fails what waits on it (503, or an error event
    in a stream) and refuses new calls at once; after SIGCONT the server serves again. A whole call
    whose client gives up meanwhile is counted as aborted, once."""
    before = settled_statuses(server)
    url, auth = f"{server['url']}/v1/completions", {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    worker = worker_rank(server)
    worker.suspend()
    try:
        started = time.monotonic()  # the next step stalls from here
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url, json=body, headers=auth, timeout=1)
        with httpx.stream("POST", url, json={**body, "stream": True}, headers=auth, timeout=60) as response:
            error = first_event(response)["error"]
        took = time.monotonic() - started
        assert error["code"] == 503 and "stall_timeout_s" in error["message"], error
        assert "a rank is stopped or too slow" in error["message"]
        assert STALL_S <= took < STALL_S + 4, f"the stall was reported after {took:.1f} s"
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(**body)
        assert refused.value.status_code == 503 and time.monotonic() - started < 2  # at once
    finally:
        worker.resume()
    until_healthy(server)
    assert client.completions.create(**body).usage.completion_tokens >= 1
    assert counted_since(server, before) == {"503": 2, "200": 1, "aborted": 1}


def test_a_dead_rank_turns_the_server_unavailable(server, client):
    """Last: it breaks the server. The rank-1 worker is killed while the engine is busy; rank 0's next
    collective fails: the call in flight and new calls get 503, /health turns 503, and the gauges of
    what runs drop to 0 (they kept their last values)."""
    before = settled_statuses(server)
    url, auth = f"{server['url']}/v1/completions", {"Authorization": f"Bearer {KEY}"}
    load = {"model": MODEL, "prompt": ["go"] * 4, "max_tokens": 240, "ignore_eos": True}

    def keep_busy() -> int:  # back-to-back calls, until one fails
        while (status := httpx.post(url, json=load, headers=auth, timeout=60).status_code) == 200:
            pass
        return status

    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(keep_busy)
        deadline = time.monotonic() + 20
        while not metric(server, "moelaunch_num_requests_running"):
            assert time.monotonic() < deadline and not busy.done(), "the running gauge never moved"
            time.sleep(0.05)
        worker_rank(server).kill()
        assert busy.result(timeout=60) == 503
    with pytest.raises(openai.APIStatusError) as failed:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert failed.value.status_code == 503
    health = httpx.get(f"{server['url']}/health")
    assert health.status_code == 503 and json.loads(health.text)["status"] == "unavailable"
    assert metric(server, "moelaunch_num_requests_running") == 0
    assert metric(server, "moelaunch_kv_cache_usage_ratio") == 0
    counted = counted_since(server, before)
    assert counted["503"] == 2 and set(counted) <= {"200", "503"}, counted
