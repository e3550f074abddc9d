"""tools.decode.microbatch: scaling paired with each run's own single stream, and every mode
run each run, the cluster's memory per extra stream measured."""

from __future__ import annotations

import pytest


def test_microbatch_paired_scaling_divides_each_run_by_its_own_single_stream() -> None:
    from tools.decode.microbatch import paired_scaling

    samples = {"1": [20.0, 30.0, 25.0], "2": [38.0, 57.0, 45.0], "4": [50.0, 75.0, 60.0]}
    assert paired_scaling(samples) == pytest.approx({"1": 1.0, "2": 1.9, "4": 2.5})


def test_microbatch_runs_every_mode_each_run_and_measures_memory(monkeypatch) -> None:
    from tools.decode import microbatch

    calls: list[tuple[int, str]] = []

    def cluster_aggregate(serve: str, prompts: list[str], tokens: int,
                          speculative: str = "") -> dict:
        calls.append((len(prompts), speculative))
        return {"aggregate_tok_s": 10.0 * len(prompts), "per_stream_tok_s": [10.0, 12.0]}

    rss = iter([100.0, 190.0])
    monkeypatch.setattr(microbatch, "cluster_aggregate", cluster_aggregate)
    monkeypatch.setattr(microbatch, "cluster_rss_mb", lambda pids: next(rss))
    samples, per_stream, memory = microbatch.interleaved_runs("tcp://x", [1], None, 8, 2)
    assert calls[0] == (1, "")  # the warm-up
    assert calls[1:4] == [(1, ""), (1, "lookup"), (2, "")] and len(calls) == 1 + 2 * 3 * 2
    assert samples["cluster"] == {"1": [10.0, 10.0], "2": [20.0, 20.0], "4": [40.0, 40.0]}
    assert samples["genai_seq"] == {} and per_stream["lookup"]["4"] == [11.0, 11.0]
    assert memory == 30.0  # (190 - 100) MB over 3 extra streams
    figures = microbatch.microbatch_figures(samples, per_stream, memory, genai=False)
    assert figures["scaling"] == {"1": 1.0, "2": 2.0, "4": 4.0}
    assert "baseline_tok_s" not in figures and figures["memory_per_stream_mb"] == 30.0
