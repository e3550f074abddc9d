"""Anthropic's Messages API replies (pure), as its API reference has them: the message a
request is answered with (its content blocks, stop reason and usage), the events a
streamed one comes as (``MessageEvents``), a token count, and an error in Anthropic's
shape; built from the engine's end and the tool calls it made (zctl.serve.tools)."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel

from zctl.engine.requests import GenerationDone
from zctl.serve.errors import ApiError
from zctl.serve.tools import ToolCall

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


# -- errors ---------------------------------------------------------------------------
class AnthropicErrorDetail(BaseModel):
    type: str  # ERROR_TYPES' (api_error for any other status)
    message: str


class AnthropicError(BaseModel):
    """An error in Anthropic's shape: an error reply's body, or a stream's last event."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def error_body(error: ApiError) -> AnthropicError:
    """An API error in Anthropic's shape."""
    return AnthropicError(error=AnthropicErrorDetail(
        type=ERROR_TYPES.get(error.status, "api_error"), message=error.message))


# -- the message ----------------------------------------------------------------------
class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    """A tool call: the tool's name and its input (the call's arguments)."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: Any  # a JSON object, as the tool's input schema has it


ContentBlock = TextBlock | ToolUseBlock


class TokenCounts(BaseModel):
    """A message's tokens in and out (a stream's start tells them as 0)."""

    input_tokens: int
    output_tokens: int


class MessageUsage(TokenCounts):
    """A message's tokens, and of its input those the prefix cache held."""

    cache_read_input_tokens: int
    cache_creation_input_tokens: int = 0  # the prefix cache keeps prompts unasked


class Message(BaseModel):
    """``POST /v1/messages``'s answer (and, empty, a stream's start)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage | TokenCounts


class MessageTokensCount(BaseModel):
    """``POST /v1/messages/count_tokens``'s answer."""

    input_tokens: int


def tool_use_block(call: ToolCall) -> ToolUseBlock:
    """A chat API tool call (zctl.serve.tools) as a ``tool_use`` block."""
    return ToolUseBlock(id="toolu_" + call.id.removeprefix("call_"), name=call.function.name,
                        input=json.loads(call.function.arguments))


def content_blocks(text: str, calls: list[ToolCall] | None) -> list[ContentBlock]:
    if calls:
        return [tool_use_block(call) for call in calls]
    return [TextBlock(text=text)]


def stop_reason(done: GenerationDone, calls: list[ToolCall] | None,
                stop_sequence: str | None) -> StopReason:
    if calls:
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if done.stop_reason == "max_tokens" else "end_turn"


def message_usage(done: GenerationDone) -> MessageUsage:
    return MessageUsage(input_tokens=done.prompt_tokens, output_tokens=len(done.tokens),
                        cache_read_input_tokens=done.cached_tokens)


def message(message_id: str, model: str, done: GenerationDone, calls: list[ToolCall] | None,
            stop_sequence: str | None) -> Message:
    """The whole (non-streamed) answer."""
    return Message(id=message_id, model=model, content=content_blocks(done.text, calls),
                   stop_reason=stop_reason(done, calls, stop_sequence),
                   stop_sequence=stop_sequence, usage=message_usage(done))


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def matched_stop(text: str, full: str, stops: list[str]) -> str | None:
    """The stop sequence that ended a generation: the one that begins where its text was
    cut in ``full`` (all its tokens' text, the stop included), else the first to appear
    after it; None if none did (a grammar or a stop token ended it)."""
    exact = next((s for s in stops if full[len(text):].startswith(s)), None)
    if exact is not None:
        return exact
    found = sorted((at, i) for i, s in enumerate(stops) if (at := full.find(s, len(text))) >= 0)
    return stops[found[0][1]] if found else None


# -- its streamed events --------------------------------------------------------------
class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class ContentBlockStartEvent(BaseModel):
    """A content block opens (a ``tool_use`` block with an empty input: it follows)."""

    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    """A ``tool_use`` block's input, as JSON text."""

    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDeltaEvent(BaseModel):
    """The message's stop, and its usage."""

    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


MessageEvent = (MessageStartEvent | PingEvent | ContentBlockStartEvent | ContentBlockDeltaEvent
                | ContentBlockStopEvent | MessageDeltaEvent | MessageStopEvent | AnthropicError)


class MessageEvents:
    """A streamed message's events: its start, a text block as the text comes (or a
    ``tool_use`` block, whole, at the end), then its stop."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id, self.model = message_id, model
        self.text_open = False

    def start(self) -> list[MessageEvent]:
        body = Message(id=self.message_id, model=self.model, content=[], stop_reason=None,
                       stop_sequence=None, usage=TokenCounts(input_tokens=0, output_tokens=0))
        return [MessageStartEvent(message=body), PingEvent()]

    def _open_text(self) -> list[MessageEvent]:
        if self.text_open:
            return []
        self.text_open = True
        return [ContentBlockStartEvent(index=0, content_block=TextBlock(text=""))]

    def text(self, text: str) -> list[MessageEvent]:
        return self._open_text() + [ContentBlockDeltaEvent(index=0, delta=TextDelta(text=text))]

    def end(self, done: GenerationDone, calls: list[ToolCall] | None, held: bool,
            stop_sequence: str | None) -> list[MessageEvent]:
        """The blocks' ends (``held``: nothing of the output was streamed yet), then the
        message's stop and usage."""
        events: list[MessageEvent] = []
        if calls:
            for index, call in enumerate(calls):
                block = tool_use_block(call)
                events += [ContentBlockStartEvent(index=index, content_block=block.model_copy(
                               update={"input": {}})),
                           ContentBlockDeltaEvent(index=index, delta=InputJsonDelta(
                               partial_json=json.dumps(block.input))),
                           ContentBlockStopEvent(index=index)]
        else:
            if held and done.text:
                events += self.text(done.text)
            events += self._open_text() + [ContentBlockStopEvent(index=0)]
        delta = MessageDelta(stop_reason=stop_reason(done, calls, stop_sequence),
                             stop_sequence=stop_sequence)
        return events + [MessageDeltaEvent(delta=delta, usage=message_usage(done)),
                         MessageStopEvent()]
