"""The counter-based draw on the device: its frequencies against the filtered softmax written out here
(fails if temperature or top-p were ignored), over positions and over seeds, and a row's token
independent of the batch around it."""

from __future__ import annotations

import pytest
import torch

from moelaunch.engine.sampler import device_tokens
from moelaunch.model.sampling import RowSampling, next_tokens

LOGITS = torch.tensor([2.0, 1.5, 0.8, 0.0, -0.5, -1.0])
DRAWS = 20_000
# Four standard deviations of a frequency at p = 0.5 over DRAWS draws.
BOUND = 4 * (0.25 / DRAWS) ** 0.5


def reference(temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / T), keeping the likeliest tokens until their mass reaches top_p, renormalized."""
    probs = (LOGITS.double() / temperature).softmax(-1)
    kept, mass = torch.zeros_like(probs), 0.0
    for t in probs.argsort(descending=True).tolist():
        if mass >= top_p:
            break
        kept[t] = probs[t]
        mass += float(probs[t])
    return kept / kept.sum()


def frequencies(
    temperature: float, top_p: float, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    rows = len(seeds)
    settings = RowSampling(
        temperature=torch.full((rows,), temperature),
        seed=seeds,
        position=positions,
        top_p=torch.full((rows,), top_p),
    )
    tokens = next_tokens(LOGITS.expand(rows, -1), settings, sampled=True)
    return torch.bincount(tokens, minlength=len(LOGITS)).double() / rows


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.6, 1.0), (1.4, 0.75)])
@pytest.mark.parametrize("over", ["positions", "seeds"])
def test_draw_frequencies_follow_the_filtered_softmax(temperature, top_p, over):
    index = torch.arange(DRAWS)
    if over == "positions":  # one seeded request's successive tokens
        seeds, positions = torch.full((DRAWS,), 12345), index
    else:  # many requests' token at one position, seeds spread up to the largest allowed
        seeds, positions = index * (2**63 // DRAWS) + 7, torch.full((DRAWS,), 40)
    want = reference(temperature, top_p)
    got = frequencies(temperature, top_p, seeds, positions)
    assert (got - want).abs().max() < BOUND, (got, want)


def test_the_bound_notices_a_setting_ignored():
    assert (reference(1.0, 1.0) - reference(0.6, 1.0)).abs().max() > 3 * BOUND
    assert (reference(1.4, 1.0) - reference(1.4, 0.75)).abs().max() > 3 * BOUND


def test_a_rows_token_depends_on_its_seed_and_position_only():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    settings = RowSampling(
        temperature=torch.tensor([0.0, 0.9, 1.0, 0.7, 1.3]),
        seed=torch.tensor([1, 2, 3, 4, 2**62]),
        position=torch.tensor([9, 9, 30, 4, 17]),
        top_k=torch.tensor([-1, 10, -1, 3, -1]),
        top_p=torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05]),
    )
    together = next_tokens(logits, settings, sampled=True)
    for i in range(5):
        alone = RowSampling(*(getattr(settings, f)[i : i + 1] for f in settings.__dataclass_fields__))
        assert next_tokens(logits[i : i + 1], alone, sampled=True).item() == together[i]
    assert together[0] == logits[0].argmax()  # temperature 0: greedy
    moved = RowSampling(**{**vars(settings), "position": settings.position + 1})
    assert not torch.equal(next_tokens(logits, moved, sampled=True)[1:], together[1:])


def test_a_row_with_non_finite_logits_gets_the_marker():
    logits = torch.zeros(3, 8)
    logits[1, 2] = float("nan")
    logits[2, 5] = float("inf")
    settings = RowSampling(torch.tensor([0.0, 1.0, 0.5]), torch.tensor([1, 2, 3]), torch.tensor([4, 4, 4]))
    tokens = device_tokens(logits, logits, settings, sampled=True).tolist()
    assert tokens[1:] == [-2, -2] and 0 <= tokens[0] < 8
