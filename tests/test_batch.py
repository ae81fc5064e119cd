"""`launch batch`: results equal the Python API's, bad lines are reported by number, and a job killed
with SIGKILL resumes to every id exactly once with the results of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch.launcher import LLM, SamplingParams
from moelaunch.launcher.cli import main
from moelaunch.launcher.jobs.batch import default_seed

KV = "4000000"
REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(add_byte_tokenizer(make_hf_model(tmp_path_factory.mktemp("tiny"), "v3", num_hidden_layers=2)))


def write_jsonl(path: Path, lines: list[dict | str]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_results(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [str(r["id"]) for r in rows]
    assert len(ids) == len(set(ids)), "an id was written twice"
    return {str(r["id"]): r for r in rows}


def expected(checkpoint: str, prompts: dict[str, object], params: dict[str, SamplingParams]) -> dict:
    with LLM(checkpoint, kv_cache_memory=int(KV)) as llm:
        outs = llm.generate(list(prompts.values()), [params[k] for k in prompts])
    return {k: (o.outputs[0].token_ids, o.outputs[0].text) for k, o in zip(prompts, outs, strict=True)}


def batch_args(checkpoint: str, inp: Path, out: Path) -> list[str]:
    """A greedy batch two sequences at a time: results trickle out over a few seconds."""
    args = ["batch", "--model", checkpoint, "--input", str(inp), "--output", str(out), "--temperature", "0"]
    return [*args, "--kv-cache-memory", KV, "--max-num-seqs", "2", "--no-progress"]


def start_batch(args: list[str], **popen: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "moelaunch.launcher.cli", *args],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def test_batch_matches_generate_and_reports_bad_lines(checkpoint, tmp_path, capsys):
    chat = [{"role": "user", "content": "hi there"}]
    lines = [
        {"id": "a", "prompt": "hello world", "temperature": 0, "max_tokens": 6},
        {"id": 7, "messages": chat, "temperature": 0, "max_tokens": 5},
        '{"id": "broken", "prompt": ',
        {"id": "a", "prompt": "again"},
        {"id": "t", "prompt": "typo", "max_token": 3},
        {"id": "v", "prompt": "bad value", "top_p": 0},
        {"id": "s", "prompt": "sampled", "temperature": 0.8, "max_tokens": 7},
        {"id": "long", "prompt": "x" * 80},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    argv = ["batch", "--model", checkpoint, "--input", str(inp), "--output", str(out)]
    rc = main([*argv, "--max-tokens", "4", "--kv-cache-memory", KV, "--max-model-len", "64", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0
    for n, why in [(3, "malformed JSON"), (4, "repeats line 1"), (5, "max_token"), (6, "top_p"), (8, "64")]:
        assert f"in.jsonl:{n}: skipped:" in captured.err and why in captured.err
    assert "3 done" in captured.out and "5 line(s) skipped: 3, 4, 5, 6, 8" in captured.out

    results = read_results(out)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    ref = expected(
        checkpoint,
        {"a": "hello world", "7": chat, "s": "sampled"},
        {
            "a": greedy,
            "7": SamplingParams(temperature=0, max_tokens=5),
            "s": SamplingParams(temperature=0.8, max_tokens=7, seed=default_seed(0, "s")),
        },
    )
    assert {k: (r["token_ids"], r["text"]) for k, r in results.items()} == ref
    assert results["7"]["id"] == 7 and results["7"]["usage"]["completion_tokens"] == 5
    assert results["a"]["finish_reason"] in ("stop", "length")

    # A rerun finds everything done and runs nothing.
    assert main([*argv, "--kv-cache-memory", KV, "--max-model-len", "64", "--no-progress"]) == 0
    assert "0 done, 3 already in" in capsys.readouterr().out
    assert read_results(out) == results


def test_resume_after_sigkill_gives_every_id_once(checkpoint, tmp_path):
    # Staggered lengths and 2 sequences at a time: results trickle out over a few seconds.
    n = 40
    lines = [
        {"id": f"r{i}", "prompt": f"request {i}", "max_tokens": 30 + 4 * (i % 10), "ignore_eos": True}
        for i in range(n)
    ]
    for row in lines[::5]:
        row["temperature"] = 0.7  # sampled, seeded by id: a resumed job must draw the same tokens
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    args = batch_args(checkpoint, inp, out)
    proc = start_batch(args)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 4:
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the job ended before it could be killed: {proc.stderr.read()}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    first = out.read_text().count("\n")
    assert 4 <= first < n
    with open(out, "a") as f:
        f.write('{"id": "r39", "text": "torn')  # what a kill in the middle of a write leaves

    # The rerun may batch differently (more at once): results depend only on each line.
    assert main([*args, "--max-num-seqs", "64"]) == 0
    results = read_results(out)
    assert sorted(results) == sorted(r["id"] for r in lines)

    params = {
        r["id"]: SamplingParams(
            temperature=r.get("temperature", 0),
            max_tokens=r["max_tokens"],
            ignore_eos=True,
            seed=default_seed(0, r["id"]),
        )
        for r in lines
    }
    ref = expected(checkpoint, {r["id"]: r["prompt"] for r in lines}, params)
    assert {k: (r["token_ids"], r["text"]) for k, r in results.items()} == ref


def test_batch_logs_throughput_and_cache_use(checkpoint, tmp_path, capsys, monkeypatch):
    from moelaunch.launcher.jobs import batch

    monkeypatch.setattr(batch, "PROGRESS_LOG_INTERVAL_S", 0.0)  # a line after every step
    prompts = write_jsonl(
        tmp_path / "in.jsonl", [{"id": i, "prompt": "hi", "max_tokens": 3} for i in range(3)]
    )
    with LLM(checkpoint, kv_cache_memory=int(KV)) as llm:
        summary = batch.run_batch(llm, prompts, tmp_path / "out.jsonl", {"temperature": 0}, progress=False)
    assert summary.done == 3
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("batch: ")]
    assert lines and all("tok/s generated" in line and "KV cache" in line for line in lines)
    assert "running 0, waiting 0" in lines[-1]  # the last step's stats: everything finished


@pytest.mark.slow
def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_on_a_two_rank_batch_is_one_line_and_the_rerun_finishes(checkpoint, tmp_path):
    lines = [
        {"id": f"r{i}", "prompt": f"request {i}", "max_tokens": 24, "ignore_eos": True} for i in range(16)
    ]
    inp, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    args = [*batch_args(checkpoint, inp, out), "--tp", "2"]
    # A session of its own: SIGINT to the whole group, as Ctrl-C in a terminal sends it to every rank.
    # SIGINT's default action restored: a test run started in the background inherits it ignored.
    proc = start_batch(args, start_new_session=True, preexec_fn=_sigint_default)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the job ended before Ctrl-C"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    stderr = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130
    assert "run the same command again to resume" in stderr and "Traceback" not in stderr, stderr
    assert main(args) == 0
    assert sorted(read_results(out)) == sorted(r["id"] for r in lines)


def test_a_second_run_on_one_output_is_refused_while_the_first_runs(checkpoint, tmp_path):
    """Two runs on one output once ran every id twice. The first holds OUTPUT.lock from before its model
    loads (stopped there with SIGSTOP, so the race is certain); the second fails at once, naming the
    output and the first's pid; the first then finishes with every id once."""
    lines = [{"id": f"r{i}", "prompt": f"request {i}", "max_tokens": 4} for i in range(6)]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    lock = tmp_path / "out.jsonl.lock"
    args = batch_args(checkpoint, inp, out)
    first = start_batch(args)
    deadline = time.monotonic() + 60
    while first.poll() is None and not (lock.exists() and lock.read_text().strip()):
        assert time.monotonic() < deadline, "the first run never took the lock"
        time.sleep(0.02)
    os.kill(first.pid, signal.SIGSTOP)
    try:
        assert lock.read_text().strip() == str(first.pid)
        second = start_batch(args)
        _, err = second.communicate(timeout=120)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode == 1
    assert f"{out} is being written by another run (pid {first.pid}" in err and err.count("\n") == 1
    assert first.wait(timeout=300) == 0, first.stderr.read()
    first.stderr.close()
    assert sorted(read_results(out)) == sorted(r["id"] for r in lines)
    assert not lock.exists()  # removed by the run that held it


def test_an_output_with_repeated_ids_keeps_the_first_of_each(checkpoint, tmp_path, capsys):
    """What two runs at once wrote before the lock: a rerun once kept both copies of each id."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": i, "max_tokens": 2} for i in "abc"])
    out = write_jsonl(tmp_path / "out.jsonl", [
        {"id": "a", "text": "first a"}, {"id": "b", "text": "b"}, {"id": "a", "text": "second a"},
        "not a result", {"id": "b", "text": "b"},
    ])  # fmt: skip
    assert main(batch_args(checkpoint, inp, out)) == 0
    captured = capsys.readouterr()
    assert "removed 2 line(s) repeating an id already there" in captured.err
    assert "batch: 1 done, 2 already in" in captured.out
    rows = out.read_text().splitlines()
    assert rows[2] == "not a result"  # a line that is not a result is the user's: kept where it was
    assert [json.loads(r)["id"] for r in rows if r.startswith("{")] == ["a", "b", "c"]
    assert json.loads(rows[0])["text"] == "first a"


@pytest.mark.parametrize(
    ("output", "says"), [("missing/dir/out.jsonl", "does not exist"), (".", "is a directory")]
)
def test_an_output_that_cannot_be_written_fails_before_the_model_loads(tmp_path, capsys, output, says):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    args = ["batch", "--model", str(tmp_path / "no-model-here"), "--input", str(inp)]
    assert main([*args, "--output", str(tmp_path / output)]) == 1
    err = capsys.readouterr().err
    assert says in err and "--output" in err  # the checkpoint (missing) was never looked at


@pytest.mark.parametrize(
    "flag",
    ["--max-in-flight", "--max-tokens", "--max-num-seqs", "--tp", "--max-model-len", "--kv-cache-memory"],
)
@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_count_flag_below_one_is_refused_before_anything_loads(tmp_path, capsys, flag, value):
    """`--max-in-flight -1` once loaded the model and then waited forever for a request to start."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    args = ["batch", "--model", str(tmp_path / "no-model-here"), "--input", str(inp)]
    with pytest.raises(SystemExit) as exited:
        main([*args, "--output", str(tmp_path / "out.jsonl"), flag, value])
    assert exited.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


def test_the_drive_loop_refuses_a_limit_below_one():
    from moelaunch.engine.drive import drive

    with pytest.raises(ValueError, match="max_in_flight=0: give 1 or more"):
        next(drive(engine=None, max_in_flight=0))


def test_a_file_of_which_no_line_can_run_exits_1(checkpoint, tmp_path, capsys):
    """Random bytes as the input: every line skipped, named, and the run is a failure, not exit 0."""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"\x80\x81 not text\n\xff\xfe{\n")
    argv = ["batch", "--model", checkpoint, "--input", str(inp), "--output", str(tmp_path / "out.jsonl")]
    assert main([*argv, "--kv-cache-memory", KV, "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "0 done" in captured.out and "2 line(s) skipped: 1, 2" in captured.out
