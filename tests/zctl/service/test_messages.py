"""The service's stats records: a histogram snapshot's count since an earlier one, and its
quantiles as Prometheus reads them."""

from __future__ import annotations

import pytest

from zctl.service.messages import HistogramSnapshot

BOUNDS = [1.0, 2.0, 4.0, 8.0]


def hist(*counts: int, total: float = 0.0) -> HistogramSnapshot:
    return HistogramSnapshot(BOUNDS, list(counts), total)


def test_quantiles_interpolate_inside_their_bucket_as_prometheus_does() -> None:
    assert hist(0, 0, 0, 0, 0).quantile(0.5) is None
    assert hist(4, 0, 0, 0, 0).quantile(0.5) == pytest.approx(0.5)
    assert hist(0, 2, 2, 0, 0).quantile(0.5) == pytest.approx(2.0)
    assert hist(0, 2, 2, 0, 0).quantile(0.75) == pytest.approx(3.0)
    assert hist(0, 0, 0, 0, 5).quantile(0.95) == 8.0  # +Inf: its lower bound


def test_a_window_is_the_difference_unless_the_histogram_started_again() -> None:
    before, now = hist(5, 0, 0, 0, 0, total=3), hist(5, 4, 0, 0, 0, total=9)
    assert now.since(before) == hist(0, 4, 0, 0, 0, total=6)
    assert now.since(None) is now
    assert hist(1, 0, 0, 0, 0).since(now) == hist(1, 0, 0, 0, 0)  # restarted
    other = HistogramSnapshot([1.0, 3.0, 4.0, 8.0], [9, 9, 0, 0, 0])
    assert now.since(other) is now
