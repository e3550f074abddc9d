"""tools/spec/speedup.py: the comparison and accounting helpers, and the whole benchmark on a
tiny random 2-stage export (lookup and draft-model drafting, a few tokens)."""

from __future__ import annotations

import json

import pytest

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.stateful import StageRunner
from tools.harness.options import parse_k
from tools.spec.accounting import (
    all_identical,
    first_mismatch,
    theoretical_iid,
    theoretical_speedup,
)
from tools.spec.prompts import BenchPrompt
from tools.spec.speedup import render, run_bench

EXACT = RuntimeSpec(precision="f32", kv_cache_precision="f32")


def test_comparison_helpers() -> None:
    a = [5, 6, 7, 8]
    assert first_mismatch(a, list(a)) is None
    assert first_mismatch(a, [5, 6, 9, 8]) == 2
    assert first_mismatch(a, a[:3]) == 3 and first_mismatch(a[:3], a) == 3
    assert all_identical([(a, list(a)), ([1], [1])])
    mutated = list(a)
    mutated[-1] += 1
    assert not all_identical([(a, list(a)), (a, mutated)])  # one bad token flips it
    assert not all_identical([])  # nothing compared proves nothing


def test_theory_helpers() -> None:
    def c(fed: int) -> float:
        return 10.0 + 2.0 * (fed - 1)

    def free(n: int) -> float:
        return 0.0

    # 8 tokens in 2 steps of 5 fed (4 accepted + bonus... 4 + 4): 80 / (18 + 18)
    assert theoretical_speedup(8, [5, 5], [4, 4], c, free) == pytest.approx(80 / 36)
    # lookup misses: steps that fed only the last token cost what greedy costs
    assert theoretical_speedup(3, [1, 1, 1], [0, 0, 0], c, free) == pytest.approx(1.0)
    assert theoretical_speedup(3, [1, 1, 1], [0, 0, 0], c, lambda n: 1.0) < 1.0
    assert theoretical_iid(1.0, 4, c, free) == pytest.approx(5 * 10 / 18)
    assert theoretical_iid(0.0, 4, c, free) == pytest.approx(10 / 18)
    assert parse_k("auto") is None and parse_k("3") == 3


def test_run_bench_on_a_tiny_export(tiny_exports, capsys) -> None:
    chain = LocalChain.load(str(tiny_exports.get([(0, 2), (2, 4)])), EXACT)
    draft = StageRunner(tiny_exports.get([(0, 4)]), 0, EXACT)
    repeat = [0, 11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12, 13]
    prompts = [(BenchPrompt("repeat", "code", ""), repeat),
               (BenchPrompt("plain", "chat", ""), [0, 17, 42, 99, 5, 230, 7])]
    result = run_bench(chain, prompts, 24, draft_runner=draft, k=4, k_max=4, draft_k=3,
                       runs=1, calib_reps=2, rewind_slots=40, rewind_reps=5)
    json.dumps(result)  # one JSON object
    for key in ("identical", "achieved_over_theoretical", "mask_rewind_ms", "trim_rewind_ms",
                "prompts", "step_costs"):
        assert key in result
    assert result["identical"] is True
    assert len(result["prompts"]) == 2
    for entry in result["prompts"]:
        assert entry["identical"]
        for drafter in ("lookup", "draft"):
            x = entry[drafter]
            for key in ("acceptance", "k", "spec_tok_s", "achieved_speedup",
                        "theoretical_speedup", "achieved_over_theoretical", "time"):
                assert key in x
            assert x["theoretical_speedup"] > 0 and x["identical"]
    # the target itself drafting: everything it proposes is accepted
    assert all(e["draft"]["acceptance"] == 1.0 for e in result["prompts"])
    assert result["prompts"][0]["lookup"]["acceptance"] > 0
    assert result["mask_rewind_ms"] >= 0 and result["trim_rewind_ms"] > 0
    # timed, not defaulted: every stage's calls measured (a mask_tail takes microseconds,
    # far above the 10 ns the figures are rounded to), and the medians of their union lie
    # between the stages' own medians
    assert (result["rewind_slots"], result["rewind_count"], result["rewind_reps"]) == (40, 4, 5)
    for kind in ("mask", "trim"):
        per_stage = result[f"{kind}_rewind_stage_ms"]
        assert len(per_stage) == 2 and min(per_stage) > 0, per_stage
        assert min(per_stage) <= result[f"{kind}_rewind_ms"] <= max(per_stage)
    render(result, ["lookup", "draft"])  # the Rich table (without --json)
    table = capsys.readouterr().out
    assert "identical: True" in table and "rewind per call" in table
