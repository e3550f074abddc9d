"""A text completion's batch of prompts: each prompt answered by its own ``n`` choices, in
order (choice p * n + j is prompt p's choice j), each prompt counted once in ``usage`` and
the metrics, the prompts' first choices started together before any other choice; with
the tiny model, every choice equals its prompt's greedy answer, whole and streamed."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

import tests.zctl.serve.test_app as ts
from tests.zctl.serve.openai.test_choices import IGNORE_EOS, RecordingBackend, sse_payloads
from tests.zctl.serve.test_app import Server, metric_values
from zctl.engine.requests import GenerationChunk, GenerationDone, GenerationRequest
from zctl.engine.scheduler import generate_greedy
from zctl.serve.app import create_app
from zctl.serve.openai.protocol import MAX_PROMPTS
from zctl.serve.settings import ServeSettings

tiny, server, started = ts.tiny, ts.server, ts.started  # the API's fixtures, shared
PROMPTS = ["one two three", "four five", "six"]


class EchoBackend(RecordingBackend):
    """RecordingBackend's fake, answering each prompt upper-cased, with the prompt's
    characters as its prompt tokens."""

    async def generate(self, gen: GenerationRequest):  # noqa: ANN201 - an async generator
        choice = gen.request_id.rpartition("-")[2]
        self.log.append(("asked", choice))
        await asyncio.sleep(0.05)
        self.log.append(("answered", choice))
        text = gen.prompt.upper()
        yield GenerationChunk(gen.request_id, [1], text, 1)
        yield GenerationDone(gen.request_id, [1], text, len(gen.prompt), 50.0, 20.0,
                           stop_reason="max_tokens", cached_tokens=1)


def ask(backend: EchoBackend, body: dict) -> tuple[httpx.Response, str]:
    async def go() -> tuple[httpx.Response, str]:
        transport = httpx.ASGITransport(app=create_app(backend))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            reply = await client.post("/v1/completions", json={"model": "m", **body})
            return reply, (await client.get("/metrics")).text
    return asyncio.run(go())


def test_each_prompt_gets_its_n_choices_in_order_and_counts_once() -> None:
    backend = EchoBackend()
    reply, metrics = ask(backend, {"prompt": PROMPTS, "max_tokens": 1, "n": 2})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == [p.upper() for p in PROMPTS for _ in "ab"]
    prompt_chars = sum(len(p) for p in PROMPTS)  # each prompt once, not once per choice
    assert body["usage"] == {"prompt_tokens": prompt_chars, "completion_tokens": 6,
                             "total_tokens": prompt_chars + 6,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    leaders = {("asked", "0"), ("asked", "2"), ("asked", "4")}
    assert set(backend.log[:3]) == leaders  # every prompt's first choice, together
    assert backend.log.index(("asked", "1")) > max(
        backend.log.index(("answered", c)) for c in "024")  # the others once they answered
    counted = metric_values(metrics, "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
    assert counted == {"vllm:prompt_tokens_total": prompt_chars,
                       "vllm:generation_tokens_total": 6}


@pytest.mark.parametrize(("prompt", "why"), [
    ([], "a list of 1..64 of either"), (["x"] * (MAX_PROMPTS + 1), "a list of 1..64 of either"),
    (["a", 3], "valid string"), ([["a"]], "valid string")])
def test_bad_batches_are_refused(prompt, why) -> None:
    backend = EchoBackend()
    reply, _ = ask(backend, {"prompt": prompt, "max_tokens": 1})
    assert reply.status_code == 400 and why in reply.json()["error"]["message"], reply.text
    assert reply.json()["error"]["param"].startswith("prompt") and backend.log == []


def test_a_batch_counts_every_choice_against_the_queue() -> None:
    backend = EchoBackend()

    async def go() -> httpx.Response:
        app = create_app(backend, ServeSettings(max_queue=5))  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            return await client.post("/v1/completions", json={
                "model": "m", "prompt": PROMPTS, "max_tokens": 1, "n": 2})

    reply = asyncio.run(go())
    assert reply.status_code == 429 and backend.log == []


def test_a_batch_through_the_tiny_model_whole_and_streamed(server: Server, tiny) -> None:
    _, chain, tokenizer = tiny
    want = [tokenizer.decode(list(generate_greedy(chain, tokenizer.encode(p, chat=False), 6)))
            for p in PROMPTS]
    reply = server.client().completions.create(model=ts.MODEL, prompt=PROMPTS, max_tokens=6,
                                               temperature=0, extra_body=IGNORE_EOS)
    assert [c.text for c in reply.choices] == want
    assert reply.usage.prompt_tokens == sum(len(tokenizer.encode(p, chat=False)) for p in PROMPTS)
    payloads = sse_payloads(f"{server.url}/v1/completions", {
        "model": ts.MODEL, "prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "n": 2,
        "stream": True, **IGNORE_EOS})
    texts = [""] * 6
    for p in payloads:
        (choice,) = p["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == [w for w in want for _ in "ab"]
    with pytest.raises(openai.BadRequestError, match="list of 1"):
        server.client().completions.create(model=ts.MODEL, prompt=[], max_tokens=2)
