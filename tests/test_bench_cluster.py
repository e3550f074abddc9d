"""tools/bench_cluster's drift-free estimator on the tiny model: the cluster's data plane
and the 1-stage chain stepped token by token."""

from __future__ import annotations

import pytest

from tools.bench_cluster import interleaved
from tools.bench_overhead import cluster_pipeline


@pytest.mark.slow
def test_interleaved_steps_cluster_and_stage1(tiny_exports, dp_hosts) -> None:
    two, one = tiny_exports.get([(0, 2), (2, 4)]), tiny_exports.get([(0, 4)])
    props = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    result = interleaved(two, one, 2, 0, props, [0, 17, 42, 99, 5], 6)
    assert set(result["interleaved_step_ms"]) == {"stage1", "cluster"}
    assert all(v > 0 for v in result["interleaved_step_ms"].values())
    assert result["cluster_over_stage1_interleaved"] > 0


@pytest.mark.slow
def test_cluster_pipeline_equals_the_local_chain(tiny_exports, dp_hosts) -> None:
    from dataplane.generate import LocalChain
    from dataplane.runtime import RuntimeConfig
    from dataplane.scheduler import generate_greedy

    export = tiny_exports.get([(0, 2), (2, 4)])
    local = LocalChain.load(str(export), RuntimeConfig())
    with cluster_pipeline(str(export), 2) as pipe:
        got = list(generate_greedy(pipe, [0, 17, 42], 8))
        assert pipe.stats.errors == 0
    assert got == list(generate_greedy(local, [0, 17, 42], 8)) and len(got) == 8


def test_host_ms_per_token_is_decode_time_minus_stage_time() -> None:
    from dataplane.generate import GenerationStats
    from tools.bench_overhead import host_ms_per_token

    stats = GenerationStats(new_tokens=3, decode_ms=30.0, stage_ms=[[6.0, 7.5], [6.5, 7.0]])
    assert host_ms_per_token(stats) == 30.0 / 2 - 13.5
    assert host_ms_per_token(GenerationStats(new_tokens=1)) == 0.0


def test_time_per_token_splits_a_run_against_its_baseline() -> None:
    from tools.bench_cluster import time_per_token

    timing = {"stage0.compute": {"p50": 9.0}, "stage1.compute": {"p50": 9.5},
              "total": {"p50": 19.5}}
    split = time_per_token(50.0, 62.5, timing, 2)
    assert split == {"baseline_ms": 16.0, "cluster_ms": 20.0, "cluster_compute_ms": 18.5,
                     "cluster_wire_and_framework_ms": 1.0, "compute_over_baseline": 1.156}
    assert time_per_token(0.0, 0.0, {}, 2)["compute_over_baseline"] == 0.0
