"""The benchmark tools' estimators: token-by-token chain steps, bracketed and paired ratios."""

from __future__ import annotations

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from tools.bench_common import paired_step_ms


def test_chains_are_stepped_token_by_token_each_on_its_own_greedy_stream(tiny_exports) -> None:
    config = RuntimeSpec(precision="f32")
    exports = {"one": tiny_exports.get([(0, 4)]), "two": tiny_exports.get([(0, 2), (2, 4)])}
    chains = {key: LocalChain.load(str(path), config) for key, path in exports.items()}
    prompt = [3, 14, 15, 92, 65]
    ms = paired_step_ms(chains, prompt, tokens=6, stream=7)
    assert set(ms) == {"one", "two"} and all(v > 0 for v in ms.values())
    for chain in chains.values():  # prompt + 6 decode steps landed on stream 7
        assert all(r.streams[7].physical == len(prompt) + 6 for r in chain.runners)
    # a second call starts over (the stream is reset), so the figures stay comparable
    paired_step_ms(chains, prompt, tokens=2, stream=7)
    assert all(r.streams[7].physical == len(prompt) + 2 for c in chains.values()
               for r in c.runners)


def test_bracketed_ratios_cancel_drift_between_and_within_runs() -> None:
    from tools.bench_parity import bracketed_ratios

    # the machine's speed wanders from run to run and drifts linearly within each run;
    # the system is always exactly 0.97x of the baseline at the same moment
    speed = [(1.0, 0.8), (0.7, 0.75), (0.9, 0.95)]
    brackets = [(100 * a, 100 * b) for a, b in speed]
    samples = {"baseline": [v for pair in brackets for v in pair],
               "stage2": [0.97 * 100 * (a + b) / 2 for a, b in speed]}
    assert bracketed_ratios(samples, brackets) == {"stage2": 0.97}
    # a ratio of medians over the same runs reads the drift instead
    from statistics import median
    assert abs(median(samples["stage2"]) / median(samples["baseline"]) - 0.97) > 0.05


def test_microbatch_paired_scaling_divides_each_run_by_its_own_single_stream() -> None:
    from tools.bench_microbatch import paired_scaling

    samples = {"1": [20.0, 30.0, 25.0], "2": [38.0, 57.0, 45.0], "4": [50.0, 75.0, 60.0]}
    assert paired_scaling(samples) == {"1": 1.0, "2": 1.9, "4": 2.5}


def test_microbatch_runs_every_mode_each_run_and_measures_memory(monkeypatch) -> None:
    from tools import bench_microbatch

    calls: list[tuple[int, str]] = []

    def cluster_aggregate(serve: str, prompts: list[str], tokens: int,
                          speculative: str = "") -> dict:
        calls.append((len(prompts), speculative))
        return {"aggregate_tok_s": 10.0 * len(prompts), "per_stream_tok_s": [10.0, 12.0]}

    rss = iter([100.0, 190.0])
    monkeypatch.setattr(bench_microbatch, "cluster_aggregate", cluster_aggregate)
    monkeypatch.setattr(bench_microbatch, "cluster_rss_mb", lambda pids: next(rss))
    samples, per_stream, memory = bench_microbatch.interleaved_runs("tcp://x", [1], None, 8, 2)
    assert calls[0] == (1, "")  # the warm-up
    assert calls[1:4] == [(1, ""), (1, "lookup"), (2, "")] and len(calls) == 1 + 2 * 3 * 2
    assert samples["cluster"] == {"1": [10.0, 10.0], "2": [20.0, 20.0], "4": [40.0, 40.0]}
    assert samples["genai_seq"] == {} and per_stream["lookup"]["4"] == [11.0, 11.0]
    assert memory == 30.0  # (190 - 100) MB over 3 extra streams
    figures = bench_microbatch.microbatch_figures(samples, per_stream, memory, genai=False)
    assert figures["scaling"] == {"1": 1.0, "2": 2.0, "4": 4.0}
    assert "baseline_tok_s" not in figures and figures["memory_per_stream_mb"] == 30.0
