"""The MoE benchmark's ratios and targets from tok/s samples, and its --json object's shape
(no model)."""

from __future__ import annotations

import json

import pytest

from tools.moe.bench import interleaved_runs, moe_result
from tools.moe.targets import TARGETS, judge, moe_ratios

SAMPLES = {  # two runs; the baseline opens and closes each
    "baseline": [100.0, 110.0, 90.0, 110.0],
    "stage1": [105.0, 95.0],
    "cluster": [94.5, 80.0],
    "experts-256": [94.5, 104.5],
    "dense-equal": [21.0, 19.0],
}


def test_ratios_pair_each_run_with_its_own_baseline_and_twin() -> None:
    ratios = moe_ratios(SAMPLES)
    # stage1 over each run's bracket mean (105, 100): 1.0 and 0.95, median 0.975
    assert ratios["stage1 / openvino_genai"] == pytest.approx(0.975)
    assert ratios["cluster / openvino_genai"] == pytest.approx((0.9 + 0.8) / 2, abs=1e-3)
    assert ratios["experts-256 / experts-128"] == pytest.approx((0.9 + 1.1) / 2, abs=1e-3)
    assert ratios["|experts-256 / experts-128 - 1|"] == pytest.approx(0.0, abs=1e-3)
    assert ratios["experts-128 / dense-equal"] == 5.0


def test_targets_say_value_bound_and_whether_met() -> None:
    targets = judge(moe_ratios(SAMPLES))
    assert set(targets) == set(TARGETS)
    assert targets["1 stage vs openvino_genai"] == {
        "value": 0.975, "target": 0.95, "kind": "at_least", "met": True}
    assert targets["2-node cluster vs openvino_genai"]["met"] is False  # 0.85 < 0.90
    assert targets["tok/s change, twice the experts"]["met"] is True
    assert targets["MoE vs dense of equal parameters"]["met"] is True  # 5.0 >= 5


def test_a_target_is_judged_on_the_ratio_not_on_its_rounded_figure() -> None:
    samples = {**SAMPLES, "stage1": [99.712, 94.96]}  # 0.9496 of both runs' baselines
    verdict = judge(moe_ratios(samples))["1 stage vs openvino_genai"]
    assert verdict["value"] == 0.95 and verdict["met"] is False


def test_a_change_of_15_percent_or_more_misses_the_doubling_target() -> None:
    samples = {**SAMPLES, "experts-256": [89.25, 80.75]}  # 0.85 both runs
    verdict = judge(moe_ratios(samples))["tok/s change, twice the experts"]
    assert verdict["value"] == pytest.approx(0.15) and verdict["met"] is False


def test_without_a_baseline_its_targets_are_unmeasured_not_failed() -> None:
    samples = {name: values for name, values in SAMPLES.items() if name != "baseline"}
    targets = judge(moe_ratios(samples))
    assert targets["1 stage vs openvino_genai"] == {
        "value": None, "target": 0.95, "kind": "at_least", "met": None}
    assert targets["MoE vs dense of equal parameters"]["met"] is True


@pytest.mark.parametrize("broken", [
    {"baseline": [100.0, 110.0, 90.0]},  # a run without its closing baseline
    {"cluster": [94.5]},  # a run short
    {"stage1": []},
])
def test_sample_counts_that_do_not_match_the_runs_are_refused(broken: dict) -> None:
    with pytest.raises(ValueError):
        moe_ratios({**SAMPLES, **broken})


def test_runs_interleave_with_the_baseline_around_each_and_the_json_holds_it_all() -> None:
    calls: list[str] = []
    figures = {"baseline": 100.0, "stage1": 100.0, "cluster": 95.0, "experts-256": 99.0,
               "dense-equal": 20.0}

    def system(name: str):
        def run() -> float:
            calls.append(name)
            return figures[name]
        return run

    samples = interleaved_runs({name: system(name) for name in figures}, runs=2)
    assert calls[:6] == ["baseline", "stage1", "cluster", "experts-256", "dense-equal",
                         "baseline"]
    assert calls[6:] == ["baseline", "cluster", "experts-256", "dense-equal", "stage1",
                         "baseline"]
    result = json.loads(json.dumps(moe_result({"layers": 2}, samples)))
    assert result["tok_s"]["cluster"] == 95.0
    assert result["ratios"]["experts-128 / dense-equal"] == 5.0
    assert result["targets"]["2-node cluster vs openvino_genai"] == {
        "value": 0.95, "target": 0.9, "kind": "at_least", "met": True}
    assert result["samples"]["baseline"] == [100.0] * 4


def test_the_cluster_split_is_the_median_runs_compute_and_the_rest() -> None:
    from tools.moe.bench import ClusterSystem

    def run(tok_s: float, step: float) -> dict:
        return {"tok_s": tok_s, "timing": {"total": {"p50": step},
                                           "stage0.compute": {"p50": 3.0},
                                           "stage1.compute": {"p50": step - 5.0}}}

    cluster = ClusterSystem("tcp://127.0.0.1:1", 8)
    cluster.runs = [run(90.0, 11.0), run(125.0, 8.0), run(130.0, 7.5)]
    assert cluster.split(2) == {"step_ms": 8.0, "stage0_compute_ms": 3.0,
                                "stage1_compute_ms": 3.0, "wire_and_framework_ms": 2.0}


@pytest.mark.parametrize("args, says", [
    (["--layers", "1"], "--layers must be >= 2 for the 2-node cluster"),
    (["--layers", "0", "--no-cluster"], "--layers must be >= 1"),
    (["--tokens", "1"], "--tokens must be >= 2"),
    (["--runs", "0"], "--runs >= 1"),
    (["--placement", "spread"], "placement must be one of shared, split"),
])
def test_bad_options_are_refused_before_any_model_is_touched(args, says, tmp_path,
                                                             monkeypatch) -> None:
    import typer
    from typer.testing import CliRunner

    from tools.moe.bench import main

    monkeypatch.setenv("ZCTL_HOME", str(tmp_path))
    app = typer.Typer()
    app.command()(main)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert says in " ".join(result.output.split()).replace("│", "").replace("  ", " ")
    assert list(tmp_path.iterdir()) == []
