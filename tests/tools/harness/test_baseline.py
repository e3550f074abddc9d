"""Micro-batching baseline: aggregation math (fast), and the real pipelines (opt-in).

The real-model test needs the cached optimum-intel export of SmolLM2 (built in the baseline
venv on first use, minutes): run it with ZCTL_BASELINE_TESTS=1.
"""

from __future__ import annotations

import os

import pytest

from tools.harness.baseline import sequential_throughput, stream_throughput


def test_stream_throughput_separates_prefill() -> None:
    # 2 streams: both prefilled in step 0 (0.5 s), then 3 decode steps of 0.1 s each
    steps = [0.5, 0.6, 0.7, 0.8]
    tokens = [[1, 1], [1, 1], [1, 1], [1, 1]]
    r = stream_throughput(steps, tokens)
    assert r["streams"] == 2 and r["tokens"] == 8 and r["stream_tokens"] == [4, 4]
    assert r["prefill_s"] == pytest.approx(0.5) and r["decode_s"] == pytest.approx(0.3)
    assert r["decode_tokens"] == 6
    assert r["aggregate_tok_s"] == pytest.approx(20.0)  # 6 tokens / 0.3 s
    assert r["aggregate_incl_prefill_tok_s"] == pytest.approx(10.0)  # 8 / 0.8 s
    assert r["per_stream_tok_s"] == pytest.approx([10.0, 10.0])  # 3 tokens / 0.3 s
    assert r["ttft_ms"] == pytest.approx([500.0, 500.0])


def test_stream_throughput_staggered_prefill() -> None:
    # stream 1's prompt is prefilled one step later (chunked prefill); decode starts at 0.4 s
    steps = [0.2, 0.4, 0.5, 0.6]
    tokens = [[1, 0], [1, 1], [1, 1], [0, 1]]
    r = stream_throughput(steps, tokens)
    assert r["prefill_s"] == pytest.approx(0.4)
    assert r["decode_tokens"] == 3 and r["decode_s"] == pytest.approx(0.2)
    assert r["aggregate_tok_s"] == pytest.approx(15.0)
    assert r["per_stream_tok_s"] == pytest.approx([2 / 0.3, 2 / 0.2])
    assert r["ttft_ms"] == pytest.approx([200.0, 400.0])


@pytest.mark.parametrize("steps, tokens", [([], []), ([0.1], [[1, 1], [1, 1]]),
                                            ([0.1], [[]]), ([0.1, 0.2], [[1, 0], [1, 0]])])
def test_stream_throughput_rejects_bad_input(steps: list[float], tokens: list[list[int]]) -> None:
    with pytest.raises(ValueError):
        stream_throughput(steps, tokens)


def test_sequential_throughput_is_single_user_rate() -> None:
    run = {"wall_ms": 1100.0, "ttft_ms": 100.0, "n_generated": 11}  # 10 decode tokens / 1 s
    r = sequential_throughput([run, run, run])
    assert r["streams"] == 3 and r["tokens"] == 33
    assert r["aggregate_tok_s"] == pytest.approx(10.0)
    assert r["per_stream_tok_s"] == pytest.approx([10.0] * 3)
    assert r["wall_s"] == pytest.approx(3.3) and r["decode_s"] == pytest.approx(3.0)
    assert r["aggregate_incl_prefill_tok_s"] == pytest.approx(10.0)  # 33 / 3.3
    assert r["ttft_ms"] == pytest.approx([100.0, 1200.0, 2300.0])  # users queue
    with pytest.raises(ValueError):
        sequential_throughput([])


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ZCTL_BASELINE_TESTS") != "1",
                    reason="set ZCTL_BASELINE_TESTS=1 (needs the optimum-intel baseline export)")
def test_continuous_batching_matches_llm_pipeline() -> None:
    from tools.harness.baseline import (
        STREAM_PROMPTS,
        BaselinePipeline,
        ContinuousBatchingBaseline,
        export_baseline,
    )
    from tools.harness.models import model_hf_dir
    from zctl.paths import zctl_home

    cache = zctl_home()
    model_dir = export_baseline(model_hf_dir("smollm2-135m", cache), "int4", 64)
    props = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    single = BaselinePipeline(model_dir, props, warmup_tokens=0)
    batched = ContinuousBatchingBaseline(model_dir, props, warmup_streams=0)
    ids = [single.encode(p) for p in STREAM_PROMPTS[:2]]
    r = batched.measure(ids, 8)
    assert r["streams"] == 2 and r["tokens"] == 16 and r["stream_tokens"] == [8, 8]
    assert r["aggregate_tok_s"] > 0 and len(r["per_stream_tok_s"]) == 2
    assert r["n_input"] == [len(x) for x in ids]
    # greedy streams are independent: each matches LLMPipeline on its own prompt
    for x, out in zip(ids, r["token_ids"], strict=True):
        assert out == single.generate_timed(x, 8)["tokens"]
