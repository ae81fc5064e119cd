"""Hidden reasoning (`<think>steps</think>answer`, DeepSeek-R1's format), as the bundled model writes it
for arithmetic and counting: the worked steps agree with the answers, the tokenizer keeps the tags as
single tokens and the template drops them from the history, training scores only what the model
writes, and the API returns the steps as `reasoning_content` apart from the answer, whole and streamed."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from moelaunch.engine.llm import LLM
from moelaunch.launcher.jobs.batch import run_batch
from moelaunch.launcher.serve.app import build_app
from moelaunch.launcher.serve.engine_loop import EngineLoop
from moelaunch.launcher.serve.handlers import ServerState
from moelaunch.launcher.serve.metrics import ServeMetrics
from moelaunch.measure.scoring import DEFAULT_CHECKPOINT, GREEDY
from moelaunch.tasks.problem_sets import held_out, held_out_conversations
from moelaunch.tasks.tasks import MAX_DIGITS, Problem
from moelaunch.text.reasoning import ReasoningSplit, split_reasoning, with_reasoning
from moelaunch.text.tokenizer import Tokenizer
from moelaunch.training.small_model.data import encode
from moelaunch.training.small_model.tokenizer import build_tokenizer, tokenizer_config


def _lsb_first(digits: str) -> int:
    return int(digits[::-1])


def _answer_from_steps(p: Problem) -> str:
    """The answer read off the worked steps alone, checking each step's arithmetic on the way."""
    if p.kind == "count":
        pairs = [p.reasoning[i : i + 2] for i in range(0, len(p.reasoning), 2)]
        word = "".join(ch for ch, _ in pairs)
        counts = [int(c) for _, c in pairs]
        steps = [b - a for a, b in zip([0, *counts], counts, strict=False)]
        counted = {ch.lower() for (ch, _), step in zip(pairs, steps, strict=True) if step == 1}
        assert word in p.prompt and set(steps) <= {0, 1} and len(counted) <= 1
        assert not counted & {ch.lower() for (ch, _), step in zip(pairs, steps, strict=True) if step == 0}
        return str(counts[-1])
    passes = p.reasoning.split(" ")
    for step in passes:
        operands, result = step.split("=")
        x, y = operands.split("+" if p.kind == "add" else "-")
        assert len(x) == len(y) == MAX_DIGITS and len(result) == MAX_DIGITS + 1
        exact = _lsb_first(x) + _lsb_first(y) if p.kind == "add" else _lsb_first(x) - _lsb_first(y)
        assert _lsb_first(result) == exact % 10 ** (MAX_DIGITS + 1)
    # A subtraction that borrowed out of the top digit was negative: the second pass is the magnitude.
    value = _lsb_first(passes[-1].split("=")[1])
    return f"-{value}" if len(passes) == 2 else str(value)


def test_worked_steps_lead_to_every_held_out_answer():
    worked = [p for p in held_out() if p.reasoning]
    assert {p.kind for p in worked} == {"add", "sub", "count"} and len(worked) == 500
    assert all(_answer_from_steps(p) == p.answer for p in worked)
    assert {p.kind for p in held_out() if not p.reasoning} == {"reverse", "sort", "other"}


def test_split_reasoning():
    assert split_reasoning("<think>321+654=9750</think>579") == ("321+654=9750", "579")
    assert split_reasoning("579") == (None, "579")
    assert split_reasoning("<think>32") == ("32", "")  # cut off while thinking: no answer yet
    assert split_reasoning("thought</think>42") == ("thought", "42")  # R1 opens <think> in its prompt
    assert with_reasoning("", "keeS") == "keeS" and with_reasoning("s", "a") == "<think>s</think>a"


def test_streamed_split_adds_up_to_the_whole():
    whole = "<think>800-050=8599 050-800=2400</think>-42"
    split, fields = ReasoningSplit(), []
    for piece in ("", "<think>", "800-", "050=8599 050-800=2400", "</think>", "-", "42"):
        fields.append(split.delta(piece))
    assert "".join(f.get("reasoning_content", "") for f in fields) == split_reasoning(whole)[0]
    assert "".join(f.get("content", "") for f in fields) == "-42"
    plain = ReasoningSplit()
    assert [plain.delta(t) for t in ("ke", "eS")] == [{"content": "ke"}, {"content": "eS"}]
    opened = ReasoningSplit(opened=True)  # the prompt opened <think>, as DeepSeek-R1's template does
    assert [opened.delta(t) for t in ("thought", "</think>", "42")] == [
        {"reasoning_content": "thought"},
        {"content": ""},
        {"content": "42"},
    ]
    assert split_reasoning("thought", opened=True) == ("thought", "")  # cut off while thinking


def test_think_tags_are_single_tokens_and_the_history_drops_them():
    tok = Tokenizer(build_tokenizer(), tokenizer_config())
    ids = tok.encode("<think>12</think>3")
    assert len(ids) == 5 and tok.decode(ids) == "<think>12</think>3"
    chat = [
        {"role": "user", "content": "What is 1+2?"},
        {"role": "assistant", "content": "<think>100+200=3000</think>3"},
        {"role": "user", "content": "Reverse ab"},
    ]
    assert tok.apply_chat_template(chat) == tok.apply_chat_template(
        [*chat[:1], {**chat[1], "content": "3"}, chat[2]]
    )


def test_training_scores_the_last_reply_whole_and_earlier_answers_written_without_steps():
    tok = Tokenizer(build_tokenizer(), tokenizer_config())
    conversation = next(c for c in held_out_conversations() if c[0].reasoning and not c[1].reasoning)
    ids, turn_of = encode(tok, conversation)
    scored = {t: tok.decode([i for i, u in zip(ids, turn_of, strict=True) if u == t]) for t in set(turn_of)}
    last = len(conversation) - 1
    assert 0 not in scored  # the first answer came from steps the history no longer shows
    assert scored[1] == conversation[1].answer
    assert scored[last] == conversation[last].reply and conversation[last].reply.startswith(
        "<think>"
    ) == bool(conversation[last].reasoning)


def _serve(checkpoint: str):
    """A checkpoint behind the HTTP app, in process, with the offline API beside it."""
    llm = LLM(checkpoint)
    loop = EngineLoop(llm.engine, room=8, max_queue=0, keepalive_s=60, stall_timeout_s=60)
    state = ServerState(
        loop,
        llm.tokenizer,
        "small",
        llm.engine.max_model_len,
        ServeMetrics(),
        None,
        2**20,
        llm.engine.model.args.vocab_size,
    )
    loop.start()
    try:
        with TestClient(build_app(state)) as client:
            yield client, llm
    finally:
        loop.stop(30)
        llm.shutdown()


@pytest.fixture(scope="module")
def api():
    yield from _serve(str(DEFAULT_CHECKPOINT))


@pytest.fixture(scope="module")
def r1_api(tmp_path_factory):
    """The bundled model with DeepSeek-R1's style of template: the generation prompt opens <think>, so
    the reply starts inside the think section."""
    checkpoint = tmp_path_factory.mktemp("r1-template")
    for f in DEFAULT_CHECKPOINT.iterdir():
        (checkpoint / f.name).write_bytes(f.read_bytes())
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    prompt = "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
    assert prompt in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(
        prompt, "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>' }}{% endif %}"
    )
    config_path.write_text(json.dumps(config))
    yield from _serve(str(checkpoint))


def _whole_and_streamed(client: TestClient, body: dict) -> tuple[dict, list[dict]]:
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    return message, [c["choices"][0]["delta"] for c in chunks if c["choices"]]


def test_api_returns_the_steps_as_reasoning_content(api):
    client, llm = api
    messages = [{"role": "user", "content": "What is 12+34?"}]
    raw = llm.chat([messages], GREEDY)[0].outputs[0].text
    body = {"model": "small", "messages": messages, "temperature": 0, "max_tokens": GREEDY.max_tokens}
    message, deltas = _whole_and_streamed(client, body)
    assert (
        message["reasoning_content"]
        and with_reasoning(message["reasoning_content"], message["content"]) == raw
    )
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]


def test_a_template_that_opens_the_think_section_streams_it_once(api, r1_api, tmp_path):
    """With <think> in the prompt the model writes the same tokens after it; the reasoning goes out as
    reasoning_content only, whole and streamed, in the chat API and in batch results."""
    body = {"model": "small", "messages": [{"role": "user", "content": "What is 12+34?"}], "temperature": 0}
    body["max_tokens"] = GREEDY.max_tokens
    expected, _ = _whole_and_streamed(api[0], body)
    client, llm = r1_api
    message, deltas = _whole_and_streamed(client, body)
    assert message == expected and expected["reasoning_content"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == expected["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == expected["content"]
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"id": "chat", "messages": body["messages"]}) + "\n")
    run_batch(llm, source, results, {"temperature": 0, "max_tokens": GREEDY.max_tokens}, progress=False)
    record = json.loads(results.read_text())
    assert (record["reasoning_content"], record["text"]) == (
        expected["reasoning_content"],
        expected["content"],
    )


def test_batch_results_carry_the_steps_apart_for_chats_only(api, tmp_path):
    _, llm = api
    question = "What is 50-8?"
    lines = [
        {"id": "chat", "messages": [{"role": "user", "content": question}]},
        {"id": "raw", "prompt": question},
    ]
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_batch(llm, source, results, {"temperature": 0, "max_tokens": GREEDY.max_tokens}, progress=False)
    records = {r["id"]: r for r in map(json.loads, results.read_text().splitlines())}
    raw = llm.chat([lines[0]["messages"]], GREEDY)[0].outputs[0].text
    assert with_reasoning(records["chat"]["reasoning_content"], records["chat"]["text"]) == raw
    assert "reasoning_content" not in records["raw"]
