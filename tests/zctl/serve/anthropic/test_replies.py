"""Anthropic's replies (zctl.serve.anthropic.replies), pure: the message, its streamed
events and their JSON, which stop sequence ended it, errors in Anthropic's shape."""

from __future__ import annotations

import json

from zctl.engine.requests import GenerationDone
from zctl.serve.anthropic.replies import (
    ContentBlockStartEvent,
    MessageEvents,
    ToolUseBlock,
    error_body,
    matched_stop,
    message,
)
from zctl.serve.encoding import named_events
from zctl.serve.errors import ApiError
from zctl.serve.tools import FunctionCall, ToolCall

CALL = ToolCall(id="call_9", function=FunctionCall(name="f", arguments='{"a": 1}'))


def done_of(text: str, stop_reason: str = "eos") -> GenerationDone:
    return GenerationDone("r", [1, 2], text, 3, 0, 0, stop_reason=stop_reason, cached_tokens=1)


def test_the_stop_sequence_that_ended_a_message() -> None:
    assert matched_stop("ab", "ab\nXcd", ["cd", "\nX"]) == "\nX"
    assert matched_stop("ab", "abc", ["zz"]) is None
    assert matched_stop("ab", "ab", ["only"]) is None  # a grammar or a stop token ended it
    assert matched_stop("a", "a bc", ["c", "b"]) == "b"  # the first to appear


def test_a_call_comes_whole_at_the_end_of_a_stream() -> None:
    done = GenerationDone("r", [1], '{"name": "f", "arguments": {"a": 1}}', 3, 0, 0,
                          stop_reason="eos")
    events = MessageEvents("msg_1", "m").end(done, [CALL], True, None)
    assert [e.type for e in events] == ["content_block_start", "content_block_delta",
                                        "content_block_stop", "message_delta",
                                        "message_stop"]
    assert isinstance(events[0], ContentBlockStartEvent)
    assert events[0].content_block.model_dump() == {"type": "tool_use", "id": "toolu_9",
                                                    "name": "f", "input": {}}
    assert json.loads(events[1].delta.partial_json) == {"a": 1}
    assert events[3].delta.stop_reason == "tool_use"


def test_a_streamed_text_message_as_named_events() -> None:
    stream = MessageEvents("msg_1", "m")
    text = named_events(stream.start() + stream.text("hé") + stream.text("llo")
                        + stream.end(done_of("héllo", "max_tokens"), None, False, None))
    events = [block.split("\n") for block in text.split("\n\n")[:-1]]
    names = [lines[0].removeprefix("event: ") for lines in events]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    data = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert [d["type"] for d in data] == names
    assert data[0]["message"] == {"id": "msg_1", "type": "message", "role": "assistant",
                                  "model": "m", "content": [], "stop_reason": None,
                                  "stop_sequence": None,
                                  "usage": {"input_tokens": 0, "output_tokens": 0}}
    assert data[2]["content_block"] == {"type": "text", "text": ""}
    assert data[3]["delta"] == {"type": "text_delta", "text": "hé"}
    assert '"text":"h\\u00e9"' in text  # an event's data is ASCII JSON
    assert data[6] == {"type": "message_delta",
                       "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                       "usage": {"input_tokens": 3, "output_tokens": 2,
                                 "cache_read_input_tokens": 1,
                                 "cache_creation_input_tokens": 0}}


def test_held_text_is_sent_whole_at_the_end() -> None:
    stream = MessageEvents("msg_1", "m")
    events = stream.end(done_of("{not a call"), None, True, None)
    assert [e.type for e in events] == ["content_block_start", "content_block_delta",
                                        "content_block_stop", "message_delta",
                                        "message_stop"]
    assert events[1].delta.text == "{not a call"


def test_the_whole_message() -> None:
    text = message("msg_1", "m", done_of("hi", "stop"), None, "END").model_dump()
    assert list(text) == ["id", "type", "role", "model", "content", "stop_reason",
                          "stop_sequence", "usage"]
    assert text["content"] == [{"type": "text", "text": "hi"}]
    assert (text["stop_reason"], text["stop_sequence"]) == ("stop_sequence", "END")
    call = message("msg_2", "m", done_of("{}"), [CALL], None)
    assert call.content == [ToolUseBlock(id="toolu_9", name="f", input={"a": 1})]
    assert call.stop_reason == "tool_use"
    assert message("msg_3", "m", done_of("x", "max_tokens"), None, None).stop_reason == \
        "max_tokens"
    assert message("msg_4", "m", done_of("x"), None, None).stop_reason == "end_turn"


def test_errors_in_anthropic_shape() -> None:
    assert error_body(ApiError(429, "full")).model_dump() == {
        "type": "error", "error": {"type": "rate_limit_error", "message": "full"}}
    assert error_body(ApiError(503, "down")).error.type == "overloaded_error"
    assert error_body(ApiError(500, "bug")).error.type == "api_error"  # any other status
