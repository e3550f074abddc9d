"""vLLM's extra request fields, top-level as vLLM takes them, so clients written for vLLM
work unchanged: ``repetition_penalty``, ``min_p``, ``top_k``, ``ignore_eos`` and
``stop_token_ids``; out-of-range values are 400s."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

import tests.zctl.serve.test_app as ts
from zctl.engine.requests import GenerationRequest
from zctl.serve.openai.protocol import (
    CompletionRequest,
    chat_request,
    to_generation,
    to_generations,
)
from zctl.serve.openai.responses_protocol import ResponsesRequest

tiny, server, started = ts.tiny, ts.server, ts.started  # the API's fixtures, shared
PROMPT = "again and again"


def completion(server, **extra):  # noqa: ANN001, ANN201 - the test Server, the client's reply
    return server.client().completions.create(
        model=ts.MODEL, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, **extra})


def test_repetition_penalty_repeats_less(server) -> None:
    plain = completion(server).choices[0].logprobs.tokens
    penalised = completion(server, repetition_penalty=2.0).choices[0].logprobs.tokens
    assert len(plain) == len(penalised) == 24  # ignore_eos, top-level
    assert len(set(penalised)) > len(set(plain))


@pytest.mark.parametrize("seed", [5, 6])
def test_sampled_tokens_hold_min_p_and_top_k(server, seed) -> None:
    reply = server.client().completions.create(
        model=ts.MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=seed, logprobs=3,
        extra_body={"min_p": 0.3, "top_k": 3, "ignore_eos": True})
    lps = reply.choices[0].logprobs
    assert len(lps.tokens) == 24
    for value, top in zip(lps.token_logprobs, lps.top_logprobs, strict=True):
        assert value >= max(top.values()) + np.log(0.3) - 1e-6  # min_p
        assert value >= sorted(top.values())[-min(3, len(top))] - 1e-6  # top_k


def test_stop_token_ids_end_the_answer_as_a_stop(server, tiny) -> None:
    tokens = completion(server).choices[0].logprobs.tokens
    tokenizer = tiny[2]
    stop = tokenizer.encode(tokens[3], chat=False)[-1]  # the 4th token's id
    reply = completion(server, stop_token_ids=[stop])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == "".join(tokens[:tokens.index(tokens[3])])


@pytest.mark.parametrize("extra", [{"repetition_penalty": 0}, {"repetition_penalty": 2.5},
                                   {"min_p": 1.5}, {"top_k": -2}, {"stop_token_ids": [-1]},
                                   {"stop_token_ids": list(range(65))}])
def test_bad_vllm_fields_are_400s(server, extra) -> None:
    answer = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "model": ts.MODEL, "prompt": "hi", "max_tokens": 2, **extra})
    assert answer.status_code == 400 and next(iter(extra)) in answer.text, answer.text


# OpenAI's defaults for what a request leaves out, never the model's (zctl.engine.
# sampling_defaults applies only to fields a request leaves as None)
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                   "repetition_penalty": 1.0}


def sampling_of(generation: GenerationRequest) -> dict:
    return {name: getattr(generation, name) for name in OPENAI_DEFAULTS}


def test_a_request_without_sampling_keeps_openais_defaults() -> None:
    chat = chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert sampling_of(to_generation(chat, "c")) == OPENAI_DEFAULTS
    nulls = chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "temperature": None, "top_p": None})
    assert sampling_of(to_generation(nulls, "n")) == OPENAI_DEFAULTS
    text = CompletionRequest.model_validate({"model": "m", "prompt": "hi"})
    assert all(sampling_of(g) == OPENAI_DEFAULTS for g in to_generations(text, "t"))
    response = ResponsesRequest(model="m", input="hi").chat([])
    assert sampling_of(to_generation(response, "r")) == OPENAI_DEFAULTS
    given = chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "temperature": 0, "top_k": 5})
    assert sampling_of(to_generation(given, "g")) == {**OPENAI_DEFAULTS, "temperature": 0.0,
                                                      "top_k": 5}
