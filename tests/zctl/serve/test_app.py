"""The application (zctl.serve.app) driven by the official ``openai`` client and by raw
HTTP: CORS, the SSE wire format, cancellation on disconnect, errors in OpenAI's shape,
the body limit, the key, the queue, health and metrics. Its fixtures serve every API's
tests (tests.zctl.serve.openai, tests.zctl.serve.anthropic).

The server runs in a thread (uvicorn) over a generation service on an in-process
two-stage chain of the tiny model: no processes are started."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from tests.zctl.service.test_server import SlowChain
from zctl.engine.scheduler import generate_greedy
from zctl.engine.tokenizer import ChatTokenizer
from zctl.launcher.api import cors_origin
from zctl.launcher.local import free_port
from zctl.manifest import load_manifest
from zctl.serve.app import MAX_BODY_BYTES, create_app
from zctl.serve.settings import ServeSettings
from zctl.service.async_client import AsyncServiceClient
from zctl.service.server import GenerationService

MODEL = ""  # the tiny export's model name, set by the ``tiny`` fixture


class Server:
    """uvicorn in a thread over a GenerationService on ``chain``."""

    def __init__(self, export_dir: Path, chain: SlowChain | LocalChain, settings: ServeSettings,
                 health: Callable[[], str | None] | None = None, prefix_cache_mb: int = 0
                 ) -> None:
        self.chain = chain
        self.service = GenerationService(export_dir, lambda: chain, "tcp://127.0.0.1:*",
                                         health=health, resume_timeout_s=0,
                                         prefix_cache_mb=prefix_cache_mb)
        self.service.start()
        port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(create_app(AsyncServiceClient(self.service.endpoint), settings),
                                host="127.0.0.1", port=port, log_level="warning")
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.uvicorn.started)

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.service.stop()


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "not reached in time"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def tiny(tiny_exports):
    global MODEL
    export_dir: Path = tiny_exports.get([(0, 2), (2, 4)])
    MODEL = load_manifest(export_dir).model.name
    chain = LocalChain.load(str(export_dir), RuntimeSpec(precision="f32"))
    return export_dir, chain, ChatTokenizer(export_dir)


@pytest.fixture(scope="module")
def server(tiny) -> Iterator[Server]:
    export_dir, chain, _ = tiny
    srv = Server(export_dir, SlowChain(chain, 0.0), ServeSettings())
    yield srv
    srv.stop()


@pytest.fixture
def started(tiny) -> Iterator[Callable[..., Server]]:
    """Servers with their own settings, chain pace or health, stopped after the test."""
    servers: list[Server] = []

    def start(settings: ServeSettings | None = None, delay_s: float = 0.0,
              health: Callable[[], str | None] | None = None) -> Server:
        export_dir, chain, _ = tiny
        servers.append(Server(export_dir, SlowChain(chain, delay_s), settings or ServeSettings(),
                              health))
        return servers[-1]

    yield start
    for srv in servers:
        srv.stop()


def metric_values(text: str, *names: str) -> dict[str, float]:
    """The values of one-sample metric families ``names`` (counters: ``..._total``) in
    Prometheus text, by family name."""
    return {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith(tuple(f"{name}{{" for name in names))}


def greedy_text(tiny, messages: list[tuple[str, str]], n: int) -> tuple[str, list[int]]:
    _, chain, tokenizer = tiny
    tokens = list(generate_greedy(chain, tokenizer.encode_chat(messages), n))
    return tokenizer.decode(tokens), tokens


ASK = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the sky is"}]


def test_an_origin_is_taken_as_browsers_send_it() -> None:
    assert cors_origin(" http://ui.example:3000/ ") == "http://ui.example:3000"
    assert cors_origin("*") == "*" and cors_origin("https://a.b") == "https://a.b"
    for bad in ("ui.example", "http://", "http://a.b/path", "file:///x"):
        with pytest.raises(ValueError, match="--cors-origin takes"):
            cors_origin(bad)


def test_browsers_may_call_only_from_the_origins_named(server, started) -> None:
    page = "http://ui.example:3000"
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST",  # as OpenAI's JS SDK
                 "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os"}
    # by default no origin may: a page the user visits cannot drive a local server
    assert "access-control-allow-origin" not in httpx.get(
        f"{server.url}/v1/models", headers={"Origin": page}).headers
    assert "access-control-allow-origin" not in httpx.options(
        f"{server.url}/v1/chat/completions", headers=preflight).headers
    srv = started(ServeSettings(api_key="k", cors_origins=(page,)))
    answer = httpx.options(f"{srv.url}/v1/chat/completions", headers=preflight)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == page
    assert "authorization" in answer.headers["access-control-allow-headers"].lower()
    reply = httpx.post(f"{srv.url}/v1/completions", headers={
        "Origin": page, "Authorization": "Bearer k"}, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == page
    refused = httpx.options(f"{srv.url}/v1/chat/completions",
                            headers={**preflight, "Origin": "http://evil.example"})
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers


# -- the wire -------------------------------------------------------------------------
def test_raw_sse_wire_format(server) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "zctl": {"ignore_eos": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"}
    assert len({p["id"] for p in payloads}) == 1
    assert payloads[-1]["usage"]["completion_tokens"] == 5 and payloads[-1]["choices"] == []
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"


def test_a_client_that_disconnects_has_its_generation_cancelled(started) -> None:
    srv = started(delay_s=0.01)
    body = {"model": MODEL, "prompt": "count", "max_tokens": 400, "temperature": 0,
            "stream": True, "zctl": {"ignore_eos": True}}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
    # the client closed its connection after the first chunk
    wait_for(lambda: srv.service.counters["cancelled"] == 1 and not srv.service.engine.busy)
    steps = srv.chain.steps
    assert steps < 300  # it stopped long before its 400 tokens
    runners = srv.chain.chain.runners
    assert [sum(s.physical for s in r.streams.values()) for r in runners] == [0, 0]
    time.sleep(0.2)
    assert srv.chain.steps == steps  # and no step runs after it
    reply = srv.client().completions.create(model=MODEL, prompt="again", max_tokens=3)
    assert reply.usage.completion_tokens >= 1


def test_a_whole_answer_whose_client_leaves_is_cancelled(started) -> None:
    srv = started(delay_s=0.01)
    body = {"model": MODEL, "prompt": "count", "max_tokens": 400, "zctl": {"ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=0.5)
    wait_for(lambda: srv.service.counters["cancelled"] == 1 and not srv.service.engine.busy)
    assert srv.chain.steps < 300
    assert [sum(s.physical for s in r.streams.values()) for r in srv.chain.chain.runners] == [0, 0]


# -- errors ---------------------------------------------------------------------------
def test_bad_requests_are_400s_in_openai_shape(server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="not served here"):
        client.chat.completions.create(model="gpt-4", messages=ASK)
    cases = [
        ({"model": MODEL, "messages": ASK, "n": 17}, "n"),
        ({"model": MODEL, "messages": ASK, "temperature": 3}, "temperature"),
        ({"model": MODEL, "messages": ASK, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": MODEL, "messages": ASK, "max_tokens": 600}, None),  # beyond the 512 context
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": ASK, "zctl": {"speculative": "magic"}}, None),
        ({"model": MODEL, "messages": ASK, "zctl": {"unknown": 1}}, "zctl.unknown"),
        ({"model": MODEL, "messages": ASK, "zctl": {"logits_payload": "fp8"}},
         "zctl.logits_payload"),
        ({"model": MODEL, "messages": ASK, "presence_penalty": 2.5}, "presence_penalty"),
        ({"model": MODEL, "messages": ASK, "logit_bias": {"5": 101}}, None),
        ({"model": MODEL, "messages": ASK, "logit_bias": {"ab": 1}}, None),
        ({"model": MODEL, "messages": ASK, "logit_bias": {"99999999": 1}}, None),  # no such id
    ]
    for body, param in cases:
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        error = resp.json()["error"]
        assert resp.status_code == 400, (body, resp.text)
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
    resp = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/nothing").json()["error"]["message"]
    # none of that disturbed the server
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_a_body_over_the_limit_is_413_in_openai_shape(server) -> None:
    """By its Content-Length, or (chunked, no length) once the bytes read pass the limit;
    a body just under it is read and judged (400 here), and the server keeps serving."""
    url = f"{server.url}/v1/completions"
    head = json.dumps({"model": MODEL, "max_tokens": -1, "prompt": ""}).encode()
    over = head[:-2] + b"x" * (MAX_BODY_BYTES + 1 - len(head)) + head[-2:]
    under = head[:-2] + b"x" * (MAX_BODY_BYTES - 100 - len(head)) + head[-2:]
    assert len(over) == MAX_BODY_BYTES + 1 and len(under) < MAX_BODY_BYTES

    def chunked(body: bytes) -> Iterator[bytes]:
        for at in range(0, len(body), 1 << 20):
            yield body[at:at + (1 << 20)]

    for content in (over, chunked(over)):
        resp = httpx.post(url, content=content, headers={"content-type": "application/json"},
                          timeout=60)
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"]["code"] == "request_too_large"
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    resp = httpx.post(url, content=under, headers={"content-type": "application/json"},
                      timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens", resp.text
    assert 'zctl_api_errors_total{status="413"} 2.0' in httpx.get(f"{server.url}/metrics").text
    assert server.client().completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_a_wrong_key_is_401_and_the_right_one_serves(started) -> None:
    srv = started(ServeSettings(api_key="sesame"))
    with pytest.raises(openai.AuthenticationError):
        srv.client("wrong").chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        srv.client("wrong").models.list()
    assert srv.client("sesame").chat.completions.create(model=MODEL, messages=ASK,
                                                        max_tokens=2).choices
    for header in (b"Bearer sesam", b"Bearer sesame2", b"bearer sesame", b"Bearer \xc3\xa9",
                   b"\xff" * 300):  # a prefix, more, the case, non-ASCII bytes
        answer = httpx.get(f"{srv.url}/v1/models", headers=[(b"authorization", header)])
        assert answer.status_code == 401, header


def test_a_full_queue_is_429_and_running_ones_finish(started) -> None:
    srv = started(ServeSettings(max_queue=1), delay_s=0.01)
    body = {"model": MODEL, "prompt": "count", "max_tokens": 60, "temperature": 0,
            "stream": True, "zctl": {"ignore_eos": True}}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        with pytest.raises(openai.RateLimitError, match="in flight"):
            srv.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest
              if x.startswith("data: {")]
    assert finish[-1] == "length"


def test_a_burst_beyond_the_queue_is_429_for_exactly_the_excess(started) -> None:
    """Requests arriving together are counted in flight as each is admitted, so no more
    than --max-queue of them are taken, however many pass the door at once."""
    srv = started(ServeSettings(max_queue=2), delay_s=0.01)
    body = {"model": MODEL, "prompt": "count", "max_tokens": 40, "temperature": 0,
            "stream": True, "zctl": {"ignore_eos": True}}

    async def burst(count: int) -> list[int]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
            async def one() -> int:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    await resp.aread()
                    return resp.status_code

            return sorted(await asyncio.gather(*(one() for _ in range(count))))

    assert asyncio.run(burst(8)) == [200] * 2 + [429] * 6


def test_a_pipeline_that_cannot_serve_is_503_and_health_says_why(started) -> None:
    problem: list[str] = []
    srv = started(health=lambda: problem[0] if problem else None)
    assert httpx.get(f"{srv.url}/health").status_code == 200
    problem.append("stage 1 (layers 2-3) on node n1 left the cluster")
    resp = httpx.get(f"{srv.url}/health")
    assert resp.status_code == 503 and "left the cluster" in resp.json()["reason"]
    with pytest.raises(openai.InternalServerError) as caught:
        srv.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert caught.value.status_code == 503
    problem.clear()
    assert httpx.get(f"{srv.url}/health").status_code == 200
    assert srv.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices


def test_metrics_in_prometheus_text(server) -> None:
    server.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                            extra_body={"zctl": {"ignore_eos": True}})
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:spec_decode_num_draft_tokens_total",
                 "zctl_stage_compute_seconds_bucket", "zctl_stage_up"):
        assert name in text, name
    assert "\nzctl_api_requests_in_flight 0.0\n" in text  # the request above has ended
    assert "\nzctl_api_max_queue 64.0\n" in text  # ServeSettings' default
    measured = [line for line in text.splitlines() if line.startswith("zctl_measured_tok_s{")]
    assert len(measured) == 1 and float(measured[0].split()[-1]) > 0  # the request's decode
    generated = [line for line in text.splitlines()
                 if line.startswith("vllm:generation_tokens_total")]
    assert float(generated[0].split()[-1]) >= 4
