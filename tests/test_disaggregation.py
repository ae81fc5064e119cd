"""Prefill/decode disaggregation: greedy tokens equal one engine's, only the missing prompt rows move
(by the formula), a prefix already on the decode side is not sent, and a prefill rank that dies or
hangs before the read fails the request cleanly and frees what the decode side reserved.

Engines here are one-rank parts in this process (the local backend's disaggregation); the Ray test
(tests/test_ray_backend.py) covers prefill tp=2 -> decode dp=2 through `launch`. Mooncake's transfer
engine moves the bytes over TCP on loopback in both."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch.cluster.rendezvous import free_port
from moelaunch.engine import kv_transport
from moelaunch.engine.build import EngineSpec, build_engine
from moelaunch.engine.config import EngineConfig
from moelaunch.engine.disaggregated import DisaggregatedEngine
from moelaunch.engine.drive import Request, drive
from moelaunch.engine.kv_handoff import KVHandoff
from moelaunch.engine.kv_transport import transport_available
from moelaunch.launcher import LLM, SamplingParams
from moelaunch.launcher.deploy.config import load_deploy_config
from moelaunch.launcher.jobs.run import run_deployment
from moelaunch.model.config import load_args
from moelaunch.model.kv_cache import PagedLatentCache
from moelaunch.model.weight_spec import WeightSpec

pytestmark = pytest.mark.skipif(
    transport_available() is not None,
    reason=f"{transport_available()} (CI installs both: tests/mooncake_setup.sh)",
)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[0, 5, 6, 7, 8, 9], [0] + [3] * 11, [0, 9, 10], [0, 5, 6, 7, 8, 9, 11, 12], [0, 44] * 9]
BLOCK = 4
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(add_byte_tokenizer(make_hf_model(tmp_path_factory.mktemp("tiny"), "v3", num_hidden_layers=4)))


def engine_config(**options) -> EngineConfig:
    return EngineConfig(kv_cache_memory=4_000_000, block_size=BLOCK, **options)


# Mooncake reads its transfer timeout once per process, from the first engine: a hung peer's read here
# fails after about this long (plus its own slack of ~2 s).
TIMEOUT_S = 3.0


def part(checkpoint: str, role: str, timeout_s: float = TIMEOUT_S, **options):
    spec = EngineSpec(
        WeightSpec(checkpoint), engine=engine_config(**options), timeout_s=timeout_s, kv_role=role
    )
    return build_engine(spec)


def run(engine, prompts, params=GREEDY) -> dict[str, list[int]]:
    done = {}
    for outputs in drive(engine, [Request(str(i), p, params) for i, p in enumerate(prompts)]):
        done.update({o.request_id: o for o in outputs if o.finished})
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def one_engine(checkpoint: str, prompts, params=GREEDY, **options) -> list[list[int]]:
    with LLM(checkpoint, **engine_config(**options).model_dump(exclude_defaults=True)) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def row_bytes(checkpoint: str, fp8: bool) -> int:
    """What one prompt token's latents cost over every layer, from the cache layout's own formula."""
    args = load_args(checkpoint)
    return PagedLatentCache.bytes_per_token(args, args.num_hidden_layers, torch.float32, fp8)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_disaggregated_tokens_equal_one_engine_and_only_prompt_rows_move(
    checkpoint, kv_cache_dtype, monkeypatch
):
    monkeypatch.setattr(kv_transport, "MAX_BATCH", 7)  # a prompt's reads go in several batches
    prefill = part(checkpoint, "prefill", kv_cache_dtype=kv_cache_dtype)
    decode = part(checkpoint, "decode", kv_cache_dtype=kv_cache_dtype)
    router = DisaggregatedEngine([prefill], [decode])
    assert router.transport == "mooncake-tcp"
    assert run(router, PROMPTS) == one_engine(checkpoint, PROMPTS, kv_cache_dtype=kv_cache_dtype)
    prompt_tokens = sum(len(p) for p in PROMPTS)
    assert decode.stats.kv_bytes_received == prompt_tokens * row_bytes(checkpoint, kv_cache_dtype == "fp8")
    # Everything handed off was released on the prefill side, and the decode side holds nothing live.
    router.close()  # the prefill thread applies its last releases and stops: its engine can be read
    assert prefill.held == {} and prefill.blocks.num_free == prefill.blocks.num_blocks
    assert decode.blocks.num_free == decode.blocks.num_blocks


def test_a_seeded_sampled_request_draws_one_engines_tokens(checkpoint):
    """Draws are keyed on (seed, position): the decode side continues the prefill side's first token
    with the draws one engine makes."""
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8, ignore_eos=True, seed=21)
    router = DisaggregatedEngine([part(checkpoint, "prefill")], [part(checkpoint, "decode")])
    try:
        got = run(router, PROMPTS, seeded)
    finally:
        router.close()
    assert got == one_engine(checkpoint, PROMPTS, seeded)
    assert got != one_engine(checkpoint, PROMPTS)  # it sampled


def test_a_prefix_the_decode_side_holds_is_not_sent_again(checkpoint):
    prefill, decode = part(checkpoint, "prefill"), part(checkpoint, "decode")
    router = DisaggregatedEngine([prefill], [decode])
    shared = [0] + list(range(20, 31))  # 12 tokens: 3 full blocks
    first, second = shared + [40, 41], shared + [50]
    assert run(router, [first]) == one_engine(checkpoint, [first])
    sent = decode.stats.kv_bytes_received
    assert sent == len(first) * row_bytes(checkpoint, False)
    assert run(router, [second]) == one_engine(checkpoint, [second])
    # Only the rows past the shared full blocks moved: the one token after them.
    assert decode.stats.kv_bytes_received - sent == (len(second) - len(shared)) * row_bytes(checkpoint, False)
    assert decode.stats.prefix_hit_tokens == len(shared)


def test_a_request_ending_at_its_first_token_never_reaches_the_decode_side(checkpoint):
    prefill, decode = part(checkpoint, "prefill"), part(checkpoint, "decode")
    router = DisaggregatedEngine([prefill], [decode])
    one = SamplingParams(temperature=0, max_tokens=1)
    [tokens] = run(router, [PROMPTS[0]], one)
    assert len(tokens) == 1 and decode.stats.prompt_tokens_admitted == 0
    with pytest.raises(ValueError, match="n=1"):
        router.add_request("x", PROMPTS[0], SamplingParams(n=2))
    router.close()
    assert prefill.held == {}


def _prefill_then_wait(checkpoint: str, prompt: list[int], conn) -> None:
    """A prefill engine in its own process: hands off one prompt, then waits to be killed or stopped."""
    engine = part(checkpoint, "prefill")
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                conn.send(out.kv_handoff.to_dict())
    conn.recv()  # never answered: the parent ends this process


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_prefill_rank_lost_before_the_read_fails_the_request_and_frees_its_blocks(checkpoint, fault):
    decode = part(checkpoint, "decode")
    prompt = PROMPTS[4]
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    prefill = context.Process(target=_prefill_then_wait, args=(checkpoint, prompt, child))
    prefill.start()
    try:
        assert parent.poll(120), "the prefill process handed nothing off"
        handoff = KVHandoff.from_dict(parent.recv())
        decode.connect_kv(handoff.endpoints)  # as the router does when it starts
        decode.step()
        os.kill(prefill.pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        decode.add_request("r", prompt, GREEDY, None, handoff)
        started = time.monotonic()
        [out] = [o for step in drive(decode) for o in step]
        waited = time.monotonic() - started
    finally:
        prefill.kill()
        prefill.join()
    completion = out.outputs[0]
    assert completion.finish_reason == "error"
    assert "failed: the prefill rank there died, hung past" in completion.error
    assert waited < TIMEOUT_S + 5, f"the failed read took {waited:.1f} s, the timeout is {TIMEOUT_S} s"
    assert decode.blocks.num_free == decode.blocks.num_blocks  # what the read reserved is free again
    # The engine goes on: the same prompt, prefilled by a live prefill engine, decodes as one engine does.
    router = DisaggregatedEngine([part(checkpoint, "prefill")], [decode])
    assert run(router, [prompt]) == one_engine(checkpoint, [prompt])


def test_the_example_deployment_chats_through_a_prefill_and_a_decode_part(tmp_path):
    """configs/examples/disaggregated-local.yaml as a user runs it (piped turns), on the bundled model."""
    example = REPO / "configs" / "examples" / "disaggregated-local.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "moelaunch.launcher.cli", str(example)],
        input="What is 123+456?\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "disaggregation: KV moves over mooncake-tcp" in done.stderr
    assert done.stdout.splitlines()[-1] == "579"


def test_without_the_transfer_library_the_deployment_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # as if not installed: import fails
    cfg = load_deploy_config(REPO / "configs" / "examples" / "disaggregated-local.yaml")
    with pytest.raises(ValueError, match=r"pip install mooncake-transfer-engine-non-cuda.*libibverbs1"):
        run_deployment(cfg)


def test_handed_off_blocks_nobody_reads_are_freed_after_the_timeout(checkpoint):
    """A decode side that dies before reading: the prefill engine frees the blocks after timeout_s."""
    prefill = part(checkpoint, "prefill")
    prefill.add_request("r", PROMPTS[4], SamplingParams(temperature=0, max_tokens=1))
    [out] = [o for step in drive(prefill) for o in step if o.finished]
    assert out.kv_handoff.block_ids == prefill.held["r"]
    assert prefill.blocks.num_free < prefill.blocks.num_blocks
    time.sleep(TIMEOUT_S + 0.2)
    assert prefill.has_unfinished()  # a step is due: it gives the blocks back
    prefill.step()
    assert prefill.held == {} and prefill.blocks.num_free == prefill.blocks.num_blocks


def test_a_disaggregated_server_answers_whole_and_streamed(tmp_path):
    """`launch serve` on the example deployment: the openai client's whole and streamed answers agree
    (the first token comes from the prefill part, the rest from the decode part)."""
    import openai
    from serve_process import served

    port = free_port()
    config = tmp_path / "serve.yaml"
    example = (REPO / "configs" / "examples" / "disaggregated-local.yaml").read_text()
    model = REPO / "checkpoints" / "small"
    text = example.replace("../../checkpoints/small", str(model)).replace("mode: chat", "mode: serve")
    config.write_text(text + f"server: {{port: {port}}}\n")
    with served(config, port) as server:
        client = openai.OpenAI(base_url=f"{server['url']}/v1", api_key="none")
        ask = {"model": client.models.list().data[0].id, "temperature": 0, "max_tokens": 64,
               "messages": [{"role": "user", "content": "What is 123+456?"}]}  # fmt: skip
        whole = client.chat.completions.create(**ask).choices[0].message.content
        pieces = [
            c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True)
        ]
    assert whole == "579" and "".join(pieces) == whole
