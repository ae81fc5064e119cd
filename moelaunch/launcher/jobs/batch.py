"""Batch jobs: every line of a JSONL file through the engine, results appended as they finish.

Input lines are `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages": [...]}`, optionally with
sampling fields (SamplingParams', but for n) that override the job's defaults. A line that cannot run
(bad JSON, no id, a repeated id, an unknown or invalid field, a prompt too long for the model) is
reported with its line number and skipped; the rest still runs.

Output lines are `{"id", "text", "token_ids", "finish_reason", "usage"}` (and "reasoning_content" when
a chat reply thought first: "text" is then its answer) in completion order, each
step's finished requests written, flushed and fsync'ed together, so a killed job loses only requests
still in flight. Rerunning the same command skips the ids already in the output (resume); a torn
last line from a kill mid-write is cut off first, and its request runs again. One run at a time writes
an output (output_lock: a second fails at once), and an output holding an id twice (written by two
runs at once before that lock) is rewritten with each id's first line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from tqdm import tqdm

from moelaunch.engine.drive import Request, drive
from moelaunch.engine.engine import LLMEngine
from moelaunch.engine.llm import LLM
from moelaunch.engine.outputs import RequestOutput
from moelaunch.engine.progress_log import ProgressLog
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.text.reasoning import prompt_opens_reasoning, split_reasoning
from moelaunch.text.tokenizer import Tokenizer

# A line's sampling fields: SamplingParams' own, but for n (an output line holds one completion; repeat
# the line with other ids for more samples).
SAMPLING_FIELDS = set(SamplingParams.model_fields) - {"n"}
REQUEST_FIELDS = {"id", "prompt", "messages"}
PROGRESS_LOG_INTERVAL_S = 10.0  # a throughput and cache-use line this often, beside the progress bar


class LineError(ValueError):
    def __init__(self, line_no: int, reason: str) -> None:
        super().__init__(f"line {line_no}: {reason}")
        self.line_no = line_no
        self.reason = reason


@dataclass
class BatchRequest:
    line_no: int
    id: str | int  # as written in the input; echoed into the output
    prompt: str | None
    messages: list[dict[str, Any]] | None
    params: SamplingParams

    @property
    def key(self) -> str:
        # 7 and "7" are one id: a result line must name its request without ambiguity.
        return str(self.id)


def default_seed(base: int, key: str) -> int:
    """A line without a seed samples with base + a hash of its id, so the tokens a request draws do
    not depend on the order it ran in, or on whether the job was resumed."""
    return base + zlib.crc32(key.encode())


def parse_line(line_no: int, text: str, defaults: dict[str, Any], base_seed: int) -> BatchRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError(line_no, f"malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise LineError(line_no, "expected a JSON object")
    unknown = sorted(set(obj) - REQUEST_FIELDS - SAMPLING_FIELDS)
    if unknown:
        allowed = ", ".join(sorted(REQUEST_FIELDS | SAMPLING_FIELDS))
        raise LineError(line_no, f"unknown field(s) {', '.join(unknown)} (allowed: {allowed})")
    rid = obj.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise LineError(line_no, "needs an 'id' that is a non-empty string or an integer")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise LineError(line_no, "needs exactly one of 'prompt' (a string) or 'messages' (a list)")
    if prompt is not None and not isinstance(prompt, str):
        raise LineError(line_no, "'prompt' must be a string")
    if messages is not None and not (
        isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)
    ):
        raise LineError(line_no, "'messages' must be a non-empty list of {'role', 'content'} objects")
    sampling = {**defaults, **{k: v for k, v in obj.items() if k in SAMPLING_FIELDS}}
    if sampling.get("seed") is None:
        sampling["seed"] = default_seed(base_seed, str(rid))
    try:
        params = SamplingParams(**sampling)
    except ValueError as e:
        raise LineError(line_no, str(e)) from None
    return BatchRequest(line_no, rid, prompt, messages, params)


@dataclass
class InputLines:
    """The input's runnable jobs, in file order; skips blank lines, ids already done (counted in
    `resumed`) and bad lines (passed to `report`, kept in `errors`)."""

    path: Path
    defaults: dict[str, Any]
    base_seed: int
    done_ids: set[str]
    report: Callable[[LineError], None]
    errors: list[LineError] = field(default_factory=list)
    resumed: int = 0

    def __iter__(self) -> Iterator[BatchRequest]:
        first_line: dict[str, int] = {}
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line_no, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    job = parse_line(line_no, text, self.defaults, self.base_seed)
                    if job.key in first_line:
                        raise LineError(line_no, f"id {job.id!r} repeats line {first_line[job.key]}")
                except LineError as e:
                    self.skip(e)
                    continue
                first_line[job.key] = line_no
                if job.key in self.done_ids:
                    self.resumed += 1
                    continue
                yield job

    def skip(self, error: LineError) -> None:
        self.errors.append(error)
        self.report(error)


class ResultWriter:
    """Appends result lines to the output, each step's batch flushed and fsync'ed. The caller holds the
    output's lock (output_lock): one writer per file.

    Opening reads the ids already there. A last line without its newline is the torn end of a write
    that a kill interrupted: it is cut off, so its request runs again and is written once, whole. An id
    written twice (two runs at once, before runs took the lock) keeps its first line only."""

    def __init__(self, path: Path, warn: Callable[[str], None]) -> None:
        self.path = path
        self.done_ids: set[str] = set()
        good_end, repeats = 0, 0
        if path.exists():
            with open(path, "rb") as f:
                for line_no, raw in enumerate(f, start=1):
                    if not raw.endswith(b"\n"):
                        warn(f"{path}: cut a torn last line ({len(raw)} bytes); its request runs again")
                        break
                    good_end += len(raw)
                    rid = _result_id(raw)
                    if rid is None:
                        warn(f"{path}:{line_no}: not a result line; ignored")
                    elif rid in self.done_ids:
                        repeats += 1
                    else:
                        self.done_ids.add(rid)
            if repeats:
                _drop_repeated_ids(path, good_end)
                warn(f"{path}: removed {repeats} line(s) repeating an id already there; kept each id's first")
            elif good_end < path.stat().st_size:
                os.truncate(path, good_end)
        self._file = open(path, "ab")

    def write(self, records: list[dict[str, Any]]) -> None:
        data = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def _drop_repeated_ids(path: Path, end: int) -> None:
    """Rewrite path[:end] keeping the first line of each id (and every other line), replacing the file
    at once: a kill mid-way leaves the old file whole."""
    tmp = path.with_name(path.name + ".dedup")
    seen: set[str] = set()
    read = 0
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for raw in src:
            read += len(raw)
            if read > end:
                break  # the torn last line
            rid = _result_id(raw)
            if rid is None or rid not in seen:
                dst.write(raw)
            if rid is not None:
                seen.add(rid)
        dst.flush()
        os.fsync(dst.fileno())
    shutil.copymode(path, tmp)
    os.replace(tmp, path)


def _result_id(raw: bytes) -> str | None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return str(obj["id"]) if isinstance(obj, dict) and "id" in obj else None


def result_record(job: BatchRequest, out: RequestOutput, tokenizer: Tokenizer) -> dict[str, Any]:
    c = out.outputs[0]
    # A chat reply's think section is returned apart, as the API's reasoning_content; a raw prompt's
    # continuation is returned as generated.
    if job.messages is not None:
        reasoning, text = split_reasoning(c.text, prompt_opens_reasoning(tokenizer, out.prompt_token_ids))
    else:
        reasoning, text = None, c.text
    record: dict[str, Any] = {
        "id": job.id,
        "text": text,
        "token_ids": c.token_ids,
        "finish_reason": c.finish_reason,
        "usage": {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(c.token_ids)},
    }
    if reasoning is not None:
        record["reasoning_content"] = reasoning
    if job.params.logprobs is not None:
        record["logprobs"] = c.token_logprobs
        # JSON object keys are strings: top log-probabilities as [[token_id, logprob], ...] per token.
        record["top_logprobs"] = [sorted(top.items(), key=lambda kv: -kv[1]) for top in c.logprobs or []]
    return record


@dataclass
class BatchSummary:
    done: int = 0
    resumed: int = 0
    skipped: list[LineError] = field(default_factory=list)
    failed: list[LineError] = field(default_factory=list)  # ran, but the engine could not finish them
    completion_tokens: int = 0
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        """0 once every runnable line is in the output; 1 when a line failed as it ran, or when no line
        could run at all (every one skipped: the wrong file, or every line wrong the same way)."""
        nothing_ran = self.skipped and not (self.done or self.resumed)
        return 1 if self.failed or nothing_ran else 0

    def line(self, output: Path) -> str:
        text = f"batch: {self.done} done, {self.resumed} already in {output}"
        for errors, what in ((self.skipped, "skipped"), (self.failed, "failed")):
            if errors:
                numbers = [str(e.line_no) for e in errors]
                shown = ", ".join(numbers[:20]) + (
                    f", ... ({len(numbers) - 20} more)" if len(numbers) > 20 else ""
                )
                text += f", {len(numbers)} line(s) {what}: {shown}"
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        return text + f"; {self.completion_tokens} tokens in {self.seconds:.1f} s ({rate:.1f} tok/s)"


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def _encode(llm: LLM, job: BatchRequest) -> list[int]:
    if job.prompt is not None:
        return llm.tokenizer.encode(job.prompt)
    try:
        allowed = llm.spec.engine.allow_special_tokens_in_content
        return llm.tokenizer.encode_chat(job.messages, special_tokens_in_content=allowed)
    except (jinja2.TemplateError, TypeError, KeyError) as e:
        raise ValueError(f"the chat template failed on these messages: {e}") from None


def run_batch(
    llm: LLM,
    input_path: Path,
    output_path: Path,
    defaults: dict[str, Any],
    base_seed: int = 0,
    max_in_flight: int | None = None,
    progress: bool = True,
) -> BatchSummary:
    """Run every runnable input line not already in the output. Keeps at most max_in_flight requests in
    the engine (default: two full batches per replica), so a huge input never sits in memory."""
    if not input_path.exists():
        raise FileNotFoundError(f"input file {input_path} not found")
    engine: LLMEngine = llm.engine
    limit = max_in_flight or 2 * llm.capacity
    bar = tqdm(total=_count_lines(input_path), unit="req", desc="batch", disable=not progress, mininterval=1)

    def report(error: LineError) -> None:
        tqdm.write(f"{input_path}:{error.line_no}: skipped: {error.reason}", file=sys.stderr)

    def warn(message: str) -> None:
        tqdm.write(message, file=sys.stderr)

    writer = ResultWriter(output_path, warn)
    log = ProgressLog("batch", PROGRESS_LOG_INTERVAL_S, tqdm.write)
    lines = InputLines(input_path, defaults, base_seed, writer.done_ids, report)
    summary, start = BatchSummary(), time.perf_counter()
    in_flight: dict[str, BatchRequest] = {}
    seen_tokens: dict[str, int] = {}  # tokens counted so far per request, for the tok/s figure

    def requests() -> Iterator[Request]:
        for job in lines:
            try:
                prompt_ids = _encode(llm, job)
            except ValueError as e:
                lines.skip(LineError(job.line_no, str(e)))
                continue
            in_flight[job.key] = job
            yield Request(job.key, prompt_ids, job.params, job.prompt)

    def refused(request: Request, error: ValueError) -> None:
        # e.g. a prompt longer than max_model_len: this line only
        lines.skip(LineError(in_flight.pop(request.request_id).line_no, str(error)))

    try:
        for outputs in drive(engine, requests(), limit, refused):
            finished, new_tokens = [], 0
            for out in outputs:
                n = len(out.outputs[0].token_ids)
                new_tokens += n - seen_tokens.get(out.request_id, 0)
                seen_tokens[out.request_id] = n
                if out.finished:
                    job, error = in_flight.pop(out.request_id), out.outputs[0].error
                    if error is None:
                        finished.append(result_record(job, out, llm.tokenizer))
                    else:  # not written: a rerun runs the line again
                        summary.failed.append(LineError(job.line_no, error))
                        tqdm.write(f"{input_path}:{job.line_no}: failed: {error}", file=sys.stderr)
                    del seen_tokens[out.request_id]
            summary.completion_tokens += new_tokens
            log.count(new_tokens, len(finished))
            log.maybe_write(lambda: engine.stats)
            if finished:
                writer.write(finished)
                summary.done += len(finished)
            elapsed = time.perf_counter() - start
            bar.set_postfix_str(f"{summary.completion_tokens / max(elapsed, 1e-9):.1f} tok/s", refresh=False)
            bar.update(summary.done + lines.resumed + len(lines.errors) + len(summary.failed) - bar.n)
        # the lines read after the last step
        bar.update(summary.done + lines.resumed + len(lines.errors) + len(summary.failed) - bar.n)
    except KeyboardInterrupt:
        done = summary.done + lines.resumed
        raise KeyboardInterrupt(
            f"interrupted: {done} results are in {output_path}; run the same command again to resume"
        ) from None
    finally:
        writer.close()
        bar.close()
    summary.resumed, summary.skipped = lines.resumed, lines.errors
    summary.seconds = time.perf_counter() - start
    return summary
