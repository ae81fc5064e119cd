"""POST /v1/chat/completions and /v1/completions: request body to engine requests to response.

Both endpoints share the flow: read and validate the body (400 naming the field), check the model
(404) and the context length (400 naming both lengths), submit every prompt's request at once (429
when the queue is full, 503 when the engine failed or is stalled), then answer whole or as server-sent
events. A client that goes away aborts its requests, which frees their KV blocks. The requests of one
client (the body's `user`, else the HTTP call) queue behind each other, not behind other clients'
(engine_loop.py).

Every call ends in exactly one `moelaunch_requests{status}` count: an error raised as APIError is
counted by the app's handler (app.py), a whole answer here as 200 or, when the client left, aborted; a
stream by how it ended (200, the status of its error event, or aborted).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from moelaunch.engine.constraints import Constraints
from moelaunch.engine.drive import Request
from moelaunch.engine.outputs import ERROR, non_finite_logits_error
from moelaunch.launcher.deploy.config import show_value
from moelaunch.launcher.serve import responses
from moelaunch.launcher.serve.engine_loop import (
    EngineFailed,
    EngineLoop,
    OutputStream,
    Progress,
    QueueFull,
    Stalled,
)
from moelaunch.launcher.serve.metrics import ServeMetrics
from moelaunch.launcher.serve.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from moelaunch.launcher.serve.text import chat_message
from moelaunch.launcher.serve.tools import ChoiceCalls, template_messages
from moelaunch.text.reasoning import ReasoningSplit, prompt_opens_reasoning
from moelaunch.text.streaming import IncrementalText
from moelaunch.text.tokenizer import Tokenizer

DISCONNECT_POLL_S = 0.5
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    @property
    def kind(self) -> str:
        return ERROR_TYPES.get(self.status, "server_error")

    def response(self) -> JSONResponse:
        return JSONResponse(responses.error_body(str(self), self.kind, self.param, self.status), self.status)


class _ClientLeft(Exception):
    """Ends a whole call's wait once its client went away: nobody reads the answer."""


@dataclasses.dataclass
class ServerState:
    engine_loop: EngineLoop
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    metrics: ServeMetrics
    api_key: str | None
    max_body_bytes: int
    vocab_size: int  # the model's: token ids in a request must be below it
    strict: bool = False  # server.strict: an unknown request field is a 400, not a log line
    special_tokens_in_content: bool = False  # server.allow_special_tokens_in_content
    # Grammars compiled here too (once per spec), so a schema or regex that does not compile is a 400
    # before a stream starts, not an error event after its 200.
    constraints: Constraints = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.constraints = Constraints(self.tokenizer, self.vocab_size)


@dataclasses.dataclass
class _Call:
    """One HTTP call's engine requests: prompt i's request id, and its choices' first index."""

    kind: str  # responses.CHAT or responses.COMPLETION
    response_id: str
    requests: list[Request]
    n: int
    logprobs: int | None
    reasoning_opened: bool = False  # a chat whose template opened the think section (DeepSeek-R1's)
    tools: ChatCompletionRequest | None = None  # a chat that offers tools: how to read calls back

    @property
    def tool_mode(self) -> str:
        return self.tools.tool_mode if self.tools is not None else "none"

    def first_index(self, request_id: str) -> int:
        return next(i for i, r in enumerate(self.requests) if r.request_id == request_id) * self.n


async def chat_completions(state: ServerState, http: HTTPRequest) -> Any:
    req = parse_body(ChatCompletionRequest, await read_json(http, state.max_body_bytes))
    _check_fields(state, req)
    _check_model(state, req.model)
    messages, tools = template_messages(
        state.tokenizer, [m.as_template_input() for m in req.messages], req.tools
    )
    variables = {**(req.chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
    variables["special_tokens_in_content"] = state.special_tokens_in_content  # after: not the client's
    try:
        prompt_ids = state.tokenizer.encode_chat(messages, req.add_generation_prompt, **variables)
    except (jinja2.TemplateError, TypeError, ValueError) as e:
        raise APIError(400, f"the chat template failed on these messages: {e}", "messages") from None
    opened = prompt_opens_reasoning(state.tokenizer, prompt_ids)
    call = _call(state, responses.CHAT, "chatcmpl", req, [(prompt_ids, None)], opened)
    call.tools = req if req.tool_mode != "none" else None
    return await _respond(state, http, call, req)


async def completions(state: ServerState, http: HTTPRequest) -> Any:
    req = parse_body(CompletionRequest, await read_json(http, state.max_body_bytes))
    _check_fields(state, req)
    _check_model(state, req.model)
    prompts = [(state.tokenizer.encode(p), p) if isinstance(p, str) else (p, None) for p in req.prompts()]
    call = _call(state, responses.COMPLETION, "cmpl", req, prompts)
    return await _respond(state, http, call, req)


async def read_json(http: HTTPRequest, limit: int) -> Any:
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(
            413, f"request body of {declared} bytes is over the limit of {limit} (server.max_body_bytes)"
        )
    body = bytearray()
    async for chunk in http.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes (server.max_body_bytes)")
    try:
        return json.loads(body)
    except RecursionError:
        raise APIError(400, "the body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise APIError(400, f"the body is not valid JSON: {e}") from None


def parse_body(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        err = errors[0]
        field = str(err["loc"][0]) if err["loc"] else "(body)"
        # A union field (prompt, stop) fails once per accepted form; name the forms, not the first miss.
        forms = [str(x["loc"][1]) for x in errors if len(x["loc"]) > 1 and x["loc"][0] == field]
        if len(forms) > 1 and all(not f.isdigit() for f in forms):
            raise APIError(
                400,
                f"{field}: given {show_value(err['input'])}; allowed: {' or '.join(dict.fromkeys(forms))}",
                field,
            ) from None
        path = ".".join(str(part) for part in err["loc"]) or "(body)"
        given = f" (given {show_value(err['input'])})" if err["type"] != "missing" else ""
        why = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
        raise APIError(400, f"{path}: {why}{given}", field) from None


def _check_fields(state: ServerState, req: Any) -> None:
    """400 for a field whose value cannot be honoured; an unknown field is logged (or a 400 when strict)."""
    refused = req.refused()
    if refused is not None:
        raise APIError(400, refused[1], refused[0])
    if getattr(req, "top_logprobs", None) is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options needs stream: true", "stream_options")
    if req.requested_max_tokens is not None and req.min_tokens > req.requested_max_tokens:
        raise APIError(
            400, f"min_tokens {req.min_tokens} is over max_tokens {req.requested_max_tokens}", "min_tokens"
        )
    vocab = state.vocab_size
    for field in ("stop_token_ids", "allowed_token_ids"):
        outside = [t for t in getattr(req, field) or () if not 0 <= t < vocab]
        if outside:
            raise APIError(
                400, f"{field}: token id {outside[0]} is not in the vocabulary (ids 0..{vocab - 1})", field
            )
    for field, text in req.texts():
        if "\x00" in text:
            raise APIError(400, f"{field}: contains a NUL character; send text without it", field)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(
                400, f"{field}: not valid Unicode ({e.reason} at {e.start}); send UTF-8 text", field
            ) from None
    unknown = req.unknown_fields
    if unknown and state.strict:
        raise APIError(
            400, f"unknown field(s) {', '.join(unknown)} (server.strict is set; leave them out)", unknown[0]
        )
    if unknown:
        print(f"serve: ignored unknown request field(s) {', '.join(unknown)}", file=sys.stderr, flush=True)


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise APIError(
            404, f"model {name!r} does not exist; this server serves {state.model_name!r}", "model"
        )


def _call(
    state: ServerState,
    kind: str,
    prefix: str,
    req: Any,
    prompts: list[tuple[list[int], str | None]],
    reasoning_opened: bool = False,
) -> _Call:
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    requests = []
    for i, (prompt_ids, text) in enumerate(prompts):
        max_tokens = _max_tokens(state, len(prompt_ids), req.requested_max_tokens)
        try:
            params = req.sampling_params(max_tokens, req.logprobs_count)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        requests.append(Request(f"{response_id}-{i}", prompt_ids, params, text))
    return _Call(kind, response_id, requests, req.n, req.logprobs_count, reasoning_opened)


def _check_call(state: ServerState, call: _Call) -> None:
    """What the engine would refuse, refused here: a stream must not start with 200 and then fail."""
    vocab = state.vocab_size
    for r in call.requests:
        outside = [t for t in r.prompt_ids if not 0 <= t < vocab]
        if outside:
            raise APIError(
                400, f"prompt: token id {outside[0]} is not in the vocabulary (ids 0..{vocab - 1})", "prompt"
            )
    for r in call.requests:
        try:
            state.constraints.check(r.params)
        except ValueError as e:
            raise APIError(400, str(e)) from None
    capacity = state.engine_loop.capacity
    sequences = len(call.requests) * call.n
    if sequences > capacity:
        raise APIError(
            400,
            f"{sequences} sequences in one request ({len(call.requests)} prompts x n {call.n}), more than "
            f"the server ever holds at once ({capacity} sequences: engine.max_num_seqs x parallel.dp + "
            "server.max_queue): send fewer prompts or a lower n",
            "prompt" if len(call.requests) > 1 else "n",
        )


def _max_tokens(state: ServerState, prompt_len: int, requested: int | None) -> int:
    room = state.max_model_len - prompt_len
    if room < 1 or (requested is not None and requested > room):
        asked = f" + max_tokens {requested} = {prompt_len + requested}" if requested is not None else ""
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens{asked}, over the context of {state.max_model_len} tokens "
            "(max_model_len): shorten the prompt or lower max_tokens",
            "max_tokens" if requested is not None and room >= 1 else "messages",
        )
    return requested if requested is not None else room


async def _respond(state: ServerState, http: HTTPRequest, call: _Call, req: Any) -> Any:
    _check_call(state, call)
    outputs = OutputStream(asyncio.get_running_loop(), state.engine_loop.check_alive)
    ids = [r.request_id for r in call.requests]
    # Timed from here, before the engine thread can see them.
    state.metrics.accepted(ids)
    client = f"user:{req.user}" if req.user else call.response_id
    try:
        state.engine_loop.submit(call.requests, outputs, client)
    except QueueFull as e:
        state.metrics.forget(ids)
        raise APIError(429, f"the server is busy ({e}); retry later") from None
    except (EngineFailed, Stalled) as e:
        state.metrics.forget(ids)
        raise APIError(503, str(e)) from None
    state.metrics.prompt_tokens.inc(sum(len(r.prompt_ids) for r in call.requests))
    if req.stream:
        events = _events(state, http, call, outputs, req.stream_options or StreamOptions(), req.stop)
        return StreamingResponse(events, media_type="text/event-stream")
    finished, client_left = await _until_finished(state, http, call, outputs)
    if client_left:
        state.metrics.requests.labels("aborted").inc()
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
    body = _whole(state, call, finished)
    state.metrics.requests.labels("200").inc()  # after _whole: a bug there is a 500, counted once
    return body


async def _until_finished(
    state: ServerState, http: HTTPRequest, call: _Call, outputs: OutputStream
) -> tuple[dict[str, Progress], bool]:
    """Every request's last progress, and whether the client went away (its requests were aborted)."""
    done: dict[str, Progress] = {}
    watcher = asyncio.create_task(_abort_on_disconnect(state, http, call, done, outputs))
    try:
        while len(done) < len(call.requests):
            progress = await _next(outputs)
            if progress.finished:
                done[progress.request_id] = progress
    except _ClientLeft:
        return done, True
    except BaseException:  # a stall, a bug, the server stopping: the requests may still be in the engine
        _abort_unfinished(state, call, done)
        raise
    finally:
        watcher.cancel()
    return done, False


async def _abort_on_disconnect(
    state: ServerState, http: HTTPRequest, call: _Call, done: dict, outputs: OutputStream
) -> None:
    while True:
        await asyncio.sleep(DISCONNECT_POLL_S)
        if await http.is_disconnected():
            _abort_unfinished(state, call, done)
            outputs.put(_ClientLeft())
            return


def _abort_unfinished(state: ServerState, call: _Call, done: dict) -> None:
    for r in call.requests:
        if r.request_id not in done:
            state.engine_loop.abort(r.request_id)


async def _next(outputs: OutputStream) -> Progress:
    try:
        progress = await outputs.get()
    except (EngineFailed, Stalled) as e:
        raise APIError(503, str(e)) from None
    except ValueError as e:  # the engine refused the request (e.g. a token id outside the vocabulary)
        raise APIError(400, str(e)) from None
    failed = [c.error for c in progress.choices if c.finish_reason == ERROR]
    if failed:  # the engine's words (today the only cause: non-finite logits, naming the tensors)
        raise APIError(500, failed[0] or non_finite_logits_error([]))
    return progress


def _whole(state: ServerState, call: _Call, finished: dict[str, Progress]) -> dict[str, Any]:
    body = responses.envelope(call.kind, call.response_id, state.model_name)
    choices, completion_tokens = [], 0
    for request in call.requests:
        progress = finished[request.request_id]
        first = call.first_index(request.request_id)
        for c in progress.choices:
            completion_tokens += len(c.token_ids)
            calls = ChoiceCalls(call.tools) if call.tools is not None else None
            choices.append(
                _choice(state, call, first + c.index, c, c.text, 0, len(c.token_ids), 0, None, calls)
            )
    prompt_tokens = sum(len(r.prompt_ids) for r in call.requests)
    return {**body, "choices": choices, "usage": responses.usage(prompt_tokens, completion_tokens)}


def _choice(
    state: ServerState,
    call: _Call,
    index: int,
    c,
    text: str,
    start: int,
    end: int,
    text_offset: int,
    delta: ReasoningSplit | None = None,
    calls: ChoiceCalls | None = None,
) -> dict[str, Any]:
    """One choice of a response, or of a stream chunk when `delta` (the choice's split so far) is given;
    `calls` reads a chat choice's tool calls out of its content."""
    logprobs = None
    if call.logprobs is not None and end > start:
        if call.kind == responses.CHAT:
            logprobs = responses.chat_logprobs(state.tokenizer, c, start, end)
        else:
            logprobs = responses.completion_logprobs(state.tokenizer, c, start, end, text_offset)
    finish = c.finish_reason
    if call.kind == responses.CHAT:
        key, fields = (
            ("message", chat_message(text, call.reasoning_opened))
            if delta is None
            else ("delta", delta.delta(text))
        )
        if calls is not None:
            read = calls.whole if delta is None else calls.delta
            called, finish = read(fields.get("content", ""), finish)
            fields = {**fields, **called}
        return {"index": index, key: fields, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


async def _events(
    state: ServerState, http: HTTPRequest, call: _Call, outputs: OutputStream, options: StreamOptions, stops
) -> AsyncIterator[str]:
    kind = "chat.completion.chunk" if call.kind == responses.CHAT else responses.COMPLETION
    head = responses.envelope(kind, call.response_id, state.model_name)
    prompt_tokens = sum(len(r.prompt_ids) for r in call.requests)
    texts: dict[int, IncrementalText] = {}
    splits: dict[int, ReasoningSplit] = {}
    tool_calls: dict[int, ChoiceCalls] = {}
    tokens_sent: dict[int, int] = {}
    done: dict[str, Progress] = {}
    outcome: str | None = "aborted"  # unless the stream gets further: the client went away
    try:
        if call.kind == responses.CHAT:
            first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(len(call.requests) * call.n)]  # fmt: skip
            yield _sse({**head, "choices": first})
        while len(done) < len(call.requests):
            try:
                progress = await _next(outputs)
            except APIError as e:
                outcome = str(e.status)
                yield _sse(responses.error_body(str(e), e.kind, e.param, e.status))
                return
            if progress.finished:
                done[progress.request_id] = progress
            chunk_choices = []
            for c in progress.choices:
                index = call.first_index(progress.request_id) + c.index
                text = texts.setdefault(index, IncrementalText(state.tokenizer, stops))
                offset = len(text.sent)
                delta = text.delta(c.token_ids, c.text if c.finish_reason is not None else None)
                start, end = tokens_sent.get(index, 0), len(c.token_ids)
                tokens_sent[index] = end
                # A chunk for every step that brought tokens, even when their text is held back or empty
                # (a partial character): clients time tokens by chunks.
                if delta or c.finish_reason or end > start:
                    split, calls = None, None
                    if call.kind == responses.CHAT:
                        split = splits.setdefault(index, ReasoningSplit(call.reasoning_opened))
                    if call.tools is not None:
                        calls = tool_calls.setdefault(index, ChoiceCalls(call.tools))
                    chunk_choices.append(
                        _choice(state, call, index, c, delta, start, end, offset, split, calls)
                    )
            if chunk_choices:
                chunk = {**head, "choices": chunk_choices}
                if options.continuous_usage_stats:
                    chunk["usage"] = responses.usage(prompt_tokens, sum(tokens_sent.values()))
                yield _sse(chunk)
        if options.include_usage:
            completion_tokens = sum(len(c.token_ids) for p in done.values() for c in p.choices)
            yield _sse({**head, "choices": [], "usage": responses.usage(prompt_tokens, completion_tokens)})
        outcome = "200"
        yield "data: [DONE]\n\n"
    except Exception:
        outcome = None  # counted as a 500 by the app's handler, which sees it next
        raise
    finally:  # done, an error event, the client went away (the response was cancelled), or a bug
        _abort_unfinished(state, call, done)
        if outcome is not None:
            state.metrics.requests.labels(outcome).inc()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
