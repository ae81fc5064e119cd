"""A chat on the terminal (or from lines on stdin), through any engine client: the prompt, the
streamed reply, `/clear` to forget the conversation, `/exit` to quit."""

from __future__ import annotations

import select
import sys
from collections.abc import Callable, Iterable

from moelaunch.engine.drive import run_to_completion
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.text.streaming import TextStreamer


def chat_loop(engine, tokenizer, params: Callable[[int], SamplingParams], lines: Iterable[str]) -> None:
    """One user turn per line; the reply is printed as it is generated."""
    messages: list[dict[str, str]] = []
    for turn, line in enumerate(lines):
        if line == "/exit":
            return
        if line == "/clear":
            messages.clear()
            continue
        messages.append({"role": "user", "content": line})
        engine.add_request(f"chat-{turn}", tokenizer.encode_chat(messages), params(turn))
        streamer = TextStreamer(tokenizer)
        run_to_completion(engine, streamer)
        print(flush=True)
        messages.append({"role": "assistant", "content": streamer.text})


def terminal_lines(
    prompt: str = ">>> ", on_idle: Callable[[], None] | None = None, idle_s: float = 30.0
) -> Iterable[str]:
    """Lines typed at a prompt, until end of input; on_idle runs every idle_s seconds of waiting
    (keeps the other ranks of a multi-process engine from timing out while a person thinks)."""
    while True:
        print(prompt, end="", flush=True)
        while on_idle is not None and not select.select([sys.stdin], [], [], idle_s)[0]:
            on_idle()
        line = sys.stdin.readline()
        if not line:
            return
        yield line.rstrip("\n")
