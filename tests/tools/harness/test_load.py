"""The HTTP load client (tools.harness.load): the request set, what a stream recorded and the
statistics over a level, and N clients against a fake OpenAI-compatible server (in this
process: uvicorn on a free port in a thread): streams at the concurrency, chunks of several
tokens, failures counted, the key sent, a client that leaves a stream, a whole completion."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi import Request  # at module level: the fake server's handler annotations name it

from tools.harness.load import (
    LevelRun,
    RequestRecord,
    ServeRequest,
    async_client,
    chat_payload,
    complete_chat,
    http_level,
    request_set,
    served_model,
    stream_chat,
    summarize,
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


# -- what a stream recorded, and the statistics over a level -------------------------------


def record(index: int, start: float, chunks: list[float], tokens: int, error: str = "",
            prompt: int = 10) -> RequestRecord:
    return RequestRecord(index, start, chunks, (chunks[-1] if chunks else start) + 0.001,
                         tokens, prompt, True, error)


def test_summarize_counts_only_goodrequests_of() -> None:
    run = LevelRun(2, [
        record(0, 0.0, [0.5, 0.6, 0.7, 0.8], 4),          # TTFT 0.5, gaps 0.1
        record(1, 0.0, [1.0, 1.3, 1.6], 6, prompt=30),    # 2 tokens a chunk, gaps 0.3
        record(2, 0.0, [0.2], 1, error="http 500: boom"),
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
    s = summarize(LevelRun(1, [record(0, 0.0, [], 0, error="ConnectError: refused")], 1.0))
    assert s["tok_s"] == 0.0 and s["errors"] == 1
    assert s["ttft_ms"] == {"p50": None, "p99": None} and s["tokens_per_chunk"] is None


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
            assert body["messages"][0]["role"] == "user" and body["temperature"] == 0.0
            n = body["max_tokens"]
            if not body["stream"]:  # a whole completion
                return {"choices": [{"index": 0, "message": {"role": "assistant",
                                                             "content": "tok " * n}}],
                        "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                  "total_tokens": n + 7}}
            assert body["stream_options"] == {"include_usage": True}
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


def requests_of(*max_tokens: int) -> list[ServeRequest]:
    return [ServeRequest(i, f"question {i}", n) for i, n in enumerate(max_tokens)]


def test_load_generator_streams_every_request_at_the_concurrency() -> None:
    fake = FakeServer(delay=0.005)
    requests = requests_of(*([8, 12, 16, 20] * 3))
    with running(fake) as url:
        assert asyncio.run(served_model(url)).id == "fake-model"
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
        run = asyncio.run(http_level(url, "fake-model", requests_of(16, 32), 2))
    assert [r.completion_tokens for r in run.records] == [16, 32]
    assert [len(r.chunk_times) for r in run.records] == [4, 8]
    assert summarize(run)["tokens_per_chunk"] == 4.0


def test_failures_are_counted_not_raised() -> None:
    requests = requests_of(8, FAIL_500, 8, DROP, CRASH, BAD_JSON, 8)
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
    run = asyncio.run(http_level(url, "m", requests_of(8, 8), 2, timeout_s=5))
    assert [r.error.split(":")[0] for r in run.records] == ["ConnectError"] * 2


def test_the_api_key_is_sent() -> None:
    with running(FakeServer(api_key="sesame")) as url:
        good = asyncio.run(http_level(url, "m", requests_of(8), 1, api_key="sesame"))
        bad = asyncio.run(http_level(url, "m", requests_of(8), 1, api_key="wrong"))
    assert good.records[0].ok and bad.records[0].error.startswith("http 401")


def test_a_client_can_leave_a_stream_and_ask_for_a_whole_completion() -> None:
    async def both(url: str) -> tuple[RequestRecord, RequestRecord, RequestRecord]:
        async with async_client(url, 2) as client:
            payload = chat_payload("m", ServeRequest(0, "question", 12))
            left = await stream_chat(client, payload, leave_after=3)
            whole = await complete_chat(client, payload)
            refused = await complete_chat(client, {**payload, "max_tokens": FAIL_500})
        return left, whole, refused

    with running(FakeServer()) as url:
        left, whole, refused = asyncio.run(both(url))
    assert left.ok and left.left and len(left.chunk_times) == 3 and left.text == "tok " * 3
    assert left.completion_tokens == 3 and not left.usage and left.done
    assert whole.ok and not whole.left and whole.usage and whole.completion_tokens == 12
    assert whole.text == "tok " * 12 and whole.prompt_tokens == 7 and len(whole.chunk_times) == 1
    assert refused.error.startswith("http 500") and "boom" in refused.error
