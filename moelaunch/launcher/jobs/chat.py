"""A chat on the terminal (or from lines on stdin), through any engine client: the prompt, the
streamed reply, `/clear` to forget the conversation, `/exit` to quit."""

from __future__ import annotations

import select
import sys
from collections.abc import Callable, Iterable

from moelaunch.engine.drive import run_to_completion
from moelaunch.engine.outputs import RequestOutput, raise_if_failed
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.text.reasoning import ReasoningSplit, prompt_opens_reasoning
from moelaunch.text.streaming import IncrementalText
from moelaunch.text.tokenizer import Tokenizer


class AnswerPrinter:
    """Step callback: prints the answer a request's new tokens add, not a think section before it
    (DeepSeek-R1's hidden reasoning)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.text = IncrementalText(tokenizer)
        self.split = ReasoningSplit(prompt_opens_reasoning(tokenizer, prompt_ids))

    def __call__(self, progress: RequestOutput) -> None:
        c = progress.outputs[0]
        new = self.text.delta(c.token_ids, c.text if progress.finished else None)
        print(self.split.delta(new).get("content", ""), end="", flush=True)


def chat_loop(engine, tokenizer, params: Callable[[int], SamplingParams], lines: Iterable[str]) -> None:
    """One user turn per line; the reply is printed as it is generated. The conversation keeps going
    whatever is typed: a line too long for the model is refused with a message, and when the history
    outgrows the context its oldest exchanges are dropped (and the chat says so)."""
    messages: list[dict[str, str]] = []
    for turn, line in enumerate(lines):
        if line == "/exit":
            return
        if line == "/clear":
            messages.clear()
            continue
        messages.append({"role": "user", "content": line})
        turn_params = params(turn)
        # Room for the reply: the turn's max_tokens, but never more than half the context.
        limit = engine.max_model_len - min(turn_params.max_tokens, engine.max_model_len // 2)
        prompt_ids = tokenizer.encode_chat(messages)
        dropped = 0
        while len(prompt_ids) > limit and len(messages) > 1:
            del messages[:2]  # the oldest exchange: a question and its answer
            dropped += 1
            prompt_ids = tokenizer.encode_chat(messages)
        if len(prompt_ids) > limit:
            messages.pop()
            print(
                f"(that line is {len(prompt_ids)} tokens as a chat turn; this model takes at most {limit} "
                f"with room for the reply: shorten it)",
                flush=True,
            )
            continue
        if dropped:
            print(
                f"(the conversation outgrew the model's {engine.max_model_len}-token context: forgot the "
                f"oldest {dropped} exchange{'s' if dropped > 1 else ''})",
                flush=True,
            )
        engine.add_request(f"chat-{turn}", prompt_ids, turn_params)
        reply = AnswerPrinter(tokenizer, prompt_ids)
        done = run_to_completion(engine, reply)
        print(flush=True)
        raise_if_failed(list(done.values()))
        messages.append({"role": "assistant", "content": reply.split.answer})


def lenient_stdin() -> None:
    """Bytes that are not UTF-8 read as U+FFFD instead of ending the chat with a UnicodeDecodeError."""
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")


def terminal_lines(
    prompt: str = ">>> ", on_idle: Callable[[], None] | None = None, idle_s: float = 30.0
) -> Iterable[str]:
    """Lines typed at a prompt, until end of input; on_idle runs every idle_s seconds of waiting
    (keeps the other ranks of a multi-process engine from timing out while a person thinks)."""
    lenient_stdin()
    while True:
        print(prompt, end="", flush=True)
        while on_idle is not None and not select.select([sys.stdin], [], [], idle_s)[0]:
            on_idle()
        line = sys.stdin.readline()
        if not line:
            return
        yield line.rstrip("\n")
