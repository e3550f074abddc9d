"""zctl bench plan without clusters: the case table and what runs here, the CPU quota's
arithmetic and its SIGSTOP/SIGCONT fallback, the error arithmetic, the targets and the
JSON the command prints."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from controlplane.records import PredictionStatus, StreamsPrediction
from tools.plan import cli, measure
from tools.plan.cases import CASES, QUICK, Case, select_cases
from tools.plan.report import case_report, pipeline_terms, print_report, stream_figures, targets
from tools.plan.throttle import Quota, SlowedNode, cgroup_kind, group_members


def prediction(one: float = 100.0, eight: float = 400.0) -> PredictionStatus:
    return PredictionStatus(one, [StreamsPrediction(1, one, 1, 1),
                                  *[StreamsPrediction(n, eight * n / 8, 2, -(-n // 2))
                                    for n in range(2, 9)]],
                            ["c", "n1"], [5.0, 4.0], [0.3, 0.2], 2)


def outcome(measured: dict[int, list[float]], case: str = "smollm2-2n-split",
            predicted: PredictionStatus | None = None) -> dict[str, Any]:
    return {"setup": CASES[case].setup(), "placement": [{"stage": 0, "node": "c",
                                                         "layers": [0, 15]}],
            "prediction": predicted or prediction(), "slowed_by": None, "measured": measured}


# -- the cases -------------------------------------------------------------------------------
def test_quick_all_and_names_select_cases_and_split_ones_need_a_core_each() -> None:
    cases, skipped = select_cases("quick", cores=2)
    assert [c.name for c in cases] == list(QUICK) and skipped == {}
    cases, skipped = select_cases("all", cores=2)
    assert "8b-4n-shared" not in [c.name for c in cases]  # opt-in: named only
    assert "tiny-2n-shared" not in [c.name for c in cases]
    assert "3 nodes with a core each need 3 cores" in skipped["smollm2-3n-split"]
    assert "smollm2-3n-shared" in [c.name for c in cases]
    cases, skipped = select_cases("8b-4n-shared, smollm2-2n-split,smollm2-2n-split", cores=4)
    assert [c.name for c in cases] == ["8b-4n-shared", "smollm2-2n-split"] and not skipped


def test_the_table_holds_what_the_issue_asks_for() -> None:
    table = CASES.values()
    assert {(c.model, c.nodes) for c in table} >= {("smollm2-135m", 2), ("smollm2-135m", 3),
                                                  ("random-1b", 2), ("random-8b", 4)}
    assert {c.cpu_sets for c in table if c.model == "smollm2-135m"} == {"split", "shared"}
    assert {c.delay_ms for c in table} >= {0.0, 10.0, 50.0}
    assert any(c.slow_share for c in table)
    assert CASES["8b-4n-shared"].weights == "int4" and CASES["8b-4n-shared"].opt_in


@pytest.mark.parametrize(("text", "why"), [("nope", "unknown case 'nope'"),
                                           (" , ", "names no case")])
def test_bad_case_names_are_refused(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        select_cases(text, cores=2)


@pytest.mark.parametrize("kw", [{"nodes": 1}, {"cpu_sets": "some"}, {"delay_ms": -1.0},
                                {"slow_share": 1.0}, {"slow_share": -0.5}])
def test_impossible_cases_are_refused(kw: dict[str, Any]) -> None:
    fields = {"name": "x", "model": "m", "weights": "int4", "nodes": 2, "cpu_sets": "split", **kw}
    with pytest.raises(ValueError, match="case x"):
        Case(**fields)


# -- the slowed node -------------------------------------------------------------------------
def test_a_share_of_a_core_is_a_quota_of_each_period() -> None:
    quota = Quota.of(0.5, period_s=0.02)
    assert (quota.quota_us, quota.period_us) == (10_000, 20_000)
    assert quota.duty() == pytest.approx((0.01, 0.01))
    assert Quota.of(0.01, period_s=0.02).quota_us == 1000  # never under the kernel's 1 ms
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"in \(0, 1\)"):
            Quota.of(bad)


def test_the_cgroup_kind_is_read_from_the_hierarchy(tmp_path: Path) -> None:
    assert cgroup_kind(tmp_path) == ""
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    assert cgroup_kind(tmp_path) == "v1"
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory")
    assert cgroup_kind(tmp_path) == "v2"


def test_a_process_groups_members_are_found_in_proc(tmp_path: Path) -> None:
    for pid, pgid in ((10, 10), (11, 10), (12, 99)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python (x)) S 1 {pgid} {pgid} 0")
    (tmp_path / "self").mkdir()
    assert group_members(10, tmp_path) == [10, 11]


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def test_without_a_cgroup_the_node_is_stopped_and_continued_in_turn(tmp_path: Path) -> None:
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        seen = set()
        with SlowedNode(child.pid, 0.5, root=tmp_path) as slowed:  # no cgroup there
            assert slowed.method == "SIGSTOP/SIGCONT duty cycle"
            deadline = time.monotonic() + 5.0
            while not {"T", "S"} <= seen and time.monotonic() < deadline:
                seen.add(state(child.pid))
                time.sleep(0.001)
        assert {"T", "S"} <= seen  # stopped, and sleeping (running) in between
        assert state(child.pid) != "T"  # continued when it ends
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(("kind", "files"), [
    ("v2", {"cpu.max": "10000 20000"}),
    ("v1", {"cpu.cfs_period_us": "20000", "cpu.cfs_quota_us": "10000"})])
def test_a_cgroup_gets_the_quota_and_the_nodes_processes(tmp_path: Path, kind: str,
                                                         files: dict[str, str]) -> None:
    base = tmp_path if kind == "v2" else tmp_path / "cpu"  # a hierarchy of plain files
    base.mkdir(exist_ok=True)
    if kind == "v2":
        (tmp_path / "cgroup.controllers").write_text("cpu memory")
    else:
        (base / "cpu.cfs_quota_us").write_text("-1")
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        with SlowedNode(child.pid, 0.5, root=tmp_path) as slowed:
            assert slowed.method == f"cgroup {kind} CPU quota"
            (group,) = [d for d in base.iterdir() if d.name.startswith("zctl-bench-")]
            for name, text in files.items():
                assert (group / name).read_text() == text
            assert (group / "cgroup.procs").read_text() == str(child.pid)
        assert (base / "cgroup.procs").read_text() == str(child.pid)  # moved back after
    finally:
        child.kill()
        child.wait()


# -- the errors, targets and JSON -------------------------------------------------------------
def test_a_stream_counts_error_is_against_the_median_of_its_runs() -> None:
    got = stream_figures(prediction(), 1, [90.0, 80.0, 200.0])
    assert got["measured_tok_s"] == 90.0 and got["predicted_tok_s"] == 100.0
    assert got["error"] == pytest.approx(10 / 90, abs=1e-4)
    assert (got["row_groups"], got["rows"]) == (1, 1)
    with pytest.raises(ValueError, match="no measured runs"):
        stream_figures(prediction(), 8, [])


def _timing(stage0: float, stage1: float, total: float) -> dict[str, dict[str, float]]:
    """A one-stream round's step timing as the engine reports it (p50 and p95 of each)."""
    p50 = {"stage0.compute": stage0, "stage1.compute": stage1, "hop0-1.serialise": 0.1,
           "hop0-1.queue": 0.0, "hop0-1.network": 0.3, "hop1-2.serialise": 0.05,
           "hop1-2.queue": 0.01, "hop1-2.network": 0.2, "total": total, "transit": 0.5,
           "network": 0.5, "overhead": 0.25}
    return {name: {"p50": value, "p95": 2 * value} for name, value in p50.items()}


def test_one_stream_s_token_is_set_term_by_term_against_the_pipeline_s_own_timing() -> None:
    rounds = [_timing(5.0, 6.0, 11.0), _timing(5.5, 6.5, 12.0), _timing(9.0, 9.0, 19.0)]
    got = pipeline_terms(rounds, [80.0, 75.0, 50.0])
    assert got["stage_ms"] == [5.5, 6.5]  # each the median of the rounds' p50s
    assert got["hop_ms"] == [0.4, 0.26]  # serialisation, queueing and network
    assert got["overhead_ms"] == 0.25
    assert got["token_ms"] == pytest.approx(1e3 / 75.0, abs=1e-3)  # the median round's
    assert got["between_ms"] == pytest.approx(1e3 / 75.0 - 12.0, abs=1e-3)
    assert pipeline_terms([], [80.0]) == {} and pipeline_terms([{}], [80.0]) == {}
    three = {**_timing(1.0, 1.0, 3.0), "stage2.compute": {"p50": 1.0, "p95": 1.0}}
    with pytest.raises(ValueError, match="different stages"):
        pipeline_terms([_timing(1.0, 1.0, 3.0), three], [80.0, 80.0])
    report = case_report({**outcome({1: [80.0, 75.0, 50.0], 8: [400.0]}), "timing": rounds})
    assert report["measured_terms"] == got
    assert report["predicted_token_ms"] == 10.0  # one stream predicted at 100 tok/s
    assert case_report(outcome({1: [80.0], 8: [400.0]}))["measured_terms"] == {}
    assert case_report({**outcome({1: [80.0], 8: [400.0]}), "speed_factors": {"c": 1.3}}
                       )["speed_factors"] == {"c": 1.3}


def test_the_printed_report_names_the_terms(capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    case = case_report({**outcome({1: [75.0], 8: [400.0]}), "timing": [_timing(5.5, 6.5, 12.0)]})
    print_report({"cpu": "cpu", "date": "today", "commit": "abc", "cases": {"split": case},
                  "skipped": {}, "targets": targets({"split": case})}, Console(width=200))
    out = capsys.readouterr().out
    assert "split, one stream's token (ms): predicted steps 5, 4, hops 0.3, 0.2" in out
    assert "measured compute 5.5, 6.5, hops 0.4, 0.26, overhead 0.25" in out


def _status(predicted: bool, checked: dict[str, float]) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(
        prediction=prediction() if predicted else None,
        stages=[SimpleNamespace(node_id=n) for n in checked],
        nodes=[SimpleNamespace(node_id=n, reference_s=s) for n, s in checked.items()]
        + [SimpleNamespace(node_id="spare", reference_s=0.0)])


@pytest.mark.parametrize(("grace", "returned"), [(60.0, 2), (0.0, 1)])
def test_the_prediction_is_read_once_every_stage_s_node_has_checked_its_speed(
        monkeypatch: pytest.MonkeyPatch, grace: float, returned: int) -> None:
    import controlplane.client as client

    statuses = [_status(False, {"c": 0.0, "n1": 0.0}), _status(True, {"c": 0.004, "n1": 0.0}),
                _status(True, {"c": 0.004, "n1": 0.005})]
    asked = iter(statuses)
    monkeypatch.setattr(client, "query_status", lambda *a, **kw: next(asked))
    monkeypatch.setattr(measure.time, "sleep", lambda s: None)
    assert measure.speed_unchecked(statuses[1]) == ["n1"]  # the spare runs no stage
    record = type("Record", (), {"control": "tcp://c:5550"})()
    got = measure.wait_prediction(record, 60.0, speed_grace_s=grace,  # type: ignore[arg-type]
                                  speed_settle_s=0.0)
    assert got is statuses[returned]


def test_targets_take_the_worst_case_and_a_failed_case_misses_them() -> None:
    cases = {"a": case_report(outcome({1: [100.0], 8: [400.0]})),
             "b": case_report(outcome({1: [125.0], 8: [500.0]}))}  # predicted 20% too slow
    got = targets(cases)
    assert got["1 stream within 15%"] == {"value": 0.2, "target": 0.15, "met": False}
    assert got["8 streams within 25%"] == {"value": 0.2, "target": 0.25, "met": True}
    cases["c"] = {"failed": "the cluster did not start"}
    assert not targets(cases)["8 streams within 25%"]["met"]
    assert targets({})["1 stream within 15%"] == {"value": None, "target": 0.15, "met": False}


def test_the_command_prints_one_json_object_of_every_case(monkeypatch: pytest.MonkeyPatch,
                                                          zctl_home: Path) -> None:
    ran: list[tuple[str, int, int]] = []

    def fake_run(case: Case, root: Path, tokens: int, rounds: int,
                 timeout_s: float) -> dict[str, Any]:
        ran.append((case.name, tokens, rounds))
        if case.name == "smollm2-2n-10ms":
            raise RuntimeError("no prediction after 600 s: node n1 has no profile: measuring")
        return outcome({1: [95.0] * rounds, 8: [420.0] * rounds}, case.name)

    monkeypatch.setattr(measure, "run_case", fake_run)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    app = typer.Typer()
    app.command()(cli.main)
    result = CliRunner().invoke(app, ["--cases", "smollm2-2n-split,smollm2-2n-10ms,"
                                      "smollm2-3n-split", "--tokens", "16", "--rounds", "2",
                                      "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert ran == [("smollm2-2n-split", 16, 2), ("smollm2-2n-10ms", 16, 2)]
    split = report["cases"]["smollm2-2n-split"]
    assert split["streams"]["1"]["error"] == pytest.approx(5 / 95, abs=1e-4)
    assert set(split["streams"]["8"]) >= {"predicted_tok_s", "measured_tok_s", "error"}
    assert "has no profile" in report["cases"]["smollm2-2n-10ms"]["failed"]
    assert "need 3 cores" in report["skipped"]["smollm2-3n-split"]
    assert set(report["targets"]) == {"1 stream within 15%", "8 streams within 25%"}
    assert all(set(t) == {"value", "target", "met"} for t in report["targets"].values())
    assert not report["targets"]["1 stream within 15%"]["met"]  # a case failed
    assert {"cpu", "date", "commit"} <= set(report)


@pytest.mark.parametrize(("args", "why"), [(["--cases", "nope"], "unknown case"),
                                           (["--tokens", "1"], "--tokens >= 2")])
def test_bad_options_are_refused(args: list[str], why: str) -> None:
    app = typer.Typer()
    app.command()(cli.main)
    result = CliRunner(env={"COLUMNS": "400"}).invoke(app, args)
    assert result.exit_code == 2 and why in result.output


def test_the_prediction_waits_for_the_nodes_next_speed_checks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    import controlplane.client as client

    now = [0.0]
    statuses = [_status(True, {"c": 0.004, "n1": 0.005}) for _ in range(8)]
    asked = iter(statuses)
    monkeypatch.setattr(client, "query_status", lambda *a, **kw: next(asked))
    monkeypatch.setattr(measure, "time", SimpleNamespace(
        monotonic=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)))
    record = type("Record", (), {"control": "tcp://c:5550"})()
    got = measure.wait_prediction(record, 60.0, speed_settle_s=3.0)  # type: ignore[arg-type]
    assert got is statuses[3]  # checked at 0 s, read again at 1, 2 and 3 s
