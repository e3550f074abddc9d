"""Chat completions (zctl.serve.openai.chat) through the official ``openai`` client, sync and
async: whole and streamed answers equal greedy, usage (the prefix cache's tokens too), stop
strings, seeds, logprobs and lookup speculation."""

from __future__ import annotations

import asyncio

import numpy as np
import openai

import tests.zctl.serve.test_app as ts
from zctl.engine.prefill_pieces import CANONICAL
from zctl.serve.settings import ServeSettings

tiny, server, started = ts.tiny, ts.server, ts.started  # the API's fixtures, shared


def test_chat_whole_and_streamed_equal_greedy_with_usage(server, tiny) -> None:
    client = server.client()
    want, tokens = ts.greedy_text(tiny, [(m["role"], m["content"]) for m in ts.ASK], 12)
    reply = client.chat.completions.create(model=ts.MODEL, messages=ts.ASK, max_tokens=12,
                                           temperature=0, extra_body={"zctl": {"ignore_eos": True}})
    assert reply.choices[0].message.content == want
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.role == "assistant"
    prompt_tokens = len(tiny[2].encode_chat([(m["role"], m["content"]) for m in ts.ASK]))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 12)
    assert reply.model == ts.MODEL and reply.id.startswith("chatcmpl-")
    stream = client.chat.completions.create(
        model=ts.MODEL, messages=ts.ASK, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"zctl": {"ignore_eos": True}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(tiny) -> None:
    export_dir, chain, _ = tiny  # (the chain itself: SlowChain keeps no prefix cache)
    srv = ts.Server(export_dir, chain, ServeSettings(), prefix_cache_mb=64)
    try:
        cached_follow_up(srv.client())
    finally:
        srv.stop()


def cached_follow_up(client: openai.OpenAI) -> None:
    turns = [{"role": "user", "content": "tell me about the sea and the sky " * 8}]
    first = client.chat.completions.create(model=ts.MODEL, messages=turns, max_tokens=6,
                                           temperature=0, extra_body={"zctl": {"ignore_eos": True}})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turns += [{"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "and then?"}]
    follow = client.chat.completions.create(model=ts.MODEL, messages=turns, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [c for c in follow][-1].usage
    # the first turn's prompt (the answer's KV, written by decode steps, is not reused:
    # zctl.engine.prefill_pieces)
    assert usage.prompt_tokens_details.cached_tokens == CANONICAL.usable_prefix(
        first.usage.prompt_tokens, usage.prompt_tokens) > 0


def test_stop_strings_cut_the_text_and_finish_with_stop(server, tiny) -> None:
    want, _ = ts.greedy_text(tiny, [("user", "the sky is")], 24)
    stop = want[6:9]
    client = server.client()
    for stream in (False, True):
        kwargs = dict(model=ts.MODEL, messages=[{"role": "user", "content": "the sky is"}],
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
            model=ts.MODEL, messages=[{"role": "user", "content": "tell me"}], max_tokens=16,
            temperature=1.0, top_p=0.95, seed=seed,
            extra_body={"zctl": {"ignore_eos": True}}).choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert any(sample(s) != first for s in (8, 9, 10))


def test_logprobs_of_chat_and_completions(server) -> None:
    client = server.client()
    reply = client.chat.completions.create(
        model=ts.MODEL, messages=ts.ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"zctl": {"ignore_eos": True}})
    content = reply.choices[0].logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert token.logprob <= 0 and abs(token.logprob - tops[0]) < 1e-6  # greedy: the best
    full = client.chat.completions.create(  # the same read from float32 logits
        model=ts.MODEL, messages=ts.ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"zctl": {"ignore_eos": True, "logits_payload": "fp32"}})
    assert [t.token for t in full.choices[0].logprobs.content] == [t.token for t in content]
    assert np.allclose([t.logprob for t in full.choices[0].logprobs.content],
                       [t.logprob for t in content], atol=1e-4)
    text = client.completions.create(model=ts.MODEL, prompt="one two", max_tokens=4, temperature=0,
                                     logprobs=2, extra_body={"zctl": {"ignore_eos": True}})
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    # (the legacy format keys alternatives by text: two ids of the same text are one)
    assert lp.text_offset[0] == 0 and all(1 <= len(t) <= 2 for t in lp.top_logprobs)


def test_lookup_speculation_returns_exactly_the_greedy_text(server) -> None:
    client = server.client()
    ask = [{"role": "user", "content": "one two three one two three one two"}]
    plain = client.chat.completions.create(model=ts.MODEL, messages=ask, max_tokens=20,
                                           temperature=0, extra_body={"zctl": {"ignore_eos": True}})
    spec = client.chat.completions.create(
        model=ts.MODEL, messages=ask, max_tokens=20, temperature=0,
        extra_body={"zctl": {"ignore_eos": True, "speculative": "lookup", "k": 3}})
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.completion_tokens == plain.usage.completion_tokens == 20


def test_the_async_client_streams(server, tiny) -> None:
    want, _ = ts.greedy_text(tiny, [("user", "the sky is")], 10)

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        async def one() -> str:
            stream = await client.chat.completions.create(
                model=ts.MODEL, messages=[{"role": "user", "content": "the sky is"}], max_tokens=10,
                temperature=0, stream=True, extra_body={"zctl": {"ignore_eos": True}})
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        try:
            return await asyncio.gather(one(), one(), one())
        finally:
            await client.close()

    assert asyncio.run(run()) == [want] * 3
