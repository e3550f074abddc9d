"""Text completions (zctl.serve.openai.completions) through the official ``openai`` client:
whole and streamed answers equal greedy; penalties and a logit bias steer the answer."""

from __future__ import annotations

import httpx

import tests.zctl.serve.test_app as ts
from zctl.engine.scheduler import generate_greedy

tiny, server, started = ts.tiny, ts.server, ts.started  # the API's fixtures, shared


def test_completions_whole_and_streamed(server, tiny) -> None:
    _, chain, tokenizer = tiny
    client = server.client()
    tokens = list(generate_greedy(chain, tokenizer.encode("one two three", chat=False), 8))
    want = tokenizer.decode(tokens)
    reply = client.completions.create(model=ts.MODEL, prompt="one two three", max_tokens=8,
                                      temperature=0, extra_body={"zctl": {"ignore_eos": True}})
    assert reply.choices[0].text == want and reply.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=ts.MODEL, prompt="one two three", max_tokens=8, temperature=0, stream=True,
        extra_body={"zctl": {"ignore_eos": True}}) if c.choices)
    assert streamed == want


def test_penalties_and_a_logit_bias_steer_the_answer(server, tiny) -> None:
    client = server.client()
    tokenizer = tiny[2]

    def answer(extra: dict | None = None, **kwargs) -> tuple[str, list[str]]:
        reply = client.completions.create(
            model=ts.MODEL, prompt="again and again", max_tokens=24, temperature=0,
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
            model=ts.MODEL, messages=[{"role": "user", "content": "say it again"}], max_tokens=16,
            temperature=0.9, seed=3, extra_body={"zctl": {"ignore_eos": True}},
            **kwargs).choices[0].message.content

    assert sampled(frequency_penalty=-2.0) == sampled(frequency_penalty=-2.0) != sampled()
    nulls = {"model": ts.MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
             "temperature": None, "top_p": None, "n": None, "presence_penalty": None,
             "frequency_penalty": None}  # OpenAI's API takes null for these: the defaults
    assert httpx.post(f"{server.url}/v1/chat/completions", json=nulls).status_code == 200
