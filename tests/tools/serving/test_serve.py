"""tools.serving.serve and its pieces: the request set, the statistics, the HTTP load generator
against a fake OpenAI-compatible server (in this process: uvicorn on a free port in a thread),
the ContinuousBatchingPipeline driver against a fake pipeline, the report's keys; and (slow)
a run against the real zctl serve on a local cluster of the tiny model, torn down after."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from fastapi import Request  # at module level: the fake server's handler annotations name it
from rich.console import Console

from tools.harness.baseline import serve_on
from tools.harness.load import (
    LevelRun,
    RequestRecord,
    ServeRequest,
    http_level,
    model_id,
    request_set,
    summarize,
)
from tools.harness.stats import aggregate_tok_s, percentile
from tools.serving.serve import (
    Plan,
    level_row,
    overhead_figures,
    overhead_steps,
    pool,
    print_table,
    report,
    round_ratios,
    targets,
    warmup_set,
)

# -- the request set ---------------------------------------------------------------------------


def test_request_set_is_deterministic_and_mixed() -> None:
    a, b = request_set(32, seed=3), request_set(32, seed=3)
    assert a == b and request_set(32, seed=4) != a
    assert [r.index for r in a] == list(range(32))
    assert len({r.max_tokens for r in a}) >= 4 and all(16 <= r.max_tokens <= 256 for r in a)
    lengths = [len(r.prompt.split()) for r in a]
    assert min(lengths) < 20 and max(lengths) > 250  # short questions to long documents
    assert a[0].messages() == [{"role": "user", "content": a[0].prompt}]
    with pytest.raises(ValueError):
        request_set(0)


# -- statistics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [0, 1, 37.5, 50, 90, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    values = list(np.random.default_rng(7).exponential(size=101))
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile(values[:4], q) == pytest.approx(float(np.percentile(values[:4], q)))


def test_percentile_edges() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_aggregate_tok_s() -> None:
    assert aggregate_tok_s(300, 2.0) == 150.0
    assert aggregate_tok_s(0, 0.0) == 0.0
    with pytest.raises(ValueError):
        aggregate_tok_s(-1, 1.0)


def _record(index: int, start: float, chunks: list[float], tokens: int, error: str = "",
            prompt: int = 10) -> RequestRecord:
    return RequestRecord(index, start, chunks, (chunks[-1] if chunks else start) + 0.001,
                         tokens, prompt, True, error)


def test_summarize_counts_only_good_requests() -> None:
    run = LevelRun(2, [
        _record(0, 0.0, [0.5, 0.6, 0.7, 0.8], 4),          # TTFT 0.5, gaps 0.1
        _record(1, 0.0, [1.0, 1.3, 1.6], 6, prompt=30),    # 2 tokens a chunk, gaps 0.3
        _record(2, 0.0, [0.2], 1, error="http 500: boom"),
    ], wall_s=2.0)
    s = summarize(run)
    assert s["requests"] == 3 and s["errors"] == 1 and s["error_kinds"] == {"http 500": 1}
    assert s["completion_tokens"] == 10 and s["tok_s"] == 5.0
    assert s["ttft_ms"]["p50"] == pytest.approx(750.0)
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)  # gaps 0.1 x3, 0.3 x2: pooled
    assert s["itl_ms"]["p99"] == pytest.approx(300.0)
    assert s["tokens_per_chunk"] == pytest.approx(10 / 7, abs=1e-3)
    assert s["prompt_tokens_mean"] == 20.0 and s["without_usage"] == 0
    # TPOT: (last - first) / (tokens - 1): 0.3/3 and 0.6/5
    assert s["tpot_ms"]["p50"] == pytest.approx((100.0 + 120.0) / 2)
    assert s["tpot_ms"]["p99"] == pytest.approx(100.0 + 20.0 * 0.99)


def test_summarize_of_only_errors_has_no_latencies() -> None:
    s = summarize(LevelRun(1, [_record(0, 0.0, [], 0, error="ConnectError: refused")], 1.0))
    assert s["tok_s"] == 0.0 and s["errors"] == 1
    assert s["ttft_ms"] == {"p50": None, "p99": None} and s["tokens_per_chunk"] is None


def test_overhead_figures() -> None:
    direct = [_record(0, 0.0, [0.1, 0.9], 100), _record(1, 0.0, [0.1, 1.999], 200)]
    http = [_record(0, 0.0, [0.1, 0.9], 100), _record(1, 0.0, [0.1, 2.059], 200)]
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
    failed = overhead_figures(direct, [_record(0, 0.0, [], 0, "x"), http[1]])
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
    overhead = overhead_figures([_record(0, 0.0, [0.5], 10)], [_record(0, 0.0, [0.5], 10)])
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
        return LevelRun(8, [_record(0, 0.0, [0.5], tokens)], wall_s=wall)

    # the machine slows down in the second round: both systems feel it
    zctl = [run(100, 1.0), run(100, 2.0), run(100, 1.0)]    # 100, 50, 100 tok/s
    genai = [run(100, 1.25), run(100, 2.0), run(100, 0.8)]  # 80, 50, 125 tok/s
    assert round_ratios(zctl, genai) == [1.25, 1.0, 0.8]
    pooled = pool(zctl)
    assert len(pooled.records) == 3 and pooled.wall_s == 4.0 and pooled.concurrency == 8
    row = level_row(summarize(pool(zctl)), summarize(pool(genai)), round_ratios(zctl, genai))
    assert row["ratio"] == 1.0 and row["round_ratios"] == [1.25, 1.0, 0.8]
    assert row["zctl_tok_s"] == 75.0 and row["genai_cb_tok_s"] == round(300 / 4.05, 2)
    # one round: the two summaries' ratio, as before
    assert level_row(summarize(zctl[0]), summarize(genai[0]), round_ratios(zctl[:1], genai[:1]))[
        "ratio"] == 1.25
    assert round_ratios(zctl, []) == [] and round_ratios(zctl, [run(0, 1.0)]) == []
    with pytest.raises(ValueError, match="no rounds"):
        pool([])


def test_warmup_set_covers_the_largest_level_with_short_requests() -> None:
    plan = Plan([1, 16], request_set(4), 2)
    warm = warmup_set(plan)
    assert len(warm) == 16 and {r.max_tokens for r in warm} == {8}


# -- the load generator against a fake OpenAI-compatible server ------------------------------------

FAIL_500, DROP, CRASH, BAD_JSON = 13, 17, 19, 23  # max_tokens that make the fake misbehave


class FakeServer:
    """Streams ``max_tokens`` tokens, ``per_chunk`` to an SSE chunk, ``delay`` s apart;
    records the most streams it served at once."""

    def __init__(self, per_chunk: int = 1, delay: float = 0.002, api_key: str = "") -> None:
        self.per_chunk, self.delay, self.api_key = per_chunk, delay, api_key
        self.active = self.most_active = self.served = 0

    def app(self) -> Any:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await request.json()
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
            if body["max_tokens"] == FAIL_500:
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            assert body["stream"] and body["stream_options"] == {"include_usage": True}
            assert body["messages"][0]["role"] == "user" and body["temperature"] == 0.0
            return StreamingResponse(self.stream(body["max_tokens"]),
                                     media_type="text/event-stream")

        return app

    async def stream(self, n: int) -> Any:
        def sse(obj: Any) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            yield sse({"id": "c", "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(0, n, self.per_chunk):
                await asyncio.sleep(self.delay)
                if n == CRASH and i >= 4:
                    raise RuntimeError("the server fell over mid-stream")
                if n == BAD_JSON and i >= 4:
                    yield "data: {not json\n\n"
                text = "tok " * min(self.per_chunk, n - i)
                yield sse({"id": "c", "object": "chat.completion.chunk",
                           "choices": [{"index": 0, "delta": {"content": text}}]})
            if n == DROP:
                return
            yield sse({"id": "c", "choices": [], "usage": {
                "prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7}})
            yield "data: [DONE]\n\n"
            self.served += 1
        finally:
            self.active -= 1


@contextmanager
def running(fake: FakeServer) -> Iterator[str]:
    """``fake`` on uvicorn on a free loopback port, in a thread of this process."""
    import uvicorn

    from zctl.launcher.local import free_port

    port = free_port("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(fake.app(), host="127.0.0.1", port=port,
                                           log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _requests(*max_tokens: int) -> list[ServeRequest]:
    return [ServeRequest(i, f"question {i}", n) for i, n in enumerate(max_tokens)]


def test_load_generator_streams_every_request_at_the_concurrency() -> None:
    fake = FakeServer(delay=0.005)
    requests = _requests(*([8, 12, 16, 20] * 3))
    with running(fake) as url:
        assert asyncio.run(model_id(url)) == "fake-model"
        run = asyncio.run(http_level(url, "fake-model", requests, 4))
    assert fake.most_active == 4 and fake.served == 12
    assert [r.index for r in run.records] == list(range(12))
    assert all(r.ok and r.usage for r in run.records)
    assert [r.completion_tokens for r in run.records] == [r.max_tokens for r in requests]
    assert [len(r.chunk_times) for r in run.records] == [r.max_tokens for r in requests]
    s = summarize(run)
    assert s["errors"] == 0 and s["completion_tokens"] == sum(r.max_tokens for r in requests)
    assert s["tokens_per_chunk"] == 1.0 and s["prompt_tokens_mean"] == 7.0
    assert s["ttft_ms"]["p50"] >= 5.0 and s["itl_ms"]["p50"] >= 4.0
    assert s["tok_s"] == pytest.approx(s["completion_tokens"] / run.wall_s, rel=0.01)
    # 4 clients over 12 requests of >= 8 x 5 ms: at least 3 rounds, far less than 12 in turn
    assert 0.1 < run.wall_s < sum(r.max_tokens for r in requests) * 0.005


def test_coalesced_chunks_take_the_token_count_from_usage() -> None:
    with running(FakeServer(per_chunk=4)) as url:
        run = asyncio.run(http_level(url, "fake-model", _requests(16, 32), 2))
    assert [r.completion_tokens for r in run.records] == [16, 32]
    assert [len(r.chunk_times) for r in run.records] == [4, 8]
    assert summarize(run)["tokens_per_chunk"] == 4.0


def test_failures_are_counted_not_raised() -> None:
    requests = _requests(8, FAIL_500, 8, DROP, CRASH, BAD_JSON, 8)
    with running(FakeServer()) as url:
        run = asyncio.run(http_level(url, "fake-model", requests, 3))
    errors = {r.index: r.error for r in run.records}
    assert errors[0] == errors[2] == errors[6] == ""
    assert errors[1].startswith("http 500") and "boom" in errors[1]
    assert errors[3].startswith("no [DONE]")
    assert errors[4].startswith("RemoteProtocolError")  # the connection broke mid-stream
    assert errors[5].startswith("JSONDecodeError")  # a chunk that is not JSON
    s = summarize(run)
    assert s["errors"] == 4 and s["completion_tokens"] == 24 and s["requests"] == 7


def test_an_unreachable_server_is_an_error_per_request() -> None:
    from zctl.launcher.local import free_port

    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nobody listens
    run = asyncio.run(http_level(url, "m", _requests(8, 8), 2, timeout_s=5))
    assert [r.error.split(":")[0] for r in run.records] == ["ConnectError"] * 2


def test_the_api_key_is_sent() -> None:
    with running(FakeServer(api_key="sesame")) as url:
        good = asyncio.run(http_level(url, "m", _requests(8), 1, api_key="sesame"))
        bad = asyncio.run(http_level(url, "m", _requests(8), 1, api_key="wrong"))
    assert good.records[0].ok and bad.records[0].error.startswith("http 401")


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
    requests = _requests(3, 5, 2, 4, 6)
    run = serve_on(pipe, requests, 2, lambda r: [1, 2, 3], lambda n: n)
    assert pipe.most_live == 2 and len(pipe.handles) == 5
    assert all(r.ok for r in run.records) and [r.index for r in run.records] == list(range(5))
    assert [r.completion_tokens for r in run.records] == [3, 5, 2, 4, 6]
    assert [len(r.chunk_times) for r in run.records] == [3, 5, 2, 4, 6]
    assert all(r.prompt_tokens == 3 and r.ttft_s and r.ttft_s > 0 for r in run.records)
    assert summarize(run)["tok_s"] > 0


def test_genai_driver_counts_a_failing_step() -> None:
    run = serve_on(FakePipe(fail_at=3), _requests(4, 4, 4), 2, lambda r: [1], lambda n: n)
    errors = [r.error for r in run.records]
    assert errors[0].startswith("step failed") and errors[1].startswith("step failed")
    assert errors[2] == "not served"


# -- the whole run on a real local cluster and zctl serve (the tiny model, no genai) -------------


@pytest.mark.slow
def test_a_run_on_a_real_cluster_and_server_is_torn_down(tiny_exports, tmp_path) -> None:
    import httpx

    from tools.harness.cluster import served_cluster
    from tools.serving.serve import run_levels
    from zctl.launcher.local import runtime_spec

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
        asyncio.run(model_id(served.api))
    assert [r["concurrency"] for r in rows] == [1, 3] and all(r["errors"] == 0 for r in rows)
    assert all(r["zctl"]["completion_tokens"] > 0 and r["genai_cb_tok_s"] is None for r in rows)
    assert rows[0]["zctl"]["completion_tokens"] == rows[1]["zctl"]["completion_tokens"]
    assert overhead["errors"] == overhead["http_errors"] == 0
    assert overhead["same_tokens"] == 3 and overhead["http_overhead"] is not None
