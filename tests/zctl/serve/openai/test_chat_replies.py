"""A chat completion's replies (zctl.serve.openai.chat_replies), pure: each streamed chunk
and the whole reply as OpenAI's reference has them (null and absent fields where it has
them), a call held to its choice's end, the tokens' logprobs."""

from __future__ import annotations

import json

from zctl.engine.requests import GenerationChunk, GenerationDone, TokenLogprob
from zctl.serve.encoding import sse
from zctl.serve.openai.chat_replies import (
    ChatCompletionChunk,
    ChatCompletionChunkWithUsage,
    ChatReplies,
    chat_logprobs,
)
from zctl.serve.tools import FunctionDef, ToolPlan

CALL_TEXT = '{"name": "time", "arguments": {"zone": "UTC"}}'
TOOLS = ToolPlan([FunctionDef(name="time")])
LP = TokenLogprob(5, -1.5e-05, [5, 6], [-1.5e-05, -11.25], "é", ["é", "e"])


def chunk_of(text: str, logprobs: list[TokenLogprob] | None = None) -> GenerationChunk:
    return GenerationChunk("r", [5], text, 1, logprobs=logprobs or [])


def done_of(text: str, stop_reason: str = "eos") -> GenerationDone:
    return GenerationDone("r", [5, 6], text, 4, 0, 0, stop_reason=stop_reason, cached_tokens=2)


def payload(chunk) -> dict:  # noqa: ANN001 - a reply model
    return json.loads(sse(chunk).removeprefix("data: "))


def test_a_stream_of_text_chunk_by_chunk() -> None:
    replies = ChatReplies("abc", "m", per_prompt=2)
    role = replies.opening(2)
    assert [payload(c)["choices"] for c in role] == [
        [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
          "finish_reason": None}] for i in (0, 1)]
    (text,) = replies.text_chunks(1, chunk_of("hi"))
    assert payload(text) == {"id": "chatcmpl-abc", "object": "chat.completion.chunk",
                             "created": replies.created, "model": "m", "choices": [
                                 {"index": 1, "delta": {"content": "hi"}, "logprobs": None,
                                  "finish_reason": None}]}
    assert "usage" not in payload(text)  # not asked for: absent
    assert replies.text_chunks(0, chunk_of("")) == []  # nothing to show
    held, finish = replies.ending(1, done_of("hi", "max_tokens"))
    assert held == []
    assert payload(finish)["choices"] == [{"index": 1, "delta": {}, "logprobs": None,
                                           "finish_reason": "length"}]
    assert replies.closing([done_of("a"), done_of("b")]) == []


def test_usage_asked_for_is_null_until_the_last_chunk() -> None:
    replies = ChatReplies("abc", "m", include_usage=True)
    (role,) = replies.opening(1)
    assert isinstance(role, ChatCompletionChunkWithUsage) and payload(role)["usage"] is None
    (text,) = replies.text_chunks(0, chunk_of("hi"))
    assert list(payload(text)) == ["id", "object", "created", "model", "choices", "usage"]
    (last,) = replies.closing([done_of("hi")])
    assert payload(last)["choices"] == [] and payload(last)["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 2}}


def test_a_call_is_held_and_comes_whole_at_its_end() -> None:
    replies = ChatReplies("abc", "m", tools=TOOLS)  # "required": every chunk is held
    assert replies.text_chunks(0, chunk_of(CALL_TEXT[:9])) == []
    (held,), finish = replies.ending(0, done_of(CALL_TEXT))
    (call,) = payload(held)["choices"][0]["delta"]["tool_calls"]
    assert list(call) == ["index", "id", "type", "function"] and call["index"] == 0
    assert call["function"] == {"name": "time", "arguments": '{"zone": "UTC"}'}
    assert payload(finish)["choices"][0]["finish_reason"] == "tool_calls"
    cut = ChatReplies("abc", "m", tools=TOOLS)  # a call cut short: the text it was cut to
    (text,), finish = cut.ending(0, done_of(CALL_TEXT[:9], "max_tokens"))
    assert payload(text)["choices"][0]["delta"] == {"content": CALL_TEXT[:9]}
    assert payload(finish)["choices"][0]["finish_reason"] == "length"


def test_auto_tools_show_text_that_is_not_a_call() -> None:
    replies = ChatReplies("abc", "m", tools=ToolPlan(TOOLS.functions, optional=True))
    assert len(replies.text_chunks(0, chunk_of("Sure"))) == 1
    assert replies.ending(0, done_of("Sure"))[0] == []
    assert replies.text_chunks(1, chunk_of("{")) == []  # a call begins so


def test_the_whole_reply() -> None:
    replies = ChatReplies("abc", "m", per_prompt=2, tools=ToolPlan(TOOLS.functions,
                                                                    optional=True))
    reply = replies.reply([done_of("Sure"), done_of(CALL_TEXT)], [None, [LP]], [[], []])
    body = reply.model_dump()
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]
    assert body["object"] == "chat.completion"
    text, call = body["choices"]
    assert text == {"index": 0, "message": {"role": "assistant", "content": "Sure"},
                    "logprobs": None, "finish_reason": "stop"}
    assert call["message"]["content"] is None and call["finish_reason"] == "tool_calls"
    assert call["message"]["tool_calls"][0]["function"]["name"] == "time"
    assert body["usage"]["prompt_tokens"] == 4  # n=2 of one prompt: counted once
    none_asked = replies.reply([done_of("x")], [[]], [[]]).model_dump()
    assert none_asked["choices"][0]["logprobs"] == {"content": [], "refusal": None}


def test_logprobs_as_the_chat_api_has_them() -> None:
    assert chat_logprobs([LP]).model_dump() == {"content": [{
        "token": "é", "logprob": -1.5e-05, "bytes": [195, 169], "top_logprobs": [
            {"token": "é", "logprob": -1.5e-05, "bytes": [195, 169]},
            {"token": "e", "logprob": -11.25, "bytes": [101]}]}], "refusal": None}
    (streamed,) = ChatReplies("abc", "m").text_chunks(0, chunk_of("é", [LP]))
    assert isinstance(streamed, ChatCompletionChunk)
    assert '"logprob":-1.5e-05' in sse(streamed)  # as json.dumps spells it
