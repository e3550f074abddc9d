"""The benchmarks' estimators (tools.harness.stats): percentiles as numpy takes them,
throughput, and ratios paired run by run."""

from __future__ import annotations

import numpy as np
import pytest

from tools.harness.stats import aggregate_tok_s, paired_ratio, percentile, rounded


@pytest.mark.parametrize("q", [0, 1, 37.5, 50, 90, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    values = list(np.random.default_rng(7).exponential(size=101))
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile(values[:4], q) == pytest.approx(float(np.percentile(values[:4], q)))


def test_percentile_edges() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_aggregate_tok_s() -> None:
    assert aggregate_tok_s(300, 2.0) == 150.0
    assert aggregate_tok_s(0, 0.0) == 0.0
    with pytest.raises(ValueError):
        aggregate_tok_s(-1, 1.0)


def test_ratios_pair_the_runs_one_by_one() -> None:
    # the load halves both sides' speed in run 2: paired, the value is 10% above its base
    # in every run; the ratio of the medians (60 / 50) would say 20%
    values, bases = [110.0, 55.0, 60.0], [100.0, 50.0, 60.0 / 1.1]
    assert paired_ratio(values, bases) == pytest.approx(1.1)


def test_a_paired_ratio_is_not_rounded_and_rounded_is_for_the_report() -> None:
    ratio = paired_ratio([94.96], [100.0])
    assert ratio is not None and ratio < 0.95  # a target of 0.95 is missed...
    assert rounded(ratio) == 0.95  # ...though the figure reads 0.95
    assert rounded(None) is None and rounded(1.23456, 2) == 1.23


def test_without_runs_on_either_side_there_is_no_ratio() -> None:
    assert paired_ratio([], [1.0]) is None
    assert paired_ratio([1.0], []) is None


@pytest.mark.parametrize("values, bases, says", [
    ([1.0, 2.0, 3.0], [1.0, 2.0], "3 runs against 2"),
    ([1.0, 2.0], [1.0, 0.0], "nothing to compare against"),
    ([1.0], [-2.0], "nothing to compare against"),
])
def test_unpaired_runs_and_bases_not_above_zero_are_refused(values, bases, says) -> None:
    with pytest.raises(ValueError, match=says):
        paired_ratio(values, bases)
