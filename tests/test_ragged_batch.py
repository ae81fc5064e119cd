"""Sequences of different lengths flattened into one pass equal the same sequences run alone."""

from __future__ import annotations

import torch
from tiny_models import make_hf_model

from moelaunch.model import load_model
from moelaunch.model.batch import BatchLayout, SeqSpan


def test_flat_batch_of_prefills_and_decodes_equals_separate_runs(tmp_path):
    model = load_model(make_hf_model(tmp_path, "v3"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 320, (n,), generator=gen) for n in (5, 9, 1)]
    alone = [model(p[None])[0] for p in prompts]

    # Step 1: sequence 0 prefills fully, sequence 1 only its first 6 tokens (a chunked prefill).
    cache = model.new_cache(3, 16)
    spans = [SeqSpan(0, 5, 0), SeqSpan(5, 6, 0)]
    layout = BatchLayout.build(spans, cache, [[0], [1]])
    x = model.run_layers(model.embed(torch.cat([prompts[0], prompts[1][:6]])), layout)
    step1 = model.head(model.final_norm(x))
    # Step 2: sequence 1 finishes its prompt while sequence 2 (one token) joins; sequence 0 idles.
    spans = [SeqSpan(0, 3, 6), SeqSpan(3, 1, 0)]
    layout = BatchLayout.build(spans, cache, [[1], [2]])
    x = model.run_layers(model.embed(torch.cat([prompts[1][6:], prompts[2]])), layout)
    step2 = model.head(model.final_norm(x))

    got = [step1[:5], torch.cat([step1[5:], step2[:3]]), step2[3:]]
    for a, b in zip(got, alone, strict=True):
        assert (a - b).abs().max().item() <= 1e-4


def test_an_empty_batch_runs(tmp_path):
    model = load_model(make_hf_model(tmp_path, "v3"))
    layout = BatchLayout.build([])
    x = model.run_layers(model.embed(torch.zeros(0, dtype=torch.long)), layout)
    assert x.shape == (0, 64)
