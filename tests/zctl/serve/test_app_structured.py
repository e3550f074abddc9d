"""Structured output through the API: ``response_format`` (``json_object``, ``json_schema``)
and zctl's ``regex``, ``grammar`` and ``choice`` extras, with the official client, whole and
streamed, sampled with ``n`` choices and beside speculation; bad grammars and clashing
constraints are 400s and leave the server serving."""

from __future__ import annotations

import json
import re

import openai
import pytest

import tests.zctl.serve.test_app as ts
from tests.zctl.engine.test_constraints import PERSON
from tests.zctl.serve.openai.test_choices import sse_payloads
from tests.zctl.serve.test_app import ASK, greedy_text, metric_values

tiny, server, started = ts.tiny, ts.server, ts.started  # the API's fixtures, shared
PERSON_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def check_person(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "pet"} and 0 <= value["age"] <= 120, text
    assert value["pet"] in ("cat", "dog", None) and len(value["name"]) <= 6, text


def test_a_json_schema_holds_the_reply_whole_and_streamed(server) -> None:
    client = server.client()
    reply = client.chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=200,
                                           temperature=0, response_format=PERSON_FORMAT)
    text = reply.choices[0].message.content
    check_person(text)
    assert reply.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=200,
                                            temperature=0, response_format=PERSON_FORMAT,
                                            stream=True)
    pieces, finish = [], None
    for chunk in chunks:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == text and finish == "stop"


def test_the_reply_without_a_format_is_not_json(tiny) -> None:
    want, _ = greedy_text(tiny, [(m["role"], m["content"]) for m in ASK], 40)
    with pytest.raises(ValueError):
        json.loads(want)


def test_json_object_gives_an_object_and_completions_take_formats_too(server) -> None:
    client = server.client()
    reply = client.chat.completions.create(
        model=ts.MODEL, messages=ASK, max_tokens=300, temperature=0,
        response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":  # a random model may fill max_tokens
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].message.content.startswith("{")
    text = client.completions.create(model=ts.MODEL, prompt="one two", max_tokens=40,
                                     temperature=0, extra_body={"zctl": {"regex": "[a-c]{5}"}})
    assert re.fullmatch("[a-c]{5}", text.choices[0].text)
    assert text.choices[0].finish_reason == "stop"


def test_regex_grammar_and_choices_through_the_extras(server) -> None:
    client = server.client()
    for extra, check in (
            ({"regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
            ({"grammar": 'root ::= "Yes" | "No"'}, lambda t: t in ("Yes", "No")),
            ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue"))):
        reply = client.chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=30,
                                               temperature=0, extra_body={"zctl": extra})
        assert check(reply.choices[0].message.content), (extra, reply.choices[0].message.content)


def test_sampled_choices_and_speculation_keep_to_the_schema(server) -> None:
    client = server.client()
    reply = client.chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=200,
                                           temperature=1.0, seed=7, n=3,
                                           response_format=PERSON_FORMAT)
    for choice in reply.choices:
        check_person(choice.message.content)
    plain = client.chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=200,
                                           temperature=0, response_format=PERSON_FORMAT)
    spec = client.chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=200,
                                          temperature=0, response_format=PERSON_FORMAT,
                                          extra_body={"zctl": {"speculative": "lookup"}})
    assert spec.choices[0].message.content == plain.choices[0].message.content


def test_a_streamed_schema_reply_on_the_wire(server) -> None:
    payloads = sse_payloads(f"{server.url}/v1/chat/completions", {
        "model": ts.MODEL, "messages": ASK, "max_tokens": 200, "temperature": 0,
        "stream": True, "response_format": PERSON_FORMAT})
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads)
    check_person(text)
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(("body", "why"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "frob"}}}},
     "frob"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "zctl": {"regex": "a+"}}, "give one of"),
    ({"zctl": {"regex": "[a-z+"}}, "unclosed character class"),
    ({"zctl": {"choice": []}}, "choice"),
    ({"zctl": {"grammar": "root ::= ("}}, "grammar"),
])
def test_bad_formats_are_400s_and_the_server_keeps_serving(server, body, why) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError, match=re.escape(why)):
        client.chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=8,
                                       extra_body=body)
    reply = client.chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=4,
                                           extra_body={"zctl": {"regex": "ok"}})
    assert reply.choices[0].message.content == "ok"


def test_metrics_count_structured_requests_and_forced_tokens(server) -> None:
    import httpx

    def counted() -> dict[str, float]:
        return metric_values(httpx.get(f"{server.url}/metrics", timeout=30).text,
                             "zctl_structured_requests_total", "zctl_forced_tokens_total")

    before = counted()
    server.client().chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=200,
                                            temperature=0, response_format=PERSON_FORMAT)
    server.client().chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=4)
    after = counted()
    assert after["zctl_structured_requests_total"] == before["zctl_structured_requests_total"] + 1
    # the schema's keys and punctuation: '{"name": "', '", "age": ', ... fed by jump-forward
    assert after["zctl_forced_tokens_total"] >= before["zctl_forced_tokens_total"] + 8
