"""The OpenAI-compatible API, driven by the official ``openai`` client (sync and async)
and by raw HTTP: streamed and whole answers, stop strings, usage, seeds, logprobs,
speculation, errors in OpenAI's shape, cancellation on disconnect, health and metrics.

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
import numpy as np
import openai
import pytest
import uvicorn

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from tests.zctl.service.test_server import SlowChain
from zctl.engine.scheduler import generate_greedy
from zctl.engine.tokenizer import ChatTokenizer
from zctl.launcher.local import cors_origin, free_port
from zctl.manifest import load_manifest
from zctl.serve.app import MAX_BODY_BYTES, ServeSettings, create_app
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


# -- answers --------------------------------------------------------------------------
def test_chat_whole_and_streamed_equal_greedy_with_usage(server, tiny) -> None:
    client = server.client()
    want, tokens = greedy_text(tiny, [(m["role"], m["content"]) for m in ASK], 12)
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12,
                                           temperature=0, extra_body={"zctl": {"ignore_eos": True}})
    assert reply.choices[0].message.content == want
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.role == "assistant"
    prompt_tokens = len(tiny[2].encode_chat([(m["role"], m["content"]) for m in ASK]))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 12)
    assert reply.model == MODEL and reply.id.startswith("chatcmpl-")
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"zctl": {"ignore_eos": True}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(tiny) -> None:
    export_dir, chain, _ = tiny  # (the chain itself: SlowChain keeps no prefix cache)
    srv = Server(export_dir, chain, ServeSettings(), prefix_cache_mb=64)
    try:
        cached_follow_up(srv.client())
    finally:
        srv.stop()


def cached_follow_up(client: openai.OpenAI) -> None:
    turns = [{"role": "user", "content": "tell me about the sea and the sky " * 8}]
    first = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=6,
                                           temperature=0, extra_body={"zctl": {"ignore_eos": True}})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turns += [{"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "and then?"}]
    follow = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [c for c in follow][-1].usage
    assert first.usage.prompt_tokens < usage.prompt_tokens_details.cached_tokens < (
        usage.prompt_tokens)


def test_completions_whole_and_streamed(server, tiny) -> None:
    _, chain, tokenizer = tiny
    client = server.client()
    tokens = list(generate_greedy(chain, tokenizer.encode("one two three", chat=False), 8))
    want = tokenizer.decode(tokens)
    reply = client.completions.create(model=MODEL, prompt="one two three", max_tokens=8,
                                      temperature=0, extra_body={"zctl": {"ignore_eos": True}})
    assert reply.choices[0].text == want and reply.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="one two three", max_tokens=8, temperature=0, stream=True,
        extra_body={"zctl": {"ignore_eos": True}}) if c.choices)
    assert streamed == want


def test_stop_strings_cut_the_text_and_finish_with_stop(server, tiny) -> None:
    want, _ = greedy_text(tiny, [("user", "the sky is")], 24)
    stop = want[6:9]
    client = server.client()
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "the sky is"}],
                      max_tokens=24, temperature=0, stop=["@@never@@", stop],
                      extra_body={"zctl": {"ignore_eos": True}})
        if stream:
            chunks = [c for c in client.chat.completions.create(stream=True, **kwargs)
                      if c.choices]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            text, reason = choice.message.content, choice.finish_reason
        assert text == want[:want.index(stop)] and reason == "stop"


def test_a_seed_makes_sampling_reproducible(server) -> None:
    client = server.client()

    def sample(seed: int) -> str:
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "tell me"}], max_tokens=16,
            temperature=1.0, top_p=0.95, seed=seed,
            extra_body={"zctl": {"ignore_eos": True}}).choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert any(sample(s) != first for s in (8, 9, 10))


def test_logprobs_of_chat_and_completions(server) -> None:
    client = server.client()
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"zctl": {"ignore_eos": True}})
    content = reply.choices[0].logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert token.logprob <= 0 and abs(token.logprob - tops[0]) < 1e-6  # greedy: the best
    full = client.chat.completions.create(  # the same read from float32 logits
        model=MODEL, messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"zctl": {"ignore_eos": True, "logits_payload": "fp32"}})
    assert [t.token for t in full.choices[0].logprobs.content] == [t.token for t in content]
    assert np.allclose([t.logprob for t in full.choices[0].logprobs.content],
                       [t.logprob for t in content], atol=1e-4)
    text = client.completions.create(model=MODEL, prompt="one two", max_tokens=4, temperature=0,
                                     logprobs=2, extra_body={"zctl": {"ignore_eos": True}})
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    # (the legacy format keys alternatives by text: two ids of the same text are one)
    assert lp.text_offset[0] == 0 and all(1 <= len(t) <= 2 for t in lp.top_logprobs)


def test_lookup_speculation_returns_exactly_the_greedy_text(server) -> None:
    client = server.client()
    ask = [{"role": "user", "content": "one two three one two three one two"}]
    plain = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=20,
                                           temperature=0, extra_body={"zctl": {"ignore_eos": True}})
    spec = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=20, temperature=0,
        extra_body={"zctl": {"ignore_eos": True, "speculative": "lookup", "k": 3}})
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.completion_tokens == plain.usage.completion_tokens == 20


def test_penalties_and_a_logit_bias_steer_the_answer(server, tiny) -> None:
    client = server.client()
    tokenizer = tiny[2]

    def answer(extra: dict | None = None, **kwargs) -> tuple[str, list[str]]:
        reply = client.completions.create(
            model=MODEL, prompt="again and again", max_tokens=24, temperature=0,
            logprobs=0, extra_body={"zctl": {"ignore_eos": True}, **(extra or {})}, **kwargs)
        return reply.choices[0].text, reply.choices[0].logprobs.tokens

    plain, penalised = answer()[1], answer(frequency_penalty=2.0, presence_penalty=1.0)[1]
    assert len(set(penalised)) > len(set(plain))  # the random model repeats itself less
    assert answer(frequency_penalty=2.0, presence_penalty=1.0)[1] == penalised  # still greedy
    favourite = tokenizer.encode("again", chat=False)[-1]
    text, _ = answer(logit_bias={str(favourite): 100})
    assert text == tokenizer.decode([favourite] * 24)

    def sampled(**kwargs) -> str:
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "say it again"}], max_tokens=16,
            temperature=0.9, seed=3, extra_body={"zctl": {"ignore_eos": True}},
            **kwargs).choices[0].message.content

    assert sampled(frequency_penalty=-2.0) == sampled(frequency_penalty=-2.0) != sampled()
    nulls = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
             "temperature": None, "top_p": None, "n": None, "presence_penalty": None,
             "frequency_penalty": None}  # OpenAI's API takes null for these: the defaults
    assert httpx.post(f"{server.url}/v1/chat/completions", json=nulls).status_code == 200


def test_the_async_client_streams(server, tiny) -> None:
    want, _ = greedy_text(tiny, [("user", "the sky is")], 10)

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        async def one() -> str:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "the sky is"}], max_tokens=10,
                temperature=0, stream=True, extra_body={"zctl": {"ignore_eos": True}})
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        try:
            return await asyncio.gather(one(), one(), one())
        finally:
            await client.close()

    assert asyncio.run(run()) == [want] * 3


def test_models_lists_the_served_model(server) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    raw = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert raw["max_model_len"] == 512 and [s["index"] for s in raw["stages"]] == [0, 1]
    assert server.client().models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="not served here"):
        server.client().models.retrieve("gpt-4")


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
    generated = [line for line in text.splitlines()
                 if line.startswith("vllm:generation_tokens_total")]
    assert float(generated[0].split()[-1]) >= 4
