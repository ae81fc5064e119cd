"""The serving engine against plain one-sequence generation (itself checked against transformers)."""

from __future__ import annotations

import pytest
from tiny_models import add_byte_tokenizer, make_hf_model

from moelaunch.launcher import LLM, SamplingParams
from moelaunch.model import load_model
from moelaunch.model.single_sequence import generate

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[0, 5, 6, 7, 8, 9], [0] + [3] * 11, [0, 9, 10], [0, 5, 6, 7, 8, 9, 11, 12], [0, 44] * 9]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(add_byte_tokenizer(make_hf_model(tmp_path_factory.mktemp("tiny"), "v3", num_hidden_layers=4)))


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = load_model(checkpoint)
    return {tuple(p): generate(model, p, GREEDY.max_tokens) for p in PROMPTS}


def run_all(llm: LLM, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_batched_requests_match_each_run_alone(checkpoint, reference):
    with LLM(checkpoint, kv_cache_memory=4_000_000) as llm:
        assert run_all(llm) == [reference[tuple(p)] for p in PROMPTS]


def test_requests_joining_a_running_batch(checkpoint, reference):
    with LLM(checkpoint, kv_cache_memory=4_000_000) as llm:
        engine, done = llm.engine, {}
        for i, prompt in enumerate(PROMPTS):  # one new request every other step
            engine.add_request(str(i), prompt, GREEDY)
            for _ in range(2):
                for out in engine.step():
                    done[out.request_id] = out
        while engine.has_unfinished():
            for out in engine.step():
                done[out.request_id] = out
        assert [done[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == [
            reference[tuple(p)] for p in PROMPTS
        ]


def test_chunked_prefill_under_a_small_token_budget(checkpoint, reference):
    with LLM(checkpoint, kv_cache_memory=4_000_000, max_num_batched_tokens=5) as llm:
        assert run_all(llm) == [reference[tuple(p)] for p in PROMPTS]


def test_preemption_with_a_tiny_block_budget_keeps_outputs(checkpoint, reference):
    bytes_per_block = 4 * (16 + 8) * 4 * 4  # block_size 4, latent 16+8, 4 layers, fp32
    with LLM(checkpoint, kv_cache_memory=12 * bytes_per_block, block_size=4) as llm:
        assert llm.engine.blocks.num_blocks == 12
        assert run_all(llm) == [reference[tuple(p)] for p in PROMPTS]
        assert llm.engine.scheduler.preemptions > 0


def test_a_max_model_len_the_kv_budget_cannot_hold_is_refused_with_the_numbers(checkpoint):
    bytes_per_block = 4 * (16 + 8) * 4 * 4  # block_size 4, latent 16+8, 4 layers, fp32
    with pytest.raises(ValueError) as refused:
        LLM(checkpoint, kv_cache_memory=12 * bytes_per_block, block_size=4, max_model_len=64)
    message = str(refused.value)
    for figure in ["max_model_len=64 needs 16 KV blocks of 4 tokens", "holds 12 blocks (48 tokens",
                   f"{bytes_per_block:,} per block", "raise kv_cache_memory"]:  # fmt: skip
        assert figure in message, message
    with LLM(checkpoint, kv_cache_memory=16 * bytes_per_block, block_size=4, max_model_len=64) as llm:
        assert llm.engine.blocks.num_blocks == 16  # exactly one sequence's worth is enough


def test_prefix_cache_hits_are_counted_and_change_nothing(checkpoint):
    shared = [0] + list(range(20, 36))  # 17 tokens: 4 full blocks of 4 shared
    prompts = [shared + [40, 41], shared + [50]]
    model = load_model(checkpoint)
    with LLM(checkpoint, kv_cache_memory=4_000_000, block_size=4) as llm:
        first = run_all(llm, prompts[:1])
        hits_before = llm.engine.blocks.stats.prefix_hit_tokens
        second = run_all(llm, prompts[1:])
        assert llm.engine.blocks.stats.prefix_hit_tokens - hits_before == 16
    assert first + second == [generate(model, p, GREEDY.max_tokens) for p in prompts]


def test_sampling_with_seed_matches_plain_sampling_and_n_samples_differ(checkpoint):
    model = load_model(checkpoint)
    params = SamplingParams(temperature=0.9, max_tokens=10, seed=11, ignore_eos=True, n=3)
    with LLM(checkpoint, kv_cache_memory=4_000_000) as llm:
        outs = llm.generate([PROMPTS[0]], params)[0].outputs
    expected = [generate(model, PROMPTS[0], 10, 0.9, seed=11 + i) for i in range(3)]
    assert [o.token_ids for o in outs] == expected
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_stop_conditions_and_logprobs(checkpoint, reference):
    ref = reference[tuple(PROMPTS[1])]
    with LLM(checkpoint, kv_cache_memory=4_000_000) as llm:
        by_token = llm.generate(
            [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ref[3]])
        )
        assert by_token[0].outputs[0].token_ids == ref[: ref.index(ref[3]) + 1]
        assert by_token[0].outputs[0].finish_reason == "stop"
        full_text = llm.tokenizer.decode(ref)
        stop = full_text[4:6]
        by_text = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[
            0
        ].outputs[0]
        assert by_text.finish_reason == "stop" and stop not in by_text.text
        assert full_text.startswith(by_text.text)
        lp = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
        assert len(lp.logprobs) == 4 and all(len(top) == 3 for top in lp.logprobs)
        assert all(lp.token_ids[i] in lp.logprobs[i] for i in range(4))  # greedy picks the top token


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -1), ("top_p", 0), ("top_k", -2), ("max_tokens", 0), ("min_tokens", 99), ("n", 0),
     ("logprobs", 50), ("stop", [""]), ("temperature", "hot"), ("max_tokens", 1.5), ("seed", "x")],
)  # fmt: skip
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_bad_requests_are_refused_clearly(checkpoint):
    with LLM(checkpoint, kv_cache_memory=4_000_000, max_model_len=32) as llm:
        with pytest.raises(ValueError, match="max_model_len=32"):
            llm.generate([[0] * 40], GREEDY)
        with pytest.raises(ValueError, match="unknown LLM option"):
            LLM(checkpoint, kv_cach_memory=1)


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [("max_num_seqs", 0, "max_num_seqs"), ("max_model_len", "512", "max_model_len"),
     ("speculative", "eagle", "speculative"), ("seed", 2**70, "seed")],
)  # fmt: skip
def test_bad_engine_options_name_the_option_before_loading(tmp_path, option, value, named):
    # tmp_path holds no checkpoint: the option is refused before anything is read.
    with pytest.raises(ValueError, match=f"^{named}:"):
        LLM(str(tmp_path), **{option: value})


def test_token_ids_need_no_tokenizer(tmp_path, reference):
    bare = make_hf_model(tmp_path, "v3", num_hidden_layers=4)  # the same weights, no tokenizer.json
    assert not (bare / "tokenizer.json").exists()
    with LLM(str(bare), kv_cache_memory=4_000_000, skip_tokenizer_init=True) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [reference[tuple(p)] for p in PROMPTS]
        assert all(o.outputs[0].text == "" for o in outs)
        with pytest.raises(ValueError, match="skip_tokenizer_init=True left out: give token ids"):
            llm.generate("a text prompt", GREEDY)
        with pytest.raises(ValueError, match="stop strings need the tokenizer"):
            llm.generate([PROMPTS[0]], SamplingParams(stop=["x"]))


def test_an_aborted_request_frees_its_blocks_and_the_next_one_runs(checkpoint, reference):
    with LLM(checkpoint, kv_cache_memory=4_000_000) as llm:
        engine = llm.engine
        free = engine.blocks.num_free
        engine.add_request("gone", PROMPTS[4], GREEDY)
        engine.step()
        assert engine.blocks.num_free < free
        engine.abort("gone")
        (out,) = engine.step()
        assert out.finished and out.outputs[0].finish_reason == "abort"
        engine.release("gone")
        assert engine.blocks.num_free == free and not engine.has_unfinished()
        assert run_all(llm, PROMPTS[:1]) == [reference[tuple(PROMPTS[0])]]


@pytest.mark.parametrize(
    ("prompts", "params", "named"),
    [(None, GREEDY, "prompts must be"), ([[0, 5], None], GREEDY, "a prompt must be"),
     ([[0, 5], [0, 10**6]], GREEDY, "not in the vocabulary"),
     ([[0, 5], [0] * 40], GREEDY, "max_model_len=32"),
     ([[{"role": "user"}]], GREEDY, "string role and content"),
     ([[0, 5]], {"temperature": 0}, "SamplingParams")],
)  # fmt: skip
def test_a_bad_prompt_in_a_list_queues_nothing_and_the_engine_keeps_serving(
    checkpoint, reference, prompts, params, named
):
    with LLM(checkpoint, kv_cache_memory=4_000_000, max_model_len=32) as llm:
        with pytest.raises(ValueError, match=named):
            llm.generate(prompts, params)
        assert not llm.engine.has_unfinished()  # the good prompts before the bad one were not queued
        assert run_all(llm, PROMPTS[:1]) == [reference[tuple(PROMPTS[0])]]


@pytest.mark.parametrize(
    ("options", "named"),
    [({"tp": "2"}, "tp='2' must be an integer"), ({"dtype": "yes"}, "dtype='yes' must be one of"),
     ({"tp": 3}, "num_attention_heads=4 is not divisible by tp=3"),
     ({"max_model_len": 10**6}, "exceeds the model's max_position_embeddings")],
)  # fmt: skip
def test_bad_layouts_and_options_fail_before_any_worker_starts(checkpoint, options, named):
    with pytest.raises(ValueError, match=named):
        LLM(checkpoint, **options)


def test_top_k_top_p_and_min_tokens_do_what_they_say(checkpoint, reference):
    prompt = PROMPTS[0]
    greedy = reference[tuple(prompt)]
    with LLM(checkpoint, kv_cache_memory=4_000_000) as llm:

        def tokens(**sampling) -> list[int]:
            params = SamplingParams(max_tokens=12, ignore_eos=True, seed=1, **sampling)
            return llm.generate([prompt], params)[0].outputs[0].token_ids

        # One candidate left: a draw at any temperature is the argmax.
        assert tokens(temperature=1.5, top_k=1) == greedy
        assert tokens(temperature=1.5, top_p=1e-6) == greedy
        assert tokens(temperature=1.5) != greedy  # the same draw without the filters wanders
        # min_tokens: a stop token cannot end the output before it.
        stop = greedy[0]
        early = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))
        assert early[0].outputs[0].token_ids == [stop]
        held = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop], min_tokens=4)
        )[0].outputs[0]
        assert len(held.token_ids) >= 4 and stop not in held.token_ids[:4]


def test_prefix_cache_evicts_under_pressure_and_outputs_stay(checkpoint, reference):
    bytes_per_block = 4 * (16 + 8) * 4 * 4  # block_size 4, latent 16+8, 4 layers, fp32
    with LLM(checkpoint, kv_cache_memory=12 * bytes_per_block, block_size=4) as llm:
        first = run_all(llm, PROMPTS[1:2])  # 11 prompt tokens: 2 full blocks sealed for reuse
        run_all(llm, [[0, 60 + i, 61 + i, 62 + i, 63 + i, 64 + i, 65 + i, 66 + i, 67 + i] for i in range(6)])
        assert llm.engine.blocks.stats.evictions > 0  # the cached blocks went to the later prompts
        assert run_all(llm, PROMPTS[1:2]) == first == [reference[tuple(PROMPTS[1])]]
