"""tools.decode.parity's estimator: ratios bracketed by the baseline runs around each run."""

from __future__ import annotations

import pytest


def test_bracketed_ratios_cancel_drift_between_and_within_runs() -> None:
    from tools.decode.parity import bracketed_ratios

    # the machine's speed wanders from run to run and drifts linearly within each run;
    # the system is always exactly 0.97x of the baseline at the same moment
    speed = [(1.0, 0.8), (0.7, 0.75), (0.9, 0.95)]
    brackets = [(100 * a, 100 * b) for a, b in speed]
    samples = {"baseline": [v for pair in brackets for v in pair],
               "stage2": [0.97 * 100 * (a + b) / 2 for a, b in speed]}
    assert bracketed_ratios(samples, brackets) == {"stage2": pytest.approx(0.97)}
    # a ratio of medians over the same runs reads the drift instead
    from statistics import median
    assert abs(median(samples["stage2"]) / median(samples["baseline"]) - 0.97) > 0.05
