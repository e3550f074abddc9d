"""A chat completion's replies (pure): the whole ``chat.completion`` and its streamed
``chat.completion.chunk``s as OpenAI's API reference has them, built from the engine's
chunks and ends (``ChatReplies``), with the tokens' logprobs and the tool calls a choice
ended with (zctl.serve.tools)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel

from zctl.engine.requests import GenerationChunk, GenerationDone, TokenLogprob
from zctl.serve.metrics import finish_reason
from zctl.serve.openai.replies import CompletionUsage, FinishReason, usage
from zctl.serve.tools import FunctionCall, ToolCall, ToolOutput, ToolPlan


# -- logprobs -------------------------------------------------------------------------
class TopLogprob(BaseModel):
    """One of the likeliest tokens at a position."""

    token: str
    logprob: float
    bytes: list[int]  # the token's text as UTF-8


class ChatTokenLogprob(BaseModel):
    """A token of the reply, with the likeliest tokens at its position."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None


def token_logprobs(logprobs: list[TokenLogprob]) -> list[ChatTokenLogprob]:
    """The chat API's logprobs of these tokens (the Responses API's too)."""
    return [ChatTokenLogprob(
        token=lp.text, logprob=lp.logprob, bytes=list(lp.text.encode()),
        top_logprobs=[TopLogprob(token=text, logprob=value, bytes=list(text.encode()))
                      for text, value in zip(lp.top_texts, lp.top_logprobs, strict=True)])
        for lp in logprobs]


def chat_logprobs(logprobs: list[TokenLogprob]) -> ChoiceLogprobs:
    """A choice's ``logprobs`` object for these tokens."""
    return ChoiceLogprobs(content=token_logprobs(logprobs))


# -- the whole reply ------------------------------------------------------------------
class AssistantMessage(BaseModel):
    """A choice's answer in text."""

    role: Literal["assistant"] = "assistant"
    content: str


class ToolCallsMessage(BaseModel):
    """A choice's answer as tool calls."""

    role: Literal["assistant"] = "assistant"
    content: None = None
    tool_calls: list[ToolCall]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage | ToolCallsMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    """``POST /v1/chat/completions``'s whole answer."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


# -- its streamed chunks --------------------------------------------------------------
class RoleDelta(BaseModel):
    """A streamed choice's first delta."""

    role: Literal["assistant"] = "assistant"
    content: str


class ContentDelta(BaseModel):
    """A streamed choice's new text."""

    content: str


class ToolCallDelta(BaseModel):
    """A tool call of a streamed choice, whole, numbered among its calls."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallsDelta(BaseModel):
    tool_calls: list[ToolCallDelta]


class EmptyDelta(BaseModel):
    """Nothing new: the delta of a choice's ``finish_reason`` chunk."""


ChatDelta = RoleDelta | ContentDelta | ToolCallsDelta | EmptyDelta


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion: a delta of one of its choices."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]


class ChatCompletionChunkWithUsage(ChatCompletionChunk):
    """A chunk of a stream that asked for its usage (``stream_options.include_usage``):
    null in every chunk but the last, which has no choices."""

    usage: CompletionUsage | None


class ChatReplies:
    """Builds one chat completion's chunks and whole reply (a ``ChoiceReplies``): its
    choices may call ``tools``; ``include_usage``: its stream ends with its usage."""

    def __init__(self, request_id: str, model: str, per_prompt: int = 1,
                 tools: ToolPlan = ToolPlan([]), include_usage: bool = False) -> None:
        self.model, self.per_prompt, self.include_usage = model, per_prompt, include_usage
        self.tools = ToolOutput(tools)  # the functions a choice may call (zctl.serve.tools)
        self.id = "chatcmpl-" + request_id
        self.created = int(time.time())

    def _chunk(self, index: int, delta: ChatDelta, logprobs: list[TokenLogprob] | None = None,
               finish: FinishReason | None = None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=delta,
                                 logprobs=chat_logprobs(logprobs) if logprobs else None,
                                 finish_reason=finish)
        if self.include_usage:
            return ChatCompletionChunkWithUsage(id=self.id, created=self.created,
                                                model=self.model, choices=[choice], usage=None)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[choice])

    def opening(self, choices: int) -> list[BaseModel]:
        """Each choice's role, before any text."""
        return [self._chunk(index, RoleDelta(content="")) for index in range(choices)]

    def text_chunks(self, index: int, chunk: GenerationChunk) -> list[BaseModel]:
        """The new text (and its tokens' logprobs), unless the choice holds it back as a
        call is held (``ToolOutput.holds``)."""
        if not (chunk.text or chunk.logprobs) or self.tools.holds(index, chunk.text):
            return []
        return [self._chunk(index, ContentDelta(content=chunk.text), chunk.logprobs)]

    def ending(self, index: int, done: GenerationDone) -> tuple[list[BaseModel], BaseModel]:
        """What the choice held back (its calls, or the text it was cut to), then its
        finish reason."""
        calls = self.tools.calls(done)
        held: list[BaseModel] = []
        if self.tools.holds(index):
            held.append(self._chunk(index, ToolCallsDelta(tool_calls=[
                ToolCallDelta(index=i, id=call.id, function=call.function)
                for i, call in enumerate(calls)])) if calls else
                self._chunk(index, ContentDelta(content=done.text)))
        return held, self._chunk(index, EmptyDelta(),
                                 finish="tool_calls" if calls else finish_reason(done))

    def closing(self, dones: list[GenerationDone]) -> list[BaseModel]:
        if not self.include_usage:
            return []
        return [ChatCompletionChunkWithUsage(id=self.id, created=self.created, model=self.model,
                                             choices=[], usage=usage(dones, self.per_prompt))]

    def reply(self, dones: list[GenerationDone], logprobs: list[list[TokenLogprob] | None],
              prompt_logprobs: list[list[TokenLogprob]]) -> ChatCompletion:
        return ChatCompletion(id=self.id, created=self.created, model=self.model,
                              choices=[self._choice(i, done, lps) for i, (done, lps)
                                       in enumerate(zip(dones, logprobs, strict=True))],
                              usage=usage(dones, self.per_prompt))

    def _choice(self, index: int, done: GenerationDone, logprobs: list[TokenLogprob] | None
                ) -> ChatChoice:
        calls = self.tools.calls(done)
        message = ToolCallsMessage(tool_calls=calls) if calls else \
            AssistantMessage(content=done.text)
        return ChatChoice(index=index, message=message,
                          logprobs=chat_logprobs(logprobs) if logprobs is not None else None,
                          finish_reason="tool_calls" if calls else finish_reason(done))
