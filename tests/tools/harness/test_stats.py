"""The benchmarks' estimators (tools.harness.stats): percentiles as numpy takes them, and
throughput."""

from __future__ import annotations

import numpy as np
import pytest

from tools.harness.stats import aggregate_tok_s, percentile


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
