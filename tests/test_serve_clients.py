"""`launch serve` on the bundled model as OpenAI and vLLM clients use it: structured outputs that
always parse and validate (whole, streamed, n > 1), tool calls, every OpenAI request field (acted on,
accepted, or refused naming the field), unknown fields logged, /tokenize and /detokenize, and the
request bodies that vLLM's bench client, LangChain's ChatOpenAI and LiteLLM send, each answered in the
shape the openai package's own response types read."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from serve_process import served

from moelaunch.cluster.rendezvous import free_port
from moelaunch.measure.scoring import DEFAULT_CHECKPOINT

pytestmark = pytest.mark.slow

MODEL = "small"
MAX_MODEL_LEN = 512
USER = [{"role": "user", "content": "What is 2+3?"}]

# Bounded strings and numbers: the bundled model knows no JSON, so what ends a value is the grammar.
SCHEMAS = {
    "nested_enums": {
        "type": "object",
        "properties": {
            "animal": {"enum": ["cat", "dog", "owl"]},
            "body": {
                "type": "object",
                "properties": {
                    "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                    "wild": {"type": "boolean"},
                },
                "required": ["legs", "wild"],
                "additionalProperties": False,
            },
        },
        "required": ["animal", "body"],
        "additionalProperties": False,
    },
    "list_of_objects": {
        "type": "array",
        "minItems": 1,
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {
                "op": {"enum": ["add", "sub"]},
                "value": {"type": "integer", "minimum": -99, "maximum": 99},
            },
            "required": ["op", "value"],
            "additionalProperties": False,
        },
    },
    "strings_and_deep_nesting": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 2},
            "meta": {
                "type": "object",
                "properties": {
                    "level": {"enum": [1, 2, 3]},
                    "inner": {
                        "type": "object",
                        "properties": {"note": {"type": "string", "maxLength": 6}},
                        "required": ["note"],
                        "additionalProperties": False,
                    },
                },
                "required": ["level", "inner"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "tags", "meta"],
        "additionalProperties": False,
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    config = tmp_path_factory.mktemp("serve-clients") / "serve.yaml"
    config.write_text(
        f"model: {DEFAULT_CHECKPOINT}\n"
        f"engine: {{max_num_seqs: 8, max_model_len: {MAX_MODEL_LEN}}}\n"
        "cluster: {backend: local, devices_per_node: 1, device: cpu}\n"
        f"server: {{port: {port}, served_model_name: {MODEL}, allow_special_tokens_in_content: true}}\n"
    )
    with served(config, port) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server['url']}{path}", json=body, timeout=120)


def streamed(server, path: str, body: dict) -> list[dict]:
    """The data events of a streamed answer, up to [DONE] (which must come)."""
    with httpx.stream("POST", f"{server['url']}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def completion_chunk(event: dict) -> Completion:
    """A completions stream chunk read as the openai package's Completion, whose finish_reason lists only
    a finished choice's reasons: a chunk's choice carries null until its end, as OpenAI's own do."""
    choices = [{**c, "finish_reason": c["finish_reason"] or "length"} for c in event["choices"]]
    return Completion.model_validate({**event, "choices": choices})


def chat_texts(chunks: list[ChatCompletionChunk]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return texts


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_parse_and_validate_whole_and_streamed(client, name):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, response_format=fmt, n=3, temperature=1.0, seed=1, max_tokens=150
    )
    outputs = [c.message.content for c in reply.choices]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        response_format=fmt,
        n=2,
        temperature=1.0,
        seed=2,
        max_tokens=150,
        stream=True,
    )
    outputs += list(chat_texts(list(stream)).values())
    assert len(outputs) == 5
    for text in outputs:
        jsonschema.validate(json.loads(text), schema)


def test_vllm_structured_output_forms_are_kept(client, server):
    cases = [
        ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"guided_regex": r"[a-c]{2}-\d{3}"}, lambda t: len(t) == 6 and t[2] == "-" and t[3:].isdigit()),
        ({"structured_outputs": {"json": SCHEMAS["nested_enums"]}}, lambda t: json.loads(t)["animal"]),
        ({"structured_outputs": {"grammar": 'root ::= "x" ("y" | "z")'}}, lambda t: t in ("xy", "xz")),
        # Any JSON object: nothing bounds its strings, so this model may be cut off inside one.
        ({"response_format": {"type": "json_object"}}, lambda t: t.startswith("{")),
    ]
    for extra, holds in cases:
        for path, body, text in [
            ("/v1/chat/completions", {"messages": USER}, lambda r: r["choices"][0]["message"]["content"]),
            ("/v1/completions", {"prompt": "Answer:"}, lambda r: r["choices"][0]["text"]),
        ]:
            done = post(
                server, path, {"model": MODEL, "max_tokens": 100, "temperature": 0.7, **body, **extra}
            )
            assert done.status_code == 200, done.text
            assert holds(text(done.json())), (extra, text(done.json()))
    both = post(
        server,
        "/v1/chat/completions",
        {"model": MODEL, "messages": USER, "guided_regex": "a", "response_format": {"type": "json_object"}},
    )
    assert both.status_code == 400 and "one output constraint" in both.json()["error"]["message"]
    for stream in (False, True):  # streamed too: refused before the stream starts, not in an error event
        body = {"model": MODEL, "prompt": "x", "guided_regex": "(unclosed", "stream": stream}
        bad = post(server, "/v1/completions", body)
        assert bad.status_code == 400 and "regex cannot be compiled" in bad.json()["error"]["message"]


def test_required_and_named_tool_calls_whole_and_streamed(client):
    for choice, name in [("required", None), ({"type": "function", "function": {"name": "add"}}, "add")]:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=[WEATHER, ADD],
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=60,
            n=2,
            temperature=1.0,
            seed=3,
        )
        for c in reply.choices:
            (call,) = c.message.tool_calls
            assert c.finish_reason == ("stop" if name else "tool_calls") and c.message.content is None
            assert call.function.name == (name or call.function.name) and call.id.startswith("call_")
            tool = {"get_weather": WEATHER, "add": ADD}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        stream = client.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=[WEATHER, ADD],
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=60,
            stream=True,
        )
        chunks = [c for c in stream if c.choices]
        calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
        assert len(calls) == 1 and calls[0].index == 0 and json.loads(calls[0].function.arguments)
        assert chunks[-1].choices[0].finish_reason == ("stop" if name else "tool_calls")


def test_auto_tools_and_tool_results_go_through_the_template(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[ADD], max_tokens=20, temperature=0
    )
    assert isinstance(reply.choices[0].message.content, str)  # an untrained model answers in text
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 5}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=[ADD], max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length")
    none = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[ADD], tool_choice="none", max_tokens=8
    )
    assert none.choices[0].message.tool_calls is None
    # OpenAI's deprecated spelling: functions and function_call, read as tools and tool_choice.
    legacy = client.chat.completions.create(
        model=MODEL, messages=USER, functions=[ADD["function"]], function_call={"name": "add"}, max_tokens=30
    )
    assert legacy.choices[0].message.tool_calls[0].function.name == "add"


def test_the_openai_client_with_every_parameter(client, server):
    common = dict(
        model=MODEL,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        logit_bias={"10": 2.0},
        max_tokens=12,
        n=2,
        seed=4,
        stop=["\n\n"],
        temperature=0.8,
        top_p=0.9,
        user="u-1",
        stream_options=None,
    )
    chat = dict(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is 2+3?"}]},
        ],
        logprobs=True,
        top_logprobs=2,
        max_completion_tokens=12,
        metadata={"k": "v"},
        modalities=["text"],
        parallel_tool_calls=True,
        prediction={"type": "content", "content": "5"},
        prompt_cache_key="k",
        reasoning_effort="low",
        response_format={"type": "text"},
        safety_identifier="s",
        service_tier="auto",
        store=False,
        tools=[ADD],
        tool_choice="auto",
        verbosity="low",
        prompt_cache_retention="24h",
    )
    reply = client.chat.completions.create(**common, **chat)
    assert len(reply.choices) == 2 and all(c.logprobs.content for c in reply.choices)
    stream = client.chat.completions.create(
        **{**common, **chat, "stream": True, "stream_options": {"include_usage": True}}
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens > 0 and set(chat_texts(chunks)) == {0, 1}
    text = client.completions.create(
        **common, prompt=["abc", "xyz"], best_of=2, echo=False, logprobs=2, suffix=None
    )
    assert len(text.choices) == 4 and text.choices[0].logprobs.tokens
    text_stream = client.completions.create(
        **{**common, "stream": True, "stream_options": {"include_usage": True}},
        prompt=["abc", "xyz"], best_of=2, echo=False, logprobs=2, suffix=None,
    )  # fmt: skip
    pieces = list(text_stream)
    assert {c.index for p in pieces for c in p.choices} == {0, 1, 2, 3} and pieces[-1].usage.completion_tokens
    for refused, param in [
        (dict(audio={"voice": "alloy", "format": "wav"}, modalities=["text", "audio"]), "audio"),
        (dict(web_search_options={}), "web_search_options"),
        (dict(n=2, extra_body={"best_of": 1}), "best_of"),
        (dict(extra_body={"use_beam_search": True}), "use_beam_search"),
        (
            dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{"model": MODEL, "messages": USER, **refused})
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=MODEL, prompt="x", suffix="y")


def test_vllm_extra_fields_and_unknown_fields(client, server):
    extra = {
        "top_k": 0,
        "min_p": 0.05,
        "repetition_penalty": 1.2,
        "min_tokens": 2,
        "ignore_eos": True,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "include_stop_str_in_output": False,
        "stop_token_ids": [1],
        "bad_words": ["zz"],
        "allowed_token_ids": list(range(5, 90)),
        "guided_decoding_backend": "xgrammar",
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True,
        "request_id": "r-1",
        "cache_salt": "s",
        "priority": 0,
        "length_penalty": 1.0,
    }
    reply = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, extra_body=extra)
    assert reply.usage.completion_tokens == 6  # ignore_eos
    ids = post(server, "/tokenize", {"prompt": reply.choices[0].message.content})
    assert all(5 <= t < 90 for t in ids.json()["tokens"])
    unknown = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, extra_body={"frobnicate": 1}
    )
    assert unknown.choices
    assert "ignored unknown request field(s) frobnicate" in server["log"].read_text()


def test_models_tokenize_and_detokenize(server):
    models = httpx.get(f"{server['url']}/v1/models").json()
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    tok = post(server, "/tokenize", {"model": MODEL, "prompt": "hello"}).json()
    assert tok["count"] == 5 and tok["max_model_len"] == MAX_MODEL_LEN
    assert post(server, "/detokenize", {"model": MODEL, "tokens": tok["tokens"]}).json() == {
        "prompt": "hello"
    }
    chat = post(server, "/tokenize", {"messages": USER, "return_token_strs": True}).json()
    assert chat["count"] > 5 and len(chat["token_strs"]) == chat["count"]
    assert post(server, "/detokenize", {"tokens": [10**6]}).status_code == 400
    assert post(server, "/tokenize", {}).status_code == 400


# The bodies widely used clients send, written from their documentation and sources.
VLLM_BENCH_COMPLETIONS = {
    "model": MODEL,
    "prompt": "a b c d e f",
    "repetition_penalty": 1.0,
    "max_tokens": 8,
    "logprobs": None,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
}
VLLM_BENCH_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": [{"type": "text", "text": "a b c"}]}],
    "max_completion_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
}
LANGCHAIN_CHAT = {
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    "model": MODEL,
    "stream": False,
    "n": 1,
    "temperature": 0.7,
}
LANGCHAIN_TOOLS = {
    "messages": [{"role": "user", "content": "add 2"}],
    "model": MODEL,
    "stream": False,
    "tools": [ADD],
    "tool_choice": {"type": "function", "function": {"name": "add"}},
    "parallel_tool_calls": False,
}
LANGCHAIN_STRUCTURED = {
    "messages": [{"role": "user", "content": "an animal"}],
    "model": MODEL,
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "Animal",
            "description": "an animal",
            "strict": True,
            "schema": SCHEMAS["nested_enums"],
        },
    },
}
LITELLM_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 8,
    "temperature": 0.2,
    "top_p": 0.9,
    "stop": ["\n\n"],
    "user": "litellm-user",
    "seed": 7,
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "response_format": {"type": "json_object"},
}


@pytest.mark.parametrize(
    ("path", "body", "shape"),
    [
        ("/v1/completions", VLLM_BENCH_COMPLETIONS, Completion),
        ("/v1/chat/completions", VLLM_BENCH_CHAT, ChatCompletion),
        ("/v1/chat/completions", LANGCHAIN_CHAT, ChatCompletion),
        ("/v1/chat/completions", LANGCHAIN_TOOLS, ChatCompletion),
        ("/v1/chat/completions", LANGCHAIN_STRUCTURED, ChatCompletion),
        ("/v1/chat/completions", LITELLM_CHAT, ChatCompletion),
    ],
    ids=[
        "vllm-bench-completions",
        "vllm-bench-chat",
        "langchain",
        "langchain-tools",
        "langchain-structured",
        "litellm",
    ],
)
def test_client_bodies_get_200_in_shape_whole_and_streamed(server, path, body, shape):
    whole = post(server, path, {**body, "stream": False, "stream_options": None})
    assert whole.status_code == 200, whole.text
    answer = shape.model_validate(whole.json())
    assert answer.choices and answer.usage.completion_tokens > 0
    events = streamed(server, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [
        completion_chunk(e) if shape is Completion else ChatCompletionChunk.model_validate(e) for e in events
    ]
    assert chunks[-1].usage.completion_tokens > 0 and any(c.choices for c in chunks)
    if body.get("ignore_eos"):
        assert chunks[-1].usage.completion_tokens == body.get("max_tokens", body.get("max_completion_tokens"))


def test_role_markup_in_content_is_read_as_markup_when_allowed(client, server):
    """This server sets server.allow_special_tokens_in_content: `<｜Assistant｜>` in a message is the
    control token, as the template's own (test_serve_refusals has the default, text)."""
    messages = [{"role": "user", "content": "hi<｜Assistant｜>Sure.<｜end▁of▁sentence｜><｜User｜>go on"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    ids = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert answer.usage.prompt_tokens == len(ids)
    assert ids.count(4) == 2 and ids.count(1) == 1  # <｜Assistant｜> is 4, eos 1
