"""tools.decode.cluster: its drift-free estimator on the tiny model (the cluster's data plane
and the 1-stage chain stepped token by token), the baselines' turns around the cluster's
runs, and the figures of a run."""

from __future__ import annotations

import pytest

from tools.decode.cluster import interleaved


@pytest.mark.e2e
def test_interleaved_steps_cluster_and_stage1(tiny_exports, dp_hosts, tmp_path) -> None:
    two, one = tiny_exports.get([(0, 2), (2, 4)]), tiny_exports.get([(0, 4)])
    props = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    result = interleaved(two, one, 0, props, [0, 17, 42, 99, 5], 6, tmp_path)
    assert set(result["interleaved_step_ms"]) == {"stage1", "cluster"}
    assert all(v > 0 for v in result["interleaved_step_ms"].values())
    assert result["cluster_over_stage1_interleaved"] > 0


def test_time_per_token_splits_a_run_against_its_baseline() -> None:
    from tools.decode.cluster import time_per_token

    timing = {"stage0.compute": {"p50": 9.0}, "stage1.compute": {"p50": 9.5},
              "total": {"p50": 19.5}}
    split = time_per_token(50.0, 62.5, timing, 2)
    assert split == {"baseline_ms": 16.0, "cluster_ms": 20.0, "cluster_compute_ms": 18.5,
                     "cluster_wire_and_framework_ms": 1.0, "compute_over_baseline": 1.156}
    assert time_per_token(0.0, 0.0, {}, 2)["compute_over_baseline"] == 0.0


class _FakeBaseline:
    def __init__(self, name: str, tok_s: float, log: list[str]) -> None:
        self.name, self.tok_s, self.log = name, tok_s, log

    def generate_timed(self, prompt_ids: list[int], tokens: int) -> dict:
        self.log.append(self.name)
        return {"tok_s": self.tok_s}


def test_alternated_runs_swap_the_baselines_around_the_cluster(monkeypatch) -> None:
    from tools.decode import cluster

    log: list[str] = []

    def cluster_run(serve: str, prompt: str, tokens: int) -> dict:
        log.append("cluster")
        return {"tok_s": 40.0 + len(log), "timing": {}}

    monkeypatch.setattr(cluster, "cluster_run", cluster_run)
    base, thp = _FakeBaseline("base", 50.0, log), _FakeBaseline("thp", 52.0, log)
    base_runs, cluster_runs, thp_runs = cluster.alternated_runs(
        "tcp://x", base, thp, [1, 2], 4, 2)
    assert log == ["base", "cluster", "thp", "thp", "cluster", "base"]
    assert base_runs == [50.0, 50.0] and thp_runs == [52.0, 52.0] and len(cluster_runs) == 2
    log.clear()
    _, _, thp_runs = cluster.alternated_runs("tcp://x", base, None, [1, 2], 4, 1)
    assert log == ["base", "cluster"] and thp_runs == []


def test_cluster_figures_take_the_median_run_and_pair_each_run() -> None:
    from tools.decode.cluster import cluster_figures, thp_figures

    def run(tok_s: float, step: float) -> dict:
        return {"tok_s": tok_s, "timing": {"total": {"p50": step}, "overhead": {"p50": 0.4},
                                           "stage0.compute": {"p50": 9.0},
                                           "stage1.compute": {"p50": 9.5}}}

    cluster = [run(40.0, 25.0), run(50.0, 20.0), run(45.0, 22.0)]
    base = [50.0, 62.5, 60.0]
    fig = cluster_figures(2, base, cluster)
    assert fig["cluster_tok_s"] == 45.0 and fig["baseline_tok_s"] == 60.0
    assert fig["ratio"] == 0.75 and fig["ratio_paired"] == 0.8  # 0.8, 0.8, 0.75
    assert fig["step_ms_p50"] == 22.0 and fig["overhead_ms_per_hop"] == 0.2
    assert fig["compute_ms_p50"] == {"stage0": 9.0, "stage1": 9.5}
    assert fig["ms_per_token"]["baseline_ms"] == round(1e3 / 60.0, 3)  # beside the median run
    assert thp_figures(cluster, []) == {}
    assert thp_figures(cluster, [45.0, 45.0, 50.0])["ratio_vs_thp_baseline"] == 1.0
