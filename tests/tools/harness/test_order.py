"""tools.harness.order: the systems' order rotated round by round."""

from __future__ import annotations

import pytest

from tools.harness.order import rotated


def test_each_round_starts_one_place_further_and_keeps_every_name() -> None:
    names = ("a", "b", "c")
    assert [rotated(names, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert all(sorted(rotated(names, r)) == list(names) for r in range(7))


def test_every_name_goes_first_and_last_equally_often() -> None:
    names = ["a", "b", "c", "d"]
    orders = [rotated(names, r) for r in range(8)]
    assert sorted(o[0] for o in orders) == sorted(names * 2)
    assert sorted(o[-1] for o in orders) == sorted(names * 2)


def test_the_input_is_left_alone_and_any_sequence_will_do() -> None:
    names = [1, 2, 3]
    assert rotated(names, 5) == [3, 1, 2] and names == [1, 2, 3]
    assert rotated([], 3) == [] and rotated(["only"], 9) == ["only"]


def test_a_negative_round_is_refused() -> None:
    with pytest.raises(ValueError, match="round index is >= 0"):
        rotated(["a", "b"], -1)
