"""The offline Python API, in the vLLM style:

    from moelaunch.launcher import LLM, SamplingParams
    llm = LLM(model="path/to/checkpoint", tp=2)
    outputs = llm.generate(["What is 2+2?"], SamplingParams(temperature=0, max_tokens=32))

With tp*dp*pp > 1 the calling process is rank 0 and the other ranks are started on this machine.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Sequence as Seq
from typing import Any

import jinja2
import torch.distributed as dist
from pydantic import ValidationError
from tqdm import tqdm

from moelaunch.cluster.local import WorkerWatch, blaming_workers, spawn_workers, stop_workers
from moelaunch.cluster.rendezvous import RankEnv, free_port
from moelaunch.engine.build import EngineSpec, build_engine
from moelaunch.engine.config import EngineConfig
from moelaunch.engine.drive import Request, drive
from moelaunch.engine.outputs import RequestOutput, raise_if_failed
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.model.weight_spec import WeightSpec
from moelaunch.parallel.mesh import MeshShape

Prompt = str | list[int] | list[dict[str, Any]]


def engine_config(options: dict[str, Any], others: list[str]) -> EngineConfig:
    """EngineConfig from keyword options, with one ValueError naming each bad option; `others`: the
    options that the rest of the spec takes, for the list of what is allowed."""
    try:
        return EngineConfig(**options)
    except ValidationError as e:
        known = ", ".join([*others, *EngineConfig.model_fields])
        problems = [
            f"{'.'.join(map(str, err['loc']))}: {err['msg']} (given {err.get('input')!r})"
            if err["type"] != "extra_forbidden" or len(err["loc"]) > 1  # nested: "attention.size: ..."
            else f"unknown LLM option {err['loc'][0]!r}; the options are {known}"
            for err in e.errors(include_url=False)
        ]
        raise ValueError("; ".join(problems)) from None


def _names(kind: type, *without: str) -> list[str]:
    return [f.name for f in dataclasses.fields(kind) if f.name not in without]


def spec_from_options(model: str, options: dict[str, Any]) -> EngineSpec:
    """The EngineSpec for LLM(model, **options): each option goes to the part that declares it (the
    weights, the parallel layout, the spec itself), the rest to EngineConfig."""
    weights, layout = _names(WeightSpec, "model"), _names(MeshShape)
    own = _names(EngineSpec, "weights", "parallel", "engine")
    others = [*weights, *layout, *own]
    engine = engine_config({k: v for k, v in options.items() if k not in others}, others)

    def take(names: list[str]) -> dict[str, Any]:
        return {n: options[n] for n in names if n in options}

    return EngineSpec(WeightSpec(model, **take(weights)), MeshShape(**take(layout)), engine, **take(own))


class LLM:
    def __init__(self, model: str, **options: Any) -> None:
        """options: the parallel layout (tp, dp, pp: MeshShape), the weights (dtype, quantization,
        expert_placement, layer_expert_placement: WeightSpec), timeout_s, and any EngineConfig field
        (max_model_len, kv_cache_memory, kv_cache_fraction, block_size, kv_cache_dtype, attention,
        max_num_batched_tokens, max_num_seqs, enable_prefix_caching, seed, speculative,
        skip_tokenizer_init...)."""
        self._start(spec_from_options(str(model), options), {})

    @classmethod
    def from_spec(cls, spec: EngineSpec, env: dict[str, str] | None = None) -> LLM:
        """An LLM from a full spec (what `launch CONFIG.yaml` builds); env goes to worker processes."""
        llm = cls.__new__(cls)
        llm._start(spec, env or {})
        return llm

    def _start(self, spec: EngineSpec, env: dict[str, str]) -> None:
        spec.check_against_model()  # before any worker starts: one clear error, not a rank's traceback
        self.spec = spec
        self._workers = []
        rank_env = None
        if spec.world > 1:
            port = free_port()
            self._workers = spawn_workers(spec.world, "moelaunch.engine.worker", [spec.to_json()], port, env)
            rank_env = RankEnv(0, 0, spec.world, spec.world, "127.0.0.1", port)
        try:
            with blaming_workers(self._workers, spec.timeout_s):
                engine = build_engine(spec, rank_env)
        except BaseException:
            self.shutdown(graceful=False)
            raise
        # A dead or late worker ends the job with one message naming it, not gloo's connection error.
        self.engine = WorkerWatch(engine, self._workers, spec.timeout_s) if self._workers else engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()
        self._shut_down = False

    def _encode(self, prompt: Prompt) -> tuple[list[int], str | None]:
        is_chat = isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt), None
        if not (isinstance(prompt, str) or is_chat):
            raise ValueError(
                f"a prompt must be a string, a list of token ids or a list of chat messages, not {prompt!r}"
            )
        if self.tokenizer is None:
            raise ValueError(
                "text and chat prompts need the tokenizer, which skip_tokenizer_init=True left out: "
                "give token ids"
            )
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), prompt
        for m in prompt:
            if not (isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"a chat message needs a string role and content: {m!r}")
        try:
            allowed = self.spec.engine.allow_special_tokens_in_content
            return self.tokenizer.encode_chat(prompt, special_tokens_in_content=allowed), None
        except jinja2.TemplateError as e:  # e.g. a role the checkpoint's template does not know
            raise ValueError(f"the checkpoint's chat template refused these messages: {e}") from None

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion (continuous batching); outputs in prompt order."""
        if self._shut_down:
            raise ValueError(
                "this LLM was shut down (shutdown() or its `with` block ended): create a new one"
            )
        if prompts == "":
            raise ValueError("the prompt is empty: give some text, token ids or chat messages")
        if not isinstance(prompts, (str, list, tuple)) or not prompts:
            raise ValueError(f"prompts must be a prompt or a non-empty list of prompts, not {prompts!r}")
        if isinstance(prompts, str) or isinstance(prompts[0], (int, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Seq) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        # All or nothing: every prompt is encoded and checked before the first one is queued.
        requests = []
        for prompt, p in zip(prompts, params_list, strict=True):
            token_ids, text = self._encode(prompt)
            request = Request(str(next(self._ids)), token_ids, p, text)
            self.engine.check_request(request.request_id, token_ids, p)
            requests.append(request)
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Seq[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation (or several) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate(conversations, sampling_params, use_tqdm)

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as bar:
            for outputs in drive(self.engine, requests):
                finished = {out.request_id: out for out in outputs if out.finished}
                done.update(finished)
                bar.update(len(finished))
        outputs = [done[r.request_id] for r in requests]
        raise_if_failed(outputs)
        return outputs

    def shutdown(self, graceful: bool = True) -> None:
        """Release the worker ranks: told to stop (graceful), or terminated, as after Ctrl-C, when the
        ranks may be inside a collective that rank 0 left. Calling it again does nothing."""
        self._shut_down = True
        workers, self._workers = self._workers, []
        if workers:
            try:
                if graceful:
                    self.engine.shutdown()
            except Exception as e:  # noqa: BLE001 - a dead rank was reported by the call that met it
                print(f"moelaunch: ranks terminated at shutdown ({e})", file=sys.stderr)
                graceful = False
            stop_workers(workers, terminate=not graceful)
        if dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        # After any error the ranks may be inside a collective that rank 0 left, or dead: terminate them.
        self.shutdown(graceful=kind is None)
