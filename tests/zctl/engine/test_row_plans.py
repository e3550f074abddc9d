"""Row plans: a row group's session plans as one step, padded (stateful stages) or
ragged (paged stages), and which answers each row takes."""

from __future__ import annotations

import numpy as np

from zctl.engine.executor import Step
from zctl.engine.row_plans import padded_rows, ragged_rows

GROUP = 1 << 30


def _plan(tokens, start, logits_idx=None, rewind=0, want_logits=False):
    return Step(0, np.array(tokens, dtype=np.int64), np.arange(start, start + len(tokens)),
                logits_idx, want_logits, rewind)


def test_ragged_rows_follow_each_other_and_answer_each_rows_last_token() -> None:
    decode, chunk = _plan([7], 30), _plan([1, 2, 3, 4], 12)
    rows = ragged_rows(GROUP, [decode, chunk])
    assert rows.step.stream_id == GROUP
    assert rows.step.token_ids.tolist() == [7, 1, 2, 3, 4]
    assert rows.step.positions.tolist() == [30, 12, 13, 14, 15]
    assert rows.step.row_tokens.tolist() == [1, 4]
    assert rows.step.logits_idx is None  # every row's last token: the frame's default
    assert rows.answers == [(0, 1), (1, 2)]
    assert rows.shapes() == [(1, 30), (4, 12)] and rows.pads == [0, 0]


def test_a_speculative_ragged_row_is_answered_at_every_fed_position() -> None:
    spec = _plan([7, 8, 9], 30, logits_idx=np.arange(3), rewind=2, want_logits=True)
    rows = ragged_rows(GROUP, [_plan([5], 10), spec, _plan([1, 2], 3)])
    assert rows.step.logits_idx.tolist() == [0, 1, 2, 3, 5]
    assert rows.answers == [(0, 1), (1, 4), (4, 5)]
    assert rows.step.mask_tail.tolist() == [0, 2, 0] and rows.step.want_logits


def test_padded_rows_pad_to_the_longest_and_rewind_the_padding_next_step() -> None:
    spec = _plan([7, 8, 9], 30, logits_idx=np.arange(3), rewind=1)
    rows = padded_rows(GROUP, [_plan([5], 10), spec], pads_before=[2, 0])
    assert rows.step.stream_id == GROUP
    assert rows.step.row_tokens is None and rows.step.token_ids.shape == (2, 3)
    assert rows.step.token_ids[0].tolist() == [5, 5, 5]
    assert rows.step.positions[0].tolist() == [10, 11, 12]
    assert rows.step.mask_tail.tolist() == [2, 1]  # last step's padding + its own rewind
    assert rows.pads == [2, 0] and rows.answers == [(0, 1), (3, 6)]
    assert rows.shapes() == [(1, 10), (3, 30)]
    one = padded_rows(GROUP, [_plan([5], 10), _plan([6], 20)], pads_before=[0, 0])
    assert one.step.logits_idx is None and one.answers == [(0, 1), (1, 2)]
