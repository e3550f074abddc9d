"""``n`` choices per request through the API: each is a generation of its own, streamed
interleaved by index and collected in order; the prompt is counted once, every choice's
tokens; a seed gives choice i the seed + i; a client that leaves cancels every choice."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

import tests.zctl.serve.test_app as ts
from tests.zctl.serve.test_app import ASK, Server, greedy_text, metric_values, wait_for
from zctl.engine.prefill_pieces import CANONICAL
from zctl.engine.requests import BAD_REQUEST, GenerationChunk, GenerationDone, GenerationRequest
from zctl.serve.app import create_app
from zctl.serve.settings import ServeSettings
from zctl.service.messages import ServiceStats

IGNORE_EOS = {"zctl": {"ignore_eos": True}}
tiny, server, started = ts.tiny, ts.server, ts.started  # the API's fixtures, shared


def sse_payloads(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = resp.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


def test_greedy_choices_each_equal_greedy_whole_and_streamed(server, tiny) -> None:
    want, _ = greedy_text(tiny, [(m["role"], m["content"]) for m in ASK], 10)
    reply = server.client().chat.completions.create(
        model=ts.MODEL, messages=ASK, max_tokens=10, temperature=0, n=3, extra_body=IGNORE_EOS)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [want] * 3
    assert {c.finish_reason for c in reply.choices} == {"length"}
    prompt_tokens = len(tiny[2].encode_chat([(m["role"], m["content"]) for m in ASK]))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 30)
    payloads = sse_payloads(f"{server.url}/v1/chat/completions", {
        "model": ts.MODEL, "messages": ASK, "max_tokens": 10, "temperature": 0, "n": 3,
        "stream": True, "stream_options": {"include_usage": True}, **IGNORE_EOS})
    assert len({p["id"] for p in payloads}) == 1
    texts, roles, finishes = ["", "", ""], [], {}
    for p in payloads[:-1]:
        (choice,) = p["choices"]
        delta = choice["delta"]
        if "role" in delta:
            roles.append(choice["index"])
        texts[choice["index"]] += delta.get("content", "")
        if choice["finish_reason"]:
            assert choice["index"] not in finishes
            finishes[choice["index"]] = choice["finish_reason"]
    assert roles == [0, 1, 2] and texts == [want] * 3
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 30


class RecordingBackend:
    """A backend without a model: every generation answers one token after a pause, and
    the order of what was asked for and answered is recorded."""

    def __init__(self, refuse: bool = False) -> None:
        self.log: list[tuple[str, str]] = []
        self.refuse = refuse  # every generation ends at once with the engine's refusal

    async def stats(self, timeout_s: float = 0.0) -> ServiceStats:
        return ServiceStats(0, 0, {}, [], [], {}, model="m", max_context=512, num_stages=1)

    async def generate(self, gen: GenerationRequest):  # noqa: ANN201 - an async generator
        choice = gen.request_id.rpartition("-")[2]
        self.log.append(("asked", choice))
        await asyncio.sleep(0.05)
        self.log.append(("answered", choice))
        if self.refuse:
            yield GenerationDone(gen.request_id, [], "", 5, 0.0, 0.0, stop_reason="error",
                               error="bad request: no", error_kind=BAD_REQUEST)
            return
        yield GenerationChunk(gen.request_id, [1], "a", 1)
        yield GenerationDone(gen.request_id, [1], "a", 5, 50.0, 20.0, stop_reason="max_tokens")

    async def close(self) -> None:
        pass


def test_the_first_choice_answers_before_the_others_are_asked_for() -> None:
    backend = RecordingBackend()
    app = create_app(backend)  # type: ignore[arg-type]

    async def ask() -> tuple[dict, str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            reply = await client.post("/v1/completions", json={
                "model": "m", "prompt": "hi", "max_tokens": 1, "n": 3})
            metrics = await client.get("/metrics")
        return reply.json(), metrics.text

    reply, metrics = asyncio.run(ask())
    assert [c["text"] for c in reply["choices"]] == ["a"] * 3
    assert reply["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert backend.log[:2] == [("asked", "0"), ("answered", "0")]
    assert sorted(backend.log[2:4]) == [("asked", "1"), ("asked", "2")]  # then together
    counted = metric_values(metrics, "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
    assert counted == {"vllm:prompt_tokens_total": 5, "vllm:generation_tokens_total": 3}


def test_a_first_choice_refused_is_the_answer_and_the_others_never_start() -> None:
    backend = RecordingBackend(refuse=True)

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(backend))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            return await client.post("/v1/completions", json={
                "model": "m", "prompt": "hi", "max_tokens": 1, "n": 3})

    reply = asyncio.run(ask())
    assert reply.status_code == 400 and reply.json()["error"]["message"] == "no"
    assert backend.log == [("asked", "0"), ("answered", "0")]


def test_the_other_choices_take_the_first_ones_prompt_from_the_prefix_cache(tiny) -> None:
    export_dir, chain, tokenizer = tiny  # (the chain itself: SlowChain keeps no prefix cache)
    srv = Server(export_dir, chain, ServeSettings(), prefix_cache_mb=64)
    try:
        turns = [{"role": "user", "content": "tell me about the sea and the sky " * 8}]
        want, _ = greedy_text(tiny, [(t["role"], t["content"]) for t in turns], 6)
        reply = srv.client().chat.completions.create(
            model=ts.MODEL, messages=turns, max_tokens=6, temperature=0, n=3,
            extra_body=IGNORE_EOS)
        assert [c.message.content for c in reply.choices] == [want] * 3
        prompt = reply.usage.prompt_tokens
        counters = srv.service.engine.prefix_counters()
        assert counters["prefix_hits"] == 2, counters
        # each all of it but the two tokens a piece never leaves (zctl.engine.prefill_pieces)
        saved = CANONICAL.usable_prefix(prompt, prompt)
        assert counters["prefix_tokens_saved"] == 2 * saved > 0, (counters, prompt)
    finally:
        srv.stop()


def test_completion_choices_keep_their_own_logprob_offsets(server) -> None:
    payloads = sse_payloads(f"{server.url}/v1/completions", {
        "model": ts.MODEL, "prompt": "one two", "max_tokens": 5, "temperature": 0, "n": 2,
        "logprobs": 1, "stream": True, **IGNORE_EOS})
    texts, offsets = {0: "", 1: ""}, {0: [], 1: []}
    for p in payloads:
        (choice,) = p["choices"]
        i = choice["index"]
        if choice["logprobs"]:
            offsets[i] += choice["logprobs"]["text_offset"]
        texts[i] += choice["text"]
    assert texts[0] == texts[1] and offsets[0] == offsets[1]
    assert offsets[0][0] == 0 and offsets[0] == sorted(offsets[0])
    assert offsets[0][-1] < len(texts[0])


def test_a_seed_gives_choice_i_the_seed_plus_i(server) -> None:
    client = server.client()

    def sample(seed: int, n: int) -> list[str]:
        reply = client.completions.create(
            model=ts.MODEL, prompt="tell me", max_tokens=12, temperature=1.0, seed=seed, n=n,
            extra_body=IGNORE_EOS)
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    choices = sample(7, 3)
    assert choices == [sample(7 + i, 1)[0] for i in range(3)]
    assert len(set(choices)) > 1  # sampled choices differ


def test_n_choices_count_against_the_queue(started) -> None:
    srv = started(ServeSettings(max_queue=2))
    with pytest.raises(openai.RateLimitError, match="each of n"):
        srv.client().completions.create(model=ts.MODEL, prompt="hi", max_tokens=2, n=3)
    reply = srv.client().completions.create(model=ts.MODEL, prompt="hi", max_tokens=2, n=2)
    assert len(reply.choices) == 2


def test_a_client_that_leaves_cancels_every_choice(started) -> None:
    srv = started(delay_s=0.01)
    body = {"model": ts.MODEL, "prompt": "count", "max_tokens": 400, "temperature": 0, "n": 2,
            "stream": True, **IGNORE_EOS}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        seen = set()
        while seen != {0, 1}:  # both choices are running
            line = next(lines)
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
    wait_for(lambda: srv.service.counters["cancelled"] == 2 and not srv.service.engine.busy)
    steps = srv.chain.steps
    assert steps < 300  # long before their 400 tokens
    assert [sum(s.physical for s in r.streams.values()) for r in srv.chain.chain.runners] == [0, 0]
    time.sleep(0.2)
    assert srv.chain.steps == steps
    assert srv.client().completions.create(model=ts.MODEL, prompt="again", max_tokens=2).choices


def test_a_whole_answer_whose_client_leaves_cancels_every_choice(started) -> None:
    srv = started(delay_s=0.01)
    body = {"model": ts.MODEL, "prompt": "count", "max_tokens": 400, "n": 2, **IGNORE_EOS}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=1.0)
    wait_for(lambda: srv.service.counters["cancelled"] == 2 and not srv.service.engine.busy)
    assert srv.chain.steps < 300
    assert [sum(s.physical for s in r.streams.values()) for r in srv.chain.chain.runners] == [0, 0]
