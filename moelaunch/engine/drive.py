"""The one loop that drives an engine, for every job (the LLM API, chat, batch, bench, torchrun).

Each pass adds new requests while there is room, runs one engine step, forgets the requests that
finished, and hands the step's outputs to the caller, who streams, writes or times them. The engine is
an LLMEngine or a client with the same methods (the Ray backend's proxy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from moelaunch.engine.outputs import RequestOutput
from moelaunch.engine.sampling_params import SamplingParams

_END = object()


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, echoed into the output when there is one


def drive(
    engine,
    requests: Iterable[Request | None] = (),
    max_in_flight: int | None = None,
    on_refused: Callable[[Request, ValueError], None] | None = None,
) -> Iterator[list[RequestOutput]]:
    """Step the engine until nothing is left; yields each step's outputs (finished ones released).

    requests are read lazily, at most max_in_flight of them in the engine at once, so a huge input never
    sits in memory. A live source (the server's) yields None for "nothing new now": the engine steps
    what it has, and the source is asked again (it may block while the engine is idle). A request the
    engine refuses (too long, bad parameters) goes to on_refused, which reports it and lets the rest
    run; without on_refused the ValueError propagates.
    """
    if max_in_flight is not None and max_in_flight < 1:
        raise ValueError(f"max_in_flight={max_in_flight}: give 1 or more (no request could ever start)")
    pending = iter(requests)
    in_flight = 0
    exhausted = False
    while True:
        while not exhausted and (max_in_flight is None or in_flight < max_in_flight):
            request = next(pending, _END)
            if request is _END:
                exhausted = True
                break
            if request is None:
                break
            try:
                engine.add_request(request.request_id, request.prompt_ids, request.params, request.prompt)
            except ValueError as e:
                if on_refused is None:
                    raise
                on_refused(request, e)
                continue
            in_flight += 1
        if not engine.has_unfinished():
            if exhausted:
                return
            continue
        outputs = engine.step()
        for out in outputs:
            if out.finished:
                engine.release(out.request_id)
                in_flight -= 1
        yield outputs


def run_to_completion(
    engine, on_output: Callable[[RequestOutput], None] | None = None
) -> dict[str, RequestOutput]:
    """Run what was added to the engine to the end; returns the finished requests by id."""
    done: dict[str, RequestOutput] = {}
    for outputs in drive(engine):
        for out in outputs:
            if on_output is not None:
                on_output(out)
            if out.finished:
                done[out.request_id] = out
    return done
