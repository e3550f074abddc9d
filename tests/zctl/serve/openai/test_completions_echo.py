"""``echo`` in text completions: the prompt comes before the completion, and with
``logprobs`` the prompt's tokens are scored too (the first one null, as OpenAI has it), as
evaluation harnesses ask (a prompt's log-likelihood: ``echo``, ``logprobs``,
``max_tokens`` 1). Whole and streamed replies agree; a batch's choices echo their own
prompts."""

from __future__ import annotations

import httpx

import tests.zctl.serve.test_app as ts

tiny, server, started = ts.tiny, ts.server, ts.started  # the API's fixtures, shared
PROMPT = "the quick brown fox jumps over the lazy dog, and then"
ON = {"zctl": {"ignore_eos": True}}  # every asked token comes


def test_echo_scores_the_prompt_before_the_completion(server) -> None:
    client = server.client()
    plain = client.completions.create(model=ts.MODEL, prompt=PROMPT, max_tokens=4,
                                      temperature=0, logprobs=2, extra_body=ON)
    echo = client.completions.create(model=ts.MODEL, prompt=PROMPT, max_tokens=4,
                                     temperature=0, logprobs=2, echo=True, extra_body=ON)
    prompt_tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT},
                               timeout=30).json()["count"]
    assert echo.usage.prompt_tokens == prompt_tokens == plain.usage.prompt_tokens
    text, lps = echo.choices[0].text, echo.choices[0].logprobs
    assert text == PROMPT + plain.choices[0].text
    assert len(lps.tokens) == prompt_tokens + 4
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    head = lps.token_logprobs[1:prompt_tokens]
    assert all(lp <= 0 for lp in head) and len(set(head)) > 1
    for token, value, top in zip(lps.tokens[1:prompt_tokens], head, lps.top_logprobs[1:],
                                 strict=False):
        assert 1 <= len(top) <= 2 and max(top.values()) >= value - 1e-6  # (texts may clash)
        assert token not in top or abs(top[token] - value) < 1e-6
    # the completion's part is the plain reply's, its offsets after the prompt's text
    tail = plain.choices[0].logprobs
    assert lps.tokens[prompt_tokens:] == tail.tokens
    # (near, not equal: the echo's prompt goes in 16-token chunks, and this server's u8 KV
    # cache rounds what a later chunk reads of an earlier one; exact numerics agree)
    assert all(abs(a - b) < 0.1 for a, b in zip(lps.token_logprobs[prompt_tokens:],
                                                tail.token_logprobs, strict=True))
    assert lps.text_offset[prompt_tokens:] == [len(PROMPT) + o for o in tail.text_offset]
    assert lps.text_offset == sorted(lps.text_offset)


def test_a_streamed_echo_sends_the_prompt_first_and_agrees_with_the_whole(server) -> None:
    client = server.client()
    whole = client.completions.create(model=ts.MODEL, prompt=PROMPT, max_tokens=6,
                                      temperature=0, logprobs=1, echo=True, extra_body=ON)
    chunks = list(client.completions.create(model=ts.MODEL, prompt=PROMPT, max_tokens=6,
                                            temperature=0, logprobs=1, echo=True, stream=True,
                                            extra_body=ON))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == PROMPT and "".join(texts) == whole.choices[0].text
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs


def test_echo_without_logprobs_and_in_a_batch(server) -> None:
    client = server.client()
    prompts = [PROMPT, "one two three"]
    reply = client.completions.create(model=ts.MODEL, prompt=prompts, max_tokens=3,
                                      temperature=0, echo=True, n=2, extra_body=ON)
    for i, choice in enumerate(sorted(reply.choices, key=lambda c: c.index)):
        assert choice.text.startswith(prompts[i // 2]) and choice.logprobs is None
        assert len(choice.text) > len(prompts[i // 2])


def test_a_prompts_log_likelihood_as_an_evaluation_harness_asks(server) -> None:
    """Context + continuation, max_tokens 1: the continuation's tokens' logprobs are the
    echoed ones after the context's, and the greedy check is whether each is the top."""
    client = server.client()
    context, continuation = "the quick brown fox", " jumps over the lazy dog"
    count = httpx.post(f"{server.url}/tokenize", json={"prompt": context},
                       timeout=30).json()["count"]
    reply = client.completions.create(model=ts.MODEL, prompt=context + continuation,
                                      max_tokens=1, temperature=0, logprobs=1, echo=True)
    lps = reply.choices[0].logprobs
    scores = lps.token_logprobs[count:-1]
    assert scores and all(s <= 0 for s in scores)
    assert "".join(lps.tokens[count:-1]) == continuation
