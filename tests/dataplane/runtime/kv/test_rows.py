"""Row groups, the pure parts: merging member rows and the per-row step mask."""

from __future__ import annotations

import numpy as np
import pytest

from dataplane.runtime.kv.masks import MASK_MIN, step_mask
from dataplane.runtime.kv.rows import RowSource, merge_rows, rows_step_mask


def _state(rows: int, slots: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((rows, 2, slots, 4)).astype(np.float32)
            for name in ("k0", "v0")}


def test_merge_keeps_each_members_kept_slots_in_order_and_pads_with_masked_slots() -> None:
    solo = _state(1, 5, 1)
    solo_keep = np.array([True, False, True, True, False])
    group = _state(2, 3, 2)
    group_keep = np.ones(3, dtype=bool)
    merged, keep = merge_rows([RowSource(group, 1, group_keep), RowSource(solo, 0, solo_keep)])
    assert keep.tolist() == [[True, True, True], [True, True, True]]
    for name in ("k0", "v0"):
        assert merged[name].shape == (2, 2, 3, 4)
        np.testing.assert_array_equal(merged[name][0], group[name][1])
        np.testing.assert_array_equal(merged[name][1], solo[name][0][:, [0, 2, 3], :])
    short = np.array([True, False, False, False, False])
    merged, keep = merge_rows([RowSource(solo, 0, short), RowSource(group, 0, group_keep)])
    assert keep.tolist() == [[True, False, False], [True, True, True]]
    assert not merged["k0"][0, :, 1:, :].any()  # padding is zeros, and masked


def test_merge_refuses_mismatched_members() -> None:
    with pytest.raises(ValueError, match="at least one"):
        merge_rows([])
    a, b = _state(1, 3, 1), {"k0": np.zeros((1, 2, 3, 4), np.float32)}
    with pytest.raises(ValueError, match="different state"):
        merge_rows([RowSource(a, 0, np.ones(3, bool)), RowSource(b, 0, np.ones(3, bool))])
    with pytest.raises(ValueError, match="slot table has 4"):
        merge_rows([RowSource(a, 0, np.ones(4, bool))])


def test_rows_mask_is_each_rows_stream_mask() -> None:
    keep = np.array([[True, False, True], [True, True, False]])
    for tokens in (1, 3):
        mask = rows_step_mask(keep, tokens)
        assert mask.shape == (2, 1, tokens, 3 + tokens)
        for row in range(2):
            np.testing.assert_array_equal(mask[row:row + 1], step_mask(keep[row], tokens))
    assert (rows_step_mask(np.zeros((1, 2), bool), 1)[0, 0, 0, :2] == MASK_MIN).all()
    with pytest.raises(ValueError):
        rows_step_mask(np.ones(3, bool), 1)


# -- row groups on real stages (tiny random Llama, 2 fp32 stages) -------------------------

def _runners(export_dir):  # noqa: ANN001, ANN202
    from dataplane.runtime.config import RuntimeSpec
    from dataplane.runtime.stateful import StageRunner

    return [StageRunner(export_dir, i, RuntimeSpec(precision="f32", kv_cache_precision="f32"))
            for i in range(2)]


def _solo_step(runners, sid: int, ids: list[int], start: int) -> np.ndarray:  # noqa: ANN001
    x = np.asarray(ids, dtype=np.int64)[None]
    pos = np.arange(start, start + len(ids))
    for runner in runners:
        x = runner.step(sid, x, pos).copy()
    return x[0, -1]


def _rows_step(runners, gid: int, ids: list[int], positions: list[int]) -> np.ndarray:  # noqa: ANN001
    x = np.asarray(ids, dtype=np.int64)[:, None]
    pos = np.asarray(positions, dtype=np.int64)[:, None]
    for runner in runners:
        x = runner.step_rows(gid, x, pos).copy()
    return x[:, -1]


def _greedy_alone(runners, sid: int, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    for r in runners:
        r.reset_stream(sid)
    out = [int(_solo_step(runners, sid, prompt, 0).argmax())]
    for i in range(n - 1):
        out.append(int(_solo_step(runners, sid, [out[-1]], len(prompt) + i).argmax()))
    return out


def test_row_groups_decode_like_streams_alone_as_rows_join_and_leave(dp_export2) -> None:  # noqa: ANN001
    from dataplane.runtime.base import StageError

    runners = _runners(dp_export2)
    prompts = {1: [5, 9, 3, 7, 2], 2: [11, 4], 3: [8, 8, 1, 6, 2, 9, 4]}
    want = {sid: _greedy_alone(runners, sid, p, 12) for sid, p in prompts.items()}
    got: dict[int, list[int]] = {}
    for sid, prompt in prompts.items():  # prefill alone; stream 1 also rewinds a draft
        for r in runners:
            r.reset_stream(sid)
        got[sid] = [int(_solo_step(runners, sid, prompt, 0).argmax())]
    _solo_step(runners, 1, [got[1][-1], 0, 0], len(prompts[1]))
    for r in runners:
        r.mask_tail(1, 3)  # masked slots in a member are compacted away by the merge
    gid = 1 << 30

    def step(members: list[int]) -> None:
        ids = [got[s][-1] for s in members]
        pos = [len(prompts[s]) + len(got[s]) - 1 for s in members]
        for s, logits in zip(members, _rows_step(runners, gid, ids, pos), strict=True):
            got[s].append(int(logits.argmax()))

    for r in runners:
        r.regroup(gid, [1, 2])
    assert 1 not in runners[0].streams and runners[0].groups[gid].keep.shape[0] == 2
    for _ in range(4):
        step([1, 2])
    for r in runners:  # stream 3 joins late with a different length, stream 1 leaves
        r.regroup(gid, [2, 3])
    for _ in range(3):
        step([2, 3])
    for r in runners:
        r.regroup(gid, [3])
    while len(got[3]) < 12:
        step([3])
    assert got[1] == want[1][:5] and got[2] == want[2][:8] and got[3] == want[3]
    with pytest.raises(StageError, match="not open"):
        runners[0].regroup(gid, [3, 42])
    assert runners[0].groups[gid].members == [3]  # a refused regroup changes nothing
    with pytest.raises(StageError, match="twice"):
        runners[0].regroup(gid, [3, 3])
    with pytest.raises(StageError, match="1 rows"):
        runners[0].step_rows(gid, np.zeros((2, 1), np.int64), np.zeros((2, 1), np.int64))
    runners[0].regroup(gid, [])
    with pytest.raises(StageError, match="does not exist"):
        runners[0].step_rows(gid, np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64))


def test_rows_rewind_per_row_and_refuse_bad_counts(dp_export2) -> None:  # noqa: ANN001
    from dataplane.runtime.base import StageError

    runner = _runners(dp_export2)[0]
    for sid, n in ((1, 4), (2, 2)):
        runner.reset_stream(sid)
        runner.step(sid, np.arange(n)[None], np.arange(n))
    gid = 1 << 30
    runner.regroup(gid, [1, 2])
    assert runner.groups[gid].keep.sum(axis=1).tolist() == [4, 2]
    assert runner.masked_slots(gid) == 0
    runner.mask_rows_tail(gid, np.array([1, 2]))
    assert runner.groups[gid].keep.sum(axis=1).tolist() == [3, 0]
    assert runner.masked_slots(gid) == 1
    before = runner.groups[gid].keep.copy()
    for bad, why in (([1], "2 rows"), ([0, 1], "cannot rewind"), ([-1, 0], "cannot rewind")):
        with pytest.raises(StageError, match=why):
            runner.mask_rows_tail(gid, np.array(bad))
        np.testing.assert_array_equal(runner.groups[gid].keep, before)
    runner.regroup(gid, [1, 2])  # re-forming compacts: 3 and 0 kept slots
    assert runner.groups[gid].keep.shape == (2, 3) and runner.masked_slots(gid) == 0
