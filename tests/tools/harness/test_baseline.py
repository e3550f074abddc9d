"""The openvino_genai baseline (tools.harness.baseline): the arithmetic of N streams'
throughput, the continuous-batching driver against a fake pipeline (fast), and the real
pipelines (opt-in).

The real-model test needs the cached optimum-intel export of SmolLM2 (built in the baseline
venv on first use, minutes): run it with ZCTL_BASELINE_TESTS=1.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.tools.harness.test_load import requests_of
from tools.harness.baseline import sequential_throughput, serve_on, stream_throughput
from tools.harness.load import summarize


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


# -- the ContinuousBatchingPipeline driver against a fake pipeline -------------------------------


class FakeHandle:
    def __init__(self, n: int) -> None:
        self.left, self.ready, self.status = n, 0, "RUNNING"

    def can_read(self) -> bool:
        return self.ready > 0

    def read(self) -> dict[int, Any]:
        out = type("Out", (), {"generated_ids": [5] * self.ready})()
        self.ready = 0
        return {0: out}

    def get_status(self) -> Any:
        import openvino_genai as ov_genai

        return getattr(ov_genai.GenerationStatus, self.status)


class FakePipe:
    """One token per live request per step; the step numbered ``fail_at`` raises."""

    def __init__(self, fail_at: int = -1) -> None:
        self.handles: list[FakeHandle] = []
        self.steps, self.most_live, self.fail_at = 0, 0, fail_at

    def add_request(self, request_id: int, tensor: Any, max_tokens: int) -> FakeHandle:
        self.handles.append(FakeHandle(max_tokens))
        return self.handles[-1]

    def step(self) -> None:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("out of KV cache")
        live = [h for h in self.handles if h.status == "RUNNING"]
        self.most_live = max(self.most_live, len(live))
        for h in live:
            h.ready, h.left = h.ready + 1, h.left - 1
            if h.left == 0:
                h.status = "FINISHED"


def test_genai_driver_keeps_the_concurrency_and_records_tokens() -> None:
    pipe = FakePipe()
    requests = requests_of(3, 5, 2, 4, 6)
    run = serve_on(pipe, requests, 2, lambda r: [1, 2, 3], lambda n: n)
    assert pipe.most_live == 2 and len(pipe.handles) == 5
    assert all(r.ok for r in run.records) and [r.index for r in run.records] == list(range(5))
    assert [r.completion_tokens for r in run.records] == [3, 5, 2, 4, 6]
    assert [len(r.chunk_times) for r in run.records] == [3, 5, 2, 4, 6]
    assert all(r.prompt_tokens == 3 and r.ttft_s and r.ttft_s > 0 for r in run.records)
    assert summarize(run)["tok_s"] > 0


def test_genai_driver_counts_a_failing_step() -> None:
    run = serve_on(FakePipe(fail_at=3), requests_of(4, 4, 4), 2, lambda r: [1], lambda n: n)
    errors = [r.error for r in run.records]
    assert errors[0].startswith("step failed") and errors[1].startswith("step failed")
    assert errors[2] == "not served"


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
