"""What a stateful stage's sliding layers keep: when a trim is due and where it cuts, which
rewinds lack keys, and row groups and prefixes built from trimmed states."""

from __future__ import annotations

import numpy as np
import pytest

from dataplane.runtime.kv.rows import RowSource
from dataplane.runtime.kv.sliding_states import (
    SlidingStates,
    merge_rows_right,
    prefix_states,
    trimmed,
)

NAMES = ("past_key_values.2.keypresent.2.key", "past_key_values.2.valuepresent.2.value",
         "past_key_values.3.keypresent.3.key", "past_key_values.3.valuepresent.3.value")
SLIDING = SlidingStates(frozenset({2}), window=4, margin=2, slack=3)  # keeps 5 tokens


def test_a_stage_slides_the_states_of_its_sliding_layers_only() -> None:
    states = SlidingStates.of_stage(NAMES, (0, 2, 4), window=4, margin=2, slack=3)
    assert states == SLIDING
    assert [states.is_sliding(n) for n in NAMES] == [True, True, False, False]
    assert SlidingStates.of_stage(NAMES, (0, 4), 4, 2, 3) is None  # none of its layers
    assert SlidingStates.of_stage(NAMES, (2,), 0, 2, 3) is None  # no window
    with pytest.raises(ValueError, match="a slack of at least 1 slot"):
        SlidingStates(frozenset({2}), window=4, margin=2, slack=0)


def test_a_trim_waits_for_its_slack_then_keeps_the_window_and_margin() -> None:
    assert (SLIDING.kept, SLIDING.bound(1)) == (5, 9)
    keep = np.ones(7, dtype=bool)
    assert SLIDING.start_after(keep, 0) == 0  # 2 slots could go: under the slack
    keep = np.ones(8, dtype=bool)
    assert SLIDING.start_after(keep, 0) == 3  # the last 5 kept
    assert SLIDING.start_after(keep, 3) == 3
    keep = np.array([1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1], dtype=bool)  # masked slots kept too
    assert SLIDING.start_after(keep, 0) == 6  # from the 5th kept slot from the end
    # a row group: every row's last 5 kept tokens stay, the shortest row's first kept slot
    rows = np.array([[1] * 12, [0] * 5 + [1] * 7], dtype=bool)
    assert SLIDING.start_after(rows, 0) == 7
    assert SLIDING.start_after(rows, 5) == 5  # 2 more: under the slack


def test_a_rewind_is_refused_when_the_query_after_it_lacks_keys() -> None:
    # 20 tokens, the first 15 gone: the next query (position 20) sees 17.. 19 and itself
    assert not SLIDING.refuses(20, 15)
    assert not SLIDING.refuses(18, 15)  # a rewind of 2, the margin: sees 15, 16, 17
    assert SLIDING.refuses(17, 15)  # a rewind of 3 would need token 14
    assert not SLIDING.refuses(2, 0)  # nothing gone: any rewind
    assert SLIDING.gone_after(np.ones(20, dtype=bool), 15, 12) == 15
    rows = np.array([[1] * 6, [0] * 3 + [1] * 3], dtype=bool)
    assert SLIDING.gone_after(rows, 4, np.array([0, 2])).tolist() == [4, 2]
    assert "keep the last 4 keys and a margin of 2 tokens" in SLIDING.refusal(1, 3, 20)


def _states(slots: int, start: int = 0, rows: int = 1) -> dict[str, np.ndarray]:
    """State tensors whose slot s holds s + 1 (+ 100 a row), sliding ones from ``start``."""
    out = {}
    for name in NAMES:
        first = start if SLIDING.is_sliding(name) else 0
        data = np.arange(first, slots, dtype=np.float32) + 1
        data = data[None, :] + 100 * np.arange(rows, dtype=np.float32)[:, None]
        out[name] = np.broadcast_to(data[:, None, :, None], (rows, 2, slots - first, 3)).copy()
    return out


def test_a_trimmed_state_keeps_its_last_slots() -> None:
    data = _states(8)[NAMES[0]]
    assert trimmed(data, 3)[0, 0, :, 0].tolist() == [4, 5, 6, 7, 8]


def test_rows_merge_right_aligned_from_the_first_slot_any_row_has_keys_for() -> None:
    long = RowSource(_states(12, start=6), 0, np.ones(12, dtype=bool), sliding_start=6,
                     sliding_gone=6)
    short_keep = np.array([1, 1, 0, 1], dtype=bool)  # a masked slot, dropped by the merge
    short = RowSource(_states(4), 0, short_keep)
    rows = merge_rows_right([long, short], SLIDING)
    assert rows.keep.tolist() == [[True] * 12, [False] * 9 + [True] * 3]
    assert rows.sliding_start == 6 and rows.sliding_gone.tolist() == [6, 0]
    glob, slide = rows.states[NAMES[2]], rows.states[NAMES[0]]
    assert glob.shape[2] == 12 and slide.shape[2] == 6
    assert glob[1, 0, 9:, 0].tolist() == [1, 2, 4]  # the short row's kept slots, at the end
    assert slide[0, 0, :, 0].tolist() == [7, 8, 9, 10, 11, 12]
    assert slide[1, 0, :, 0].tolist() == [0, 0, 0, 1, 2, 4]
    with pytest.raises(ValueError, match="has 12 slots but the member's slot table has 6"):
        merge_rows_right([RowSource(_states(12), 0, np.ones(12, dtype=bool), 6, 6)], SLIDING)


def test_a_prefix_of_trimmed_states_lacks_the_tokens_gone() -> None:
    states = _states(12, start=6)
    keep = np.ones(12, dtype=bool)
    keep[9] = False  # a masked slot
    got, gone = prefix_states(states, 0, keep, 10, SLIDING, start=6, gone=6)
    assert gone == 6
    assert got[NAMES[2]][0, 0, :, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 11]
    assert got[NAMES[0]][0, 0, :, 0].tolist() == [7, 8, 9, 11]
    got, gone = prefix_states(states, 0, keep, 4, SLIDING, start=6, gone=6)
    assert gone == 4 and got[NAMES[0]].shape[2] == 0
