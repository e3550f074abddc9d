"""tools.bench_batching: B streams as rows of one request give the same tokens as B requests."""

from __future__ import annotations

import numpy as np

from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.kv.masks import MASK_MIN
from tools.bench_batching import measure, prefill_mask

EXACT = RuntimeSpec(precision="f32", kv_cache_precision="f32")
PROMPTS = [[0, 17, 33, 90, 12, 250, 7], [5, 6, 7], [100, 3, 9, 44, 2], [8]]


def test_prefill_mask_left_pads_each_row() -> None:
    mask = prefill_mask([3, 1])
    assert mask.shape == (2, 1, 3, 3) and mask.dtype == np.float32
    seen = mask[:, 0] == 0
    assert seen[0].tolist() == np.tril(np.ones((3, 3), bool)).tolist()
    # row 1: two padding slots, each sees only itself; the real token sees only itself too
    assert seen[1].tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    assert (mask[mask != 0] == MASK_MIN).all()


def test_batched_rows_match_separate_streams(tiny_exports) -> None:
    export = tiny_exports.get([(0, 4)])
    result = measure(export, [1, 2, 4], tokens=6, runs=1, config=EXACT, prompts=PROMPTS)
    assert set(result) == {"1", "2", "4"}
    for b, r in result.items():
        (sample,) = r["samples"]
        assert sample["rows_identical"] == int(b), sample
        assert r["separate_step_ms"] > 0 and r["batched_step_ms"] > 0 and r["ratio"] > 0
