"""``/tokenize`` and ``/detokenize`` (vLLM's routes, zctl.serve.app): a prompt's ids are the
ones its generation is prompted with (``usage.prompt_tokens`` counts them, chat template
and tools prompt included); ids come back to text; bad requests are 400s that leave the
server serving."""

from __future__ import annotations

import httpx
import pytest

import tests.zctl.serve.test_app as ts
from tests.zctl.serve.test_app import ASK
from tests.zctl.serve.test_tools import TIME
from zctl.serve.settings import ServeSettings

tiny, server, started = ts.tiny, ts.server, ts.started  # the API's fixtures, shared


def post(server, route: str, **body) -> httpx.Response:  # noqa: ANN001 - the test Server
    return httpx.post(f"{server.url}{route}", json=body, timeout=30)


@pytest.mark.parametrize("tools", [None, [TIME]])
def test_a_chats_ids_are_the_ones_its_generation_counts(server, tiny, tools) -> None:
    extra = {"tools": tools} if tools else {}
    answer = post(server, "/tokenize", model=ts.MODEL, messages=ASK, **extra).json()
    reply = server.client().chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=2,
                                                    temperature=0, **extra)
    assert answer["count"] == len(answer["tokens"]) == reply.usage.prompt_tokens
    tokenizer = tiny[2]
    if tools is None:
        assert answer["tokens"] == tokenizer.encode_chat([(t["role"], t["content"]) for t in ASK])
    assert answer["max_model_len"] == server.client().models.list().data[0].context_length
    assert answer["token_strs"] is None


def test_a_prompts_ids_their_strings_and_back(server, tiny) -> None:
    prompt = "the sky is blue, said the tiny model"
    answer = post(server, "/tokenize", prompt=prompt, return_token_strs=True).json()
    reply = server.client().completions.create(model=ts.MODEL, prompt=prompt, max_tokens=2,
                                               temperature=0)
    assert answer["count"] == reply.usage.prompt_tokens
    assert answer["tokens"] == tiny[2].encode(prompt, chat=False)
    assert len(answer["token_strs"]) == answer["count"] and all(answer["token_strs"])
    text = post(server, "/detokenize", model=ts.MODEL, tokens=answer["tokens"]).json()["prompt"]
    assert text.endswith(prompt)
    chat = post(server, "/tokenize", messages=ASK).json()["tokens"]
    rendered = post(server, "/detokenize", tokens=chat).json()["prompt"]
    assert "the sky is" in rendered and "be brief" in rendered
    assert rendered != "be brief the sky is"  # the chat template's own text is kept


@pytest.mark.parametrize(("route", "body", "why"), [
    ("/tokenize", {"model": "nope", "prompt": "hi"}, "model_not_found"),
    ("/tokenize", {"prompt": "hi", "messages": ASK}, "give a prompt or messages"),
    ("/tokenize", {}, "give a prompt or messages"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": ASK, "tool_choice": "required"}, "tool_choice needs tools"),
    ("/tokenize", {"prompt": "x" * ((1 << 20) + 1)}, "at most"),
    ("/detokenize", {"tokens": [0, 10**9]}, "outside the model's vocabulary"),
    ("/detokenize", {"tokens": [-1]}, "outside the model's vocabulary"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, "model_not_found"),
])
def test_bad_token_requests_are_400s_and_the_server_serves_on(server, route, body, why) -> None:
    answer = post(server, route, **body)
    assert answer.status_code == 400, answer.text
    assert why in answer.text and answer.json()["error"]["type"] == "invalid_request_error"
    assert post(server, "/tokenize", prompt="still here").json()["count"] > 0


def test_the_token_routes_need_the_key(started) -> None:
    srv = started(ServeSettings(api_key="secret"))
    assert post(srv, "/tokenize", prompt="hi").status_code == 401
    assert post(srv, "/detokenize", tokens=[1]).status_code == 401
    ok = httpx.post(f"{srv.url}/tokenize", json={"prompt": "hi"}, timeout=30,
                    headers={"Authorization": "Bearer secret"})
    assert ok.status_code == 200 and ok.json()["count"] > 0


def test_the_token_routes_count_against_the_queue(started) -> None:
    """The generation thread tokenizes: --max-queue bounds these requests as it bounds
    generations (a flood of them cannot starve the running streams)."""
    srv = started(ServeSettings(max_queue=1), delay_s=0.01)
    body = {"model": ts.MODEL, "prompt": "count", "max_tokens": 40, "temperature": 0,
            "stream": True, "zctl": {"ignore_eos": True}}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        for route, extra in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            busy = post(srv, route, **extra)
            assert busy.status_code == 429 and "in flight" in busy.text
        assert [line for line in lines if line][-1] == "data: [DONE]"
    assert post(srv, "/tokenize", prompt="hi").status_code == 200  # room again
