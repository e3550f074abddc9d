"""The host-drift probe: the error a profile taken at one moment makes for a later run."""

from __future__ import annotations

import pytest

from tools.plan.drift import (
    PROFILE_S,
    RUN_S,
    Sample,
    prediction_errors,
    sample_host,
    summary,
    window_medians,
)


def samples(stage: list[float], reference: list[float], every: float = 1.0) -> list[Sample]:
    return [Sample(i * every, s, r) for i, (s, r) in enumerate(zip(stage, reference,
                                                                   strict=True))]


def test_a_host_that_holds_still_costs_nothing() -> None:
    run = samples([0.004] * 120, [0.002] * 120)
    for factor in (False, True):
        errors = prediction_errors(run, 40.0, factor)
        assert len(errors) == 120 - 40 - int(RUN_S)
        assert errors == pytest.approx([0.0] * len(errors))
    assert summary(prediction_errors(run, 40.0, False))["beyond_bound"] == 0.0


def test_a_host_twice_as_slow_by_the_run_is_a_prediction_twice_too_fast() -> None:
    # the stage's step doubles at 40 s; the reference workload doubles with it
    stage = [0.004 if i < 40 else 0.008 for i in range(120)]
    reference = [0.002 if i < 40 else 0.004 for i in range(120)]
    run = samples(stage, reference)
    errors = prediction_errors(run, 60.0, False)
    # profiled at 0-18 s and run at 60-63 s, up to profiled at 22-40 s: all fast; then
    # the profile's window holds slow samples, and from its median on profile and run agree
    assert errors[:23] == pytest.approx([1.0] * 23)
    assert errors[-5:] == pytest.approx([0.0] * 5)
    assert summary(errors)["beyond_bound"] == round(sum(e > 0.15 for e in errors)
                                                    / len(errors), 4)
    # the speed factor, from the checks in the 30 s before the run (30-60 s for the
    # first run: two thirds slow), finds the host twice as slow as when it was profiled
    with_factor = prediction_errors(run, 60.0, True)
    assert with_factor[0] == pytest.approx(0.0)
    assert all(abs(w) <= abs(e) + 1e-12 for w, e in zip(with_factor, errors, strict=True))


def test_a_reference_that_does_not_follow_the_stage_misleads_the_factor() -> None:
    stage = [0.004] * 120
    reference = [0.002 if i < 40 else 0.003 for i in range(120)]
    assert prediction_errors(samples(stage, reference), 60.0, True)[0] == pytest.approx(
        0.004 / (0.004 * 1.5) - 1.0)


def test_what_cannot_be_summed_up_says_why() -> None:
    with pytest.raises(ValueError, match="lead"):
        prediction_errors(samples([0.004] * 10, [0.002] * 10), PROFILE_S - 1, False)
    with pytest.raises(ValueError, match="shorter than a profile"):
        summary(prediction_errors(samples([0.004] * 10, [0.002] * 10), 40.0, False))


def test_windows_are_medians_of_consecutive_stretches() -> None:
    run = samples([0.001, 0.003, 0.002, 0.010], [0.002, 0.002, 0.004, 0.004], every=5.0)
    assert window_medians(run, 10.0) == [
        {"at_s": 0.0, "stage_ms": 2.0, "reference_ms": 2.0},
        {"at_s": 10.0, "stage_ms": 6.0, "reference_ms": 4.0}]


def test_the_host_is_sampled_for_real() -> None:
    run = sample_host("smollm2-135m", "int4", 1, 1.0)
    assert run and all(s.stage_s > 0 and s.reference_s > 0 for s in run)
    assert [s.at_s for s in run] == sorted(s.at_s for s in run)
