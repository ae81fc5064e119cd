"""The MTP draft policy's decision on synthetic step times: it follows the measured acceptance and the
batch size, explores the side it has not measured, re-measures the loser, and logs each change once."""

from __future__ import annotations

from moelaunch.engine.draft_policy import MIN_DRAFTED, MIN_STEPS, RECHECK_STEPS, DraftPolicy, batch_bucket


def measured(steps: dict[int, tuple[float, float]], acceptance: float) -> DraftPolicy:
    """A policy that saw MIN_STEPS steps per batch size: (seconds with drafts, seconds without)."""
    policy = DraftPolicy()
    for batch, (t_draft, t_plain) in steps.items():
        for _ in range(MIN_STEPS):
            policy.record(batch, True, t_draft, drafted=100, accepted=round(100 * acceptance))
            policy.record(batch, False, t_plain, drafted=0, accepted=0)
    return policy


def test_acceptance_decides_at_the_same_step_times():
    steps = {1: (0.013, 0.010)}  # drafting costs 1.3x a plain step: pays above 0.3 acceptance
    assert measured(steps, acceptance=0.9).drafts(1)
    assert measured(steps, acceptance=0.6).drafts(1)
    assert not measured(steps, acceptance=0.2).drafts(1)


def test_batch_size_decides_at_the_same_acceptance():
    # Cheap to draft alone, 1.8x the plain step at batch 8: at 0.5 acceptance only batch 1 pays.
    policy = measured({1: (0.013, 0.010), 8: (0.036, 0.020)}, acceptance=0.5)
    assert policy.drafts(1)
    assert not policy.drafts(8) and not policy.drafts(12)  # 12 is in the 8-15 bucket


def test_buckets_are_powers_of_two():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 7, 8, 15, 16, 100)] == [1, 2, 2, 4, 4, 8, 8, 16, 64]


def test_unmeasured_sides_are_explored_drafting_first():
    policy = DraftPolicy()
    assert policy.drafts(4)  # nothing measured: draft
    for _ in range(MIN_STEPS):
        policy.record(4, True, 0.02, drafted=4, accepted=4)
    assert policy.drafts(4)  # too few draft tokens verified to know the acceptance yet
    while sum(policy.drafted) < MIN_DRAFTED:
        policy.record(4, True, 0.02, drafted=4, accepted=4)
    assert not policy.drafts(4)  # drafting measured: measure plain
    assert policy.drafts(1)  # another bucket starts over


def test_the_losing_side_is_measured_again(capsys):
    policy = measured({8: (0.036, 0.020)}, acceptance=0.5)
    assert not policy.drafts(8)
    for _ in range(RECHECK_STEPS):
        policy.record(8, False, 0.020, drafted=0, accepted=0)
    assert not policy.drafts(8)  # the check that clears the drafting figure
    assert policy.drafts(8)  # so drafting is tried again
    log = capsys.readouterr().err
    assert log.count("MTP off at batch 8-15") == 1
    assert "333 tok/s with drafts (acceptance 0.50) vs 400 without" in log


def test_a_standing_decision_needs_a_clear_win_to_flip():
    policy = measured({1: (0.0195, 0.010)}, acceptance=1.0)  # drafting 1.026x as fast: on
    assert policy.drafts(1)
    for _ in range(16):
        policy.record(1, False, 0.0097, drafted=0, accepted=0)
    assert policy.drafts(1)  # plain now 1.003x as fast: within the margin, drafting stays on
    for _ in range(16):
        policy.record(1, False, 0.0090, drafted=0, accepted=0)
    assert not policy.drafts(1)  # plain 1.08x as fast
