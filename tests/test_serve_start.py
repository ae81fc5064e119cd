"""The server's address is checked before the model loads: a port in use, a host this machine does not
have, or a name it cannot resolve is one line naming the setting and the fix. And what the README says
of a running server: the API key from the environment, the preemption and MTP metrics."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serve_process import served

from moelaunch.cluster.rendezvous import free_port


@pytest.fixture
def taken_port():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


@pytest.mark.parametrize(
    "host, says",
    [
        ("127.0.0.1", "is in use (another server?)"),
        ("10.254.254.254", "server.host '10.254.254.254' is not an address of this machine"),
        ("no-such-host.invalid", "not an address or a name this machine can resolve"),
    ],
)
def test_an_address_the_server_cannot_take_is_refused_before_the_model_loads(taken_port, host, says):
    args = ["--set", f"server.host={host}", "--set", f"server.port={taken_port}"]
    done = subprocess.run(
        [sys.executable, "-m", "moelaunch.launcher.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and says in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "serve: http" not in done.stderr


BUNDLED = Path(__file__).resolve().parents[1] / "checkpoints/small"


def metric(text: str, name: str) -> float:
    """A sample's value from the Prometheus text format."""
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


def test_the_readme_claims_about_the_server_hold(tmp_path, monkeypatch):
    """MOELAUNCH_API_KEY protects every route but /health; /metrics counts preemptions and MTP acceptance
    (a cache too small for the batch forces the first, the bundled model's MTP layer drafts the second)."""
    monkeypatch.setenv("MOELAUNCH_API_KEY", "s3cret")
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model: {BUNDLED}\nserver: {{port: {port}}}\njob: {{mode: serve}}\n"
        # ~30 blocks of 4 tokens: 8 requests of ~40 tokens cannot all be resident at once
        "engine: {speculative: mtp, block_size: 4, kv_cache_memory: 250000, max_num_seqs: 8, "
        "max_model_len: 128}\n"
    )
    with served(config, port) as server:
        url = server["url"]
        assert httpx.get(f"{url}/health").status_code == 200
        body = {"model": "small", "prompt": "What is 12+34?", "max_tokens": 24, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        key = {"Authorization": "Bearer s3cret"}
        # One call: its 8 prompts enter the engine together (separate calls may arrive spread out and
        # never fill the cache), and each runs its 24 tokens.
        prompts = [f"What is {i}+{i}?" for i in range(8)]
        batch = {**body, "prompt": prompts, "ignore_eos": True}
        answer = httpx.post(f"{url}/v1/completions", json=batch, headers=key, timeout=120)
        assert answer.status_code == 200, answer.text
        assert [c["finish_reason"] for c in answer.json()["choices"]] == ["length"] * 8
        metrics = httpx.get(f"{url}/metrics", headers=key).text
    assert metric(metrics, "moelaunch_num_preemptions_total") > 0
    assert 0 < metric(metrics, "moelaunch_spec_decode_acceptance_rate") <= 1
    assert metric(metrics, "moelaunch_spec_decode_accepted_tokens_total") > 0
