"""A text completion's prompt given as token ids (OpenAI's other prompt forms: ids, or a
batch of id lists, as evaluation harnesses send them): the same generation as the text
with those ids; echo answers with the ids' text; ids outside the vocabulary, empty or
mixed prompts are 400s, and at the service a refusal that leaves it serving."""

from __future__ import annotations

import asyncio

import httpx
import pytest

import tests.zctl.serve.test_app as ts
from zctl.engine.requests import GenerationDone, GenerationRequest
from zctl.service.async_client import AsyncServiceClient
from zctl.service.client import generate_stream
from zctl.service.messages import TokenizeRequest

tiny, server, started = ts.tiny, ts.server, ts.started  # the API's fixtures, shared
TEXTS = ["the sky is", "one two three four"]
ON = {"zctl": {"ignore_eos": True}}


def ids_of(server, text: str) -> list[int]:  # noqa: ANN001 - the test Server
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]


def test_token_ids_generate_as_their_text_does(server) -> None:
    client = server.client()
    ids = [ids_of(server, t) for t in TEXTS]
    for text, tokens in zip(TEXTS, ids, strict=True):
        by_text = client.completions.create(model=ts.MODEL, prompt=text, max_tokens=6,
                                            temperature=0, extra_body=ON)
        by_ids = client.completions.create(model=ts.MODEL, prompt=tokens, max_tokens=6,
                                           temperature=0, extra_body=ON)
        assert by_ids.choices[0].text == by_text.choices[0].text
        assert by_ids.usage.prompt_tokens == len(tokens) == by_text.usage.prompt_tokens
    batch = client.completions.create(model=ts.MODEL, prompt=ids, max_tokens=6, temperature=0,
                                      extra_body=ON)
    texts = client.completions.create(model=ts.MODEL, prompt=TEXTS, max_tokens=6,
                                      temperature=0, extra_body=ON)
    assert [c.text for c in batch.choices] == [c.text for c in texts.choices]


def test_echoed_token_ids_are_their_text_and_scored(server, tiny) -> None:
    ids = ids_of(server, TEXTS[1])
    reply = server.client().completions.create(model=ts.MODEL, prompt=ids, max_tokens=3,
                                               temperature=0, logprobs=1, echo=True,
                                               extra_body=ON)
    choice, decoded = reply.choices[0], tiny[2].decode(ids)  # special tokens left out
    assert choice.text.startswith(decoded) and len(choice.text) > len(decoded)
    assert len(choice.logprobs.tokens) == len(ids) + 3
    assert "".join(choice.logprobs.tokens[:len(ids)]) == decoded


@pytest.mark.parametrize(("prompt", "why"), [
    ([0, 10**6], "outside the model's vocabulary"),
    ([-1, 2], "prompt"),
    ([], "prompt"),
    ([[]], "prompt"),
    ([[1, 2], []], "prompt"),
    (["a", [1, 2]], "prompt"),
    ([True, 2], "prompt"),
])
def test_bad_token_prompts_are_400s(server, prompt, why) -> None:
    answer = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "model": ts.MODEL, "prompt": prompt, "max_tokens": 2})
    assert answer.status_code == 400 and why in answer.text, answer.text
    assert server.client().completions.create(model=ts.MODEL, prompt=[1, 2, 3],
                                              max_tokens=1).choices


def test_the_service_refuses_ids_outside_the_vocabulary_and_serves_on(server) -> None:
    endpoint = server.service.endpoint
    done = list(generate_stream(endpoint, GenerationRequest("x", max_tokens=2, chat=False,
                                                          prompt_ids=[1, 10**6])))[-1]
    assert isinstance(done, GenerationDone) and "outside" in done.error

    async def tokenize() -> str:
        backend = AsyncServiceClient(endpoint)
        try:
            return (await backend.tokens(TokenizeRequest(GenerationRequest(
                "t", chat=False, prompt_ids=[10**6])))).error
        finally:
            await backend.close()

    assert "outside" in asyncio.run(tokenize())
    ok = list(generate_stream(endpoint, GenerationRequest("y", max_tokens=2, chat=False,
                                                        prompt_ids=[1, 2, 3])))[-1]
    assert not ok.error and len(ok.tokens) >= 1
    assert GenerationRequest("z", "hi", prompt_ids=[1]).problem() is not None  # one of them
    assert GenerationRequest("z", prompt_ids=[1]).problem() is not None  # raw only
