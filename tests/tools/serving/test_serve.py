"""tools.serving.serve: the HTTP layer's cost against the engine driven directly, the
report's keys and targets, rounds paired up; and (slow) a run against the real zctl serve
on a local cluster of the tiny model, torn down after."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest
from rich.console import Console

from tests.tools.harness.test_load import record
from tools.harness.load import LevelRun, ServeRequest, request_set, served_model, summarize
from tools.serving.serve import (
    Plan,
    level_row,
    overhead_figures,
    overhead_steps,
    paired_rounds,
    pool,
    print_table,
    report,
    targets,
    warmup_set,
)


def test_overhead_figures() -> None:
    direct = [record(0, 0.0, [0.1, 0.9], 100), record(1, 0.0, [0.1, 1.999], 200)]
    http = [record(0, 0.0, [0.1, 0.9], 100), record(1, 0.0, [0.1, 2.059], 200)]
    o = overhead_figures(direct, http)
    # direct: 300 tokens in 0.901 + 2.0 s; http 300 in 0.901 + 2.06 s
    assert o["direct_tok_s"] == pytest.approx(300 / 2.901, abs=0.01)
    assert o["http_overhead"] == pytest.approx(1 - 2.901 / 2.961, abs=1e-3)
    assert o["ratio"] == pytest.approx(2.901 / 2.961, abs=1e-3)
    assert o["http_overhead_paired"] == pytest.approx((0 + 0.06 / 2.06) / 2, abs=1e-3)
    assert o["same_tokens"] == 2 and o["errors"] == o["http_errors"] == 0
    assert o["pairs"][1] == {"index": 1, "tokens": [200, 200], "direct_s": 2.0, "http_s": 2.06}
    # TPOT: 0.8/99 both for request 0; 1.899/199 against 1.959/199 for request 1
    assert o["http_tpot_over_direct_paired"] == pytest.approx((1 + 1.959 / 1.899) / 2, abs=1e-4)
    failed = overhead_figures(direct, [record(0, 0.0, [], 0, "x"), http[1]])
    assert failed["http_errors"] == 1 and failed["same_tokens"] == 1


def test_each_overhead_pair_finds_its_prompt_cached_by_a_warm_request_first() -> None:
    requests = request_set(3)
    steps = overhead_steps(requests)
    assert [path for path, _ in steps] == ["warm", "direct", "http", "warm", "http", "direct",
                                           "warm", "direct", "http"]
    for i, request in enumerate(requests):
        warm, first, second = steps[3 * i:3 * i + 3]
        assert warm[1].max_tokens == 1 and warm[1].prompt == request.prompt
        assert first[1] == second[1] == request


# -- the report ------------------------------------------------------------------------------------


def _summary(n: int, tok_s: float, errors: int = 0) -> dict[str, Any]:
    return {"concurrency": n, "tok_s": tok_s, "ttft_ms": {"p50": 1.0, "p99": 2.0},
            "itl_ms": {"p50": 3.0, "p99": 4.0}, "tpot_ms": {"p50": 2.0, "p99": 3.0},
            "tokens_per_chunk": 1.0, "errors": errors}


def test_targets_and_report_keys() -> None:
    rows = [level_row(_summary(1, 50.0), _summary(1, 100.0)),
            level_row(_summary(8, 210.0), _summary(8, 200.0))]
    assert rows[0]["ratio"] == 0.5 and rows[1]["ratio"] == 1.05
    t = targets(rows, 0.02)
    assert t["zero_errors"]["met"] and t["http_overhead"]["met"] and t["ratio_at_8"]["met"]
    missed = targets([level_row(_summary(8, 150.0, errors=1), _summary(8, 200.0))], 0.05, 0.01)
    assert not any(v["met"] for v in missed.values()) and missed["zero_errors"]["value"] == 1
    assert missed["http_overhead"]["met_paired"] and missed["http_overhead"]["paired"] == 0.01
    assert targets([level_row(_summary(4, 1.0), None)], None)["ratio_at_8"]["met"] is None
    overhead = overhead_figures([record(0, 0.0, [0.5], 10)], [record(0, 0.0, [0.5], 10)])
    result = json.loads(json.dumps(report(rows, overhead, {"requests": 2})))
    assert {"cpu", "date", "commit", "levels", "http_overhead", "targets"} <= set(result)
    assert result["cpu"] and result["commit"]
    for row in result["levels"]:
        assert {"concurrency", "zctl_tok_s", "genai_cb_tok_s", "ratio", "ttft_ms", "itl_ms",
                "genai_ttft_ms", "genai_itl_ms", "errors", "genai_errors"} <= set(row)
        assert set(row["ttft_ms"]) == {"p50", "p99"} == set(row["itl_ms"])
    skipped = level_row(_summary(4, 1.0), None)
    assert skipped["genai_cb_tok_s"] is None and skipped["ratio"] is None
    printed = io.StringIO()
    print_table(report([*rows, skipped], overhead, {}), Console(file=printed, width=250))
    text = printed.getvalue()
    assert "1.05x" in text and "target ratio_at_8" in text and "overhead" in text


def test_rounds_pair_up_and_the_ratio_is_their_median() -> None:
    def run(tokens: int, wall: float) -> LevelRun:
        return LevelRun(8, [record(0, 0.0, [0.5], tokens)], wall_s=wall)

    # the machine slows down in the second round: both systems feel it
    zctl = [run(100, 1.0), run(100, 2.0), run(100, 1.0)]    # 100, 50, 100 tok/s
    genai = [run(100, 1.25), run(100, 2.0), run(100, 0.8)]  # 80, 50, 125 tok/s
    assert paired_rounds(zctl, genai) == ([100.0, 50.0, 100.0], [80.0, 50.0, 125.0])
    pooled = pool(zctl)
    assert len(pooled.records) == 3 and pooled.wall_s == 4.0 and pooled.concurrency == 8
    row = level_row(summarize(pool(zctl)), summarize(pool(genai)), paired_rounds(zctl, genai))
    assert row["ratio"] == 1.0 and row["round_ratios"] == [1.25, 1.0, 0.8]
    assert row["zctl_tok_s"] == 75.0 and row["genai_cb_tok_s"] == round(300 / 4.05, 2)
    # one round: the two summaries' ratio, as before
    assert level_row(summarize(zctl[0]), summarize(genai[0]), paired_rounds(zctl[:1], genai[:1]))[
        "ratio"] == 1.25
    # no baseline, or a baseline round that served nothing: no pair
    assert paired_rounds(zctl, []) == ([], []) and paired_rounds(zctl, [run(0, 1.0)]) == ([], [])
    assert level_row(summarize(zctl[0]), None, paired_rounds(zctl, []))["ratio"] is None
    with pytest.raises(ValueError, match="no rounds"):
        pool([])


def test_warmup_set_covers_the_largest_level_with_short_requests() -> None:
    plan = Plan([1, 16], request_set(4), 2)
    warm = warmup_set(plan)
    assert len(warm) == 16 and {r.max_tokens for r in warm} == {8}


# -- the whole run on a real local cluster and zctl serve (the tiny model, no genai) -------------


@pytest.mark.e2e
def test_a_run_on_a_real_cluster_and_server_is_torn_down(tiny_exports, tmp_path) -> None:
    import httpx

    from tools.harness.cluster import served_cluster
    from tools.serving.serve import run_levels
    from zctl.launcher.processes import runtime_spec

    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    requests = [ServeRequest(i, f"tell me about the number {i}", 6 + i) for i in range(6)]
    plan = Plan([1, 3], requests, 3)
    home = tmp_path / "home"
    with served_cluster(export_dir, 2, runtime_spec("f32", None, "CPU"), home,
                        timeout_s=120) as served:
        assert (home / "cluster.json").is_file()
        rows, overhead = run_levels(plan, served.api, served.serve, None)
    assert not (home / "cluster.json").exists()  # the cluster is down
    with pytest.raises(httpx.ConnectError):  # and the server with it
        asyncio.run(served_model(served.api))
    assert [r["concurrency"] for r in rows] == [1, 3] and all(r["errors"] == 0 for r in rows)
    assert all(r["zctl"]["completion_tokens"] > 0 and r["genai_cb_tok_s"] is None for r in rows)
    assert rows[0]["zctl"]["completion_tokens"] == rows[1]["zctl"]["completion_tokens"]
    assert overhead["errors"] == overhead["http_errors"] == 0
    assert overhead["same_tokens"] == 3 and overhead["http_overhead"] is not None
