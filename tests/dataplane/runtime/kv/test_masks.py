"""Slot masks (dataplane.runtime.kv.masks) are pure functions: the step mask over kept
slots, of a batch of rows, and of one token."""

from __future__ import annotations

import numpy as np
import pytest

from dataplane.runtime.kv.masks import MASK_MIN, batch_step_mask, one_token_mask, step_mask


def test_step_mask_decode_and_prefill() -> None:
    mask = step_mask(np.array([True, False, True]), 2)
    assert mask.shape == (1, 1, 2, 5)
    visible = mask[0, 0] == 0
    assert visible.tolist() == [
        [True, False, True, True, False],
        [True, False, True, True, True],
    ]
    assert mask[0, 0, 0, 1] == MASK_MIN


def test_step_mask_empty_past_is_causal() -> None:
    visible = step_mask(np.zeros(0, dtype=bool), 3)[0, 0] == 0
    assert visible.tolist() == np.tril(np.ones((3, 3), dtype=bool)).tolist()


def test_batch_step_mask_needs_equal_lengths() -> None:
    assert batch_step_mask([np.ones(2, bool), np.ones(2, bool)], 1).shape == (2, 1, 1, 3)
    with pytest.raises(ValueError, match="equal KV lengths"):
        batch_step_mask([np.ones(2, bool), np.ones(3, bool)], 1)


def test_one_token_mask_equals_the_step_mask() -> None:
    rng = np.random.default_rng(3)
    for keep in (np.zeros(0, bool), np.ones(5, bool), rng.random(40) < 0.7):
        after = np.append(keep, True)
        got = one_token_mask(after)
        want = step_mask(keep, 1)
        assert got.dtype == np.float32 and got.flags.c_contiguous
        assert got.shape == want.shape and np.array_equal(got, want)


def test_one_token_mask_of_a_group_equals_the_rows_step_mask() -> None:
    from dataplane.runtime.kv.rows import rows_step_mask

    keep = np.random.default_rng(5).random((3, 12)) < 0.6
    after = np.concatenate((keep, np.ones((3, 1), dtype=bool)), axis=1)
    got, want = one_token_mask(after), rows_step_mask(keep, 1)
    assert got.shape == want.shape == (3, 1, 1, 13) and np.array_equal(got, want)
