"""The order a benchmark runs its systems in, round by round (pure).

Systems measured in turn on a shared machine each see its drift; rotating their order by
one place each round lets every system go first (and last) in turn, so that none always
runs on a machine its neighbour has just warmed or loaded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def rotated(names: Sequence[T], round_index: int) -> list[T]:
    """``names`` rotated left by ``round_index`` places (modulo their number): round 0
    keeps their order, round 1 starts at the second, and so on; no names, no order.
    ValueError for a negative round."""
    if round_index < 0:
        raise ValueError(f"a round index is >= 0, got {round_index}")
    if not names:
        return []
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]
