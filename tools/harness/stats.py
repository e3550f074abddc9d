"""The benchmarks' estimators: medians, percentiles, throughput, and ratios paired run by
run (each pair measured moments apart, so the drift of a shared machine, which moves whole
runs by +-10%, hits both sides of a pair alike). Pure functions."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def median(values: Sequence[float], empty: float = 0.0) -> float:
    """The median of ``values`` as a float; ``empty`` when there are none."""
    return float(statistics.median(values)) if len(values) else empty


def paired_ratio(values: Sequence[float], bases: Sequence[float]) -> float | None:
    """The median over runs of value / base, the two of a pair measured moments apart (so
    a change of the machine's load between runs falls on both); None when either side has
    no runs. ValueError when the sides have different numbers of runs, or a base is not
    > 0 (nothing to compare against).

    Not rounded: a target is compared with the ratio itself (0.9496 misses 0.95); round
    where the figure is printed or reported (``rounded``)."""
    if not values or not bases:
        return None
    if len(values) != len(bases):
        raise ValueError(f"{len(values)} runs against {len(bases)}: pair them run by run")
    if min(bases) <= 0:
        raise ValueError(f"a base of {min(bases)}: nothing to compare against")
    return float(statistics.median(v / b for v, b in zip(values, bases, strict=True)))


def rounded(value: float | None, places: int = 3) -> float | None:
    """A figure as reported: ``value`` to ``places`` decimals (None stays None)."""
    return None if value is None else round(value, places)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between the closest
    ranks (numpy's default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in 0..100, got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def seconds_as_ms(value: float | None) -> float | None:
    """Seconds in ms, to 0.01 ms (None stays None)."""
    return None if value is None else round(value * 1000.0, 2)


def p50_p99_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """{"p50", "p99"} of seconds, in ms."""
    return {"p50": seconds_as_ms(percentile(values_s, 50)),
            "p99": seconds_as_ms(percentile(values_s, 99))}


def aggregate_tok_s(tokens: int, wall_s: float) -> float:
    """Total completion tokens over the wall time (0 when no time passed)."""
    if tokens < 0 or wall_s < 0:
        raise ValueError("tokens and wall time must be >= 0")
    return tokens / wall_s if wall_s > 0 else 0.0
