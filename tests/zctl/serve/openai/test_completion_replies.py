"""A text completion's replies (zctl.serve.openai.completion_replies), pure: each streamed
chunk and the whole reply, the (legacy) logprobs and their text offsets, an echoed
prompt before its choices' text."""

from __future__ import annotations

import json

from zctl.engine.requests import GenerationChunk, GenerationDone, TokenLogprob
from zctl.serve.encoding import sse
from zctl.serve.openai.completion_replies import (
    CompletionChunkWithUsage,
    CompletionReplies,
    echoed_logprobs,
    text_logprobs,
)


def lp(text: str, value: float) -> TokenLogprob:
    return TokenLogprob(1, value, [1, 2], [value, -9.0], text, [text, "z"])


def chunk_of(text: str, logprobs: list[TokenLogprob] | None = None,
             prompt: list[TokenLogprob] | None = None) -> GenerationChunk:
    return GenerationChunk("r", [1], text, 1, logprobs=logprobs or [],
                           prompt_logprobs=prompt or [])


def done_of(text: str, stop_reason: str = "eos") -> GenerationDone:
    return GenerationDone("r", [1, 2], text, 3, 0, 0, stop_reason=stop_reason)


def payload(chunk) -> dict:  # noqa: ANN001 - a reply model
    return json.loads(sse(chunk).removeprefix("data: "))


def test_logprobs_and_their_offsets() -> None:
    out = text_logprobs([lp("ab", -0.5), lp("c", -1e-05)], offset=3)
    assert out.model_dump() == {"tokens": ["ab", "c"], "token_logprobs": [-0.5, -1e-05],
                                "top_logprobs": [{"ab": -0.5, "z": -9.0},
                                                 {"c": -1e-05, "z": -9.0}],
                                "text_offset": [3, 5]}
    first = text_logprobs([lp("Say", -2.0), lp(" it", -1.0)], first_unscored=True)
    assert first.token_logprobs == [None, -1.0] and first.top_logprobs[0] is None
    assert text_logprobs([], first_unscored=True).tokens == []
    echoed = echoed_logprobs("Say it", [lp("Say", -2.0), lp(" it", -1.0)], [lp("!", -0.25)])
    assert echoed.tokens == ["Say", " it", "!"] and echoed.text_offset == [0, 3, 6]
    assert echoed.token_logprobs == [None, -1.0, -0.25]


def test_a_stream_with_echo_and_offsets() -> None:
    replies = CompletionReplies("abc", "m", per_prompt=2, echo=["Say it", "Go"])
    assert replies.opening(4) == []
    echo, text = replies.text_chunks(0, chunk_of("!", [lp("!", -0.5)],
                                                 prompt=[lp("Say", -2.0), lp(" it", -1.0)]))
    assert payload(echo) == {"id": "cmpl-abc", "object": "text_completion",
                             "created": replies.created, "model": "m", "choices": [{
                                 "index": 0, "text": "Say it", "logprobs": {
                                     "tokens": ["Say", " it"], "token_logprobs": [None, -1.0],
                                     "top_logprobs": [None, {" it": -1.0, "z": -9.0}],
                                     "text_offset": [0, 3]},
                                 "finish_reason": None}]}
    assert payload(text)["choices"][0]["logprobs"]["text_offset"] == [6]  # after the prompt
    (more,) = replies.text_chunks(0, chunk_of("?", [lp("?", -0.5)]))  # echoed once
    assert payload(more)["choices"][0]["logprobs"]["text_offset"] == [7]
    held, finish = replies.ending(0, done_of("!?", "max_tokens"))
    assert held == [] and payload(finish)["choices"] == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]
    (late,), _ = replies.ending(2, done_of(""))  # no text came: its echo before its end
    assert payload(late)["choices"][0]["text"] == "Go"  # choice 2: the second prompt's


def test_usage_asked_for_is_null_until_the_last_chunk() -> None:
    replies = CompletionReplies("abc", "m", include_usage=True)
    (text,) = replies.text_chunks(0, chunk_of("hi"))
    assert isinstance(text, CompletionChunkWithUsage) and payload(text)["usage"] is None
    (last,) = replies.closing([done_of("hi")])
    assert payload(last)["choices"] == [] and payload(last)["usage"]["total_tokens"] == 5
    assert CompletionReplies("abc", "m").closing([done_of("hi")]) == []
    assert "usage" not in payload(CompletionReplies("abc", "m").text_chunks(
        0, chunk_of("hi"))[0])


def test_the_whole_reply_with_echo() -> None:
    replies = CompletionReplies("abc", "m", echo=["Say it"])
    reply = replies.reply([done_of("!")], [[lp("!", -0.5)]], [[lp("Say", -2.0), lp(" it", -1.0)]])
    body = reply.model_dump()
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]
    (choice,) = body["choices"]
    assert choice["text"] == "Say it!" and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"] == ["Say", " it", "!"]
    plain = CompletionReplies("abc", "m").reply([done_of("!")], [None], [[]]).model_dump()
    assert plain["choices"] == [{"index": 0, "text": "!", "logprobs": None,
                                 "finish_reason": "stop"}]
