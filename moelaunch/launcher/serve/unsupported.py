"""OpenAI and vLLM request fields this server accepts without acting on, and those it refuses when
their value asks for something it cannot do (400 naming the field and why).

Accepted as no-ops: fields that only label or route a request elsewhere (store, metadata,
service_tier, ...) or hint at a cost trade-off (reasoning_effort, verbosity, prediction). Anything not
declared anywhere is an unknown field: logged and ignored, or refused with `server.strict: true`.
"""

from __future__ import annotations

from typing import Any

# Given any value, these change nothing in the answer.
NO_OPS = (
    "store", "metadata", "service_tier", "reasoning_effort", "verbosity", "prediction",
    "prompt_cache_key", "safety_identifier", "guided_decoding_backend", "guided_whitespace_pattern",
    "spaces_between_special_tokens", "request_id", "cache_salt", "vllm_xargs", "prompt_cache_options",
    "prompt_cache_retention",
)  # fmt: skip

# field: (the value that is fine, why another one is refused)
REFUSED_UNLESS = {
    "audio": (None, "this server has no audio output; leave audio out"),
    "moderation": (None, "this server runs no moderation model; leave moderation out"),
    "web_search_options": (None, "this server cannot search the web; leave web_search_options out"),
    "echo": (False, "the prompt is not repeated in the output; leave echo out"),
    "suffix": (None, "the model has no fill-in-the-middle mode; leave suffix out"),
    "use_beam_search": (False, "beam search is not implemented; sample instead"),
    "length_penalty": (1.0, "length_penalty only applies to beam search, which is not implemented"),
    "prompt_logprobs": (None, "prompt log-probabilities are not computed; use logprobs"),
    "logits_processors": (None, "custom logits processors cannot be loaded; use logit_bias or a grammar"),
    "chat_template": (None, "the checkpoint's own chat template is used; leave chat_template out"),
    "documents": (None, "the chat template takes no documents; put them in a message"),
    "mm_processor_kwargs": (None, "the model reads text only"),
    "kv_transfer_params": (None, "this server does not transfer KV caches"),
    "return_tokens_as_token_ids": (False, "tokens are returned as text"),
    "priority": (0, "requests run in arrival order, in turn across clients; leave priority out"),
    "continue_final_message": (False, "a reply always starts a new assistant message"),
    "add_special_tokens": (False, "the chat template places the special tokens"),
    "include_stop_str_in_output": (False, "stop strings are cut from the output"),
    "skip_special_tokens": (True, "special tokens are always left out of the text"),
    "truncate_prompt_tokens": (None, "prompts are not truncated; shorten the prompt"),
}  # fmt: skip


def refusal(name: str, value: Any) -> str | None:
    """Why `value` of field `name` is refused, or None when it is fine."""
    if name == "modalities" and value is not None and set(value) - {"text"}:
        return 'modalities: this server writes text only; use ["text"] or leave it out'
    fine, why = REFUSED_UNLESS.get(name, (None, None))
    if why is None or value is None or value == fine:
        return None
    return f"{name}: {why} (given {value!r})"
