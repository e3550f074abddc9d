"""Anthropic's Messages API (``/v1/messages``) as shapes (pure): its request, read as the
chat completion it asks for; the message it answers with, its streamed events, and its
error shape.

A request's ``system`` and ``messages`` (text blocks, ``tool_use`` blocks of earlier
calls and their ``tool_result`` blocks) become a chat conversation, its ``tools`` (name,
description, ``input_schema``) and ``tool_choice`` the chat API's, so a message runs the
generation a chat completion runs. Images, documents and extended thinking are not
served: a 400 that names them (thinking blocks in the history are left out, as Anthropic
leaves them out of the prompt).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from zctl.engine.requests import MAX_NEW_TOKENS, MAX_STOP_STRINGS, GenerationDone
from zctl.serve.errors import ApiError
from zctl.serve.openai.protocol import ChatCompletionRequest, ZctlOptions, chat_request
from zctl.serve.tools import MAX_TOOLS

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}


def error_body(error: ApiError) -> dict[str, Any]:
    """An API error in Anthropic's shape."""
    kind = ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


# -- requests -------------------------------------------------------------------------
class Block(BaseModel):
    """One content block: text, a tool call (``tool_use``), a call's result
    (``tool_result``), or thinking (left out)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    text: str = ""
    id: str = ""
    name: str = ""
    input: Any = None
    tool_use_id: str = ""
    content: str | list[Block] | None = None

    def result_text(self) -> str:
        if isinstance(self.content, list):
            return "".join(b.text for b in self.content if b.type == "text")
        return self.content or ""


class Turn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str = ""
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # client tools have none ("custom"); server tools are refused

    @field_validator("type")
    @classmethod
    def _client_tool(cls, value: str | None) -> str | None:
        if value not in (None, "custom"):
            raise ValueError(f"tools of type {value!r} are not supported (client tools only)")
        return value


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """``output_config``: its ``format`` holds the answer to a JSON Schema (``effort`` is
    the model's own and is ignored)."""

    model_config = ConfigDict(extra="ignore")
    format: OutputFormat | None = None


class MessagesRequest(BaseModel):
    """``POST /v1/messages``."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int = Field(ge=1, le=MAX_NEW_TOKENS)
    messages: list[Turn] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    stream: bool = False
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    zctl: ZctlOptions = Field(default_factory=ZctlOptions)

    def system_text(self) -> str:
        if isinstance(self.system, list):
            return "\n".join(b.text for b in self.system if b.type == "text")
        return self.system or ""

    def chat(self) -> ChatCompletionRequest:
        """The chat completion this message runs."""
        system = self.system_text()
        body: dict[str, Any] = {
            "model": self.model, "max_completion_tokens": self.max_tokens,
            "messages": ([{"role": "system", "content": system}] if system else [])
            + [t for turn in self.messages for t in turn_as_chat(turn)],
            "stop": self.stop_sequences or None, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k,
            "zctl": self.zctl.model_dump(exclude_unset=True)}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in self.tools]
        fmt = self.output_config.format if self.output_config else None
        if fmt is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": fmt.schema_}}
        choice = self.tool_choice
        if choice is not None and (self.tools or choice.type != "none"):
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type) or {"type": "function", "function": {"name": choice.name or ""}}
        return chat_request(body)


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a message's fields, ``max_tokens`` left out."""

    max_tokens: int = Field(1, ge=1, le=MAX_NEW_TOKENS)


def turn_as_chat(turn: Turn) -> list[dict[str, Any]]:
    """One turn as chat messages: a user turn's tool results as ``tool`` turns before its
    text; an assistant turn's ``tool_use`` blocks as its ``tool_calls``."""
    if isinstance(turn.content, str):
        return [{"role": turn.role, "content": turn.content}]
    blocks = [b for b in turn.content if b.type not in ("thinking", "redacted_thinking")]
    text = "".join(b.text for b in blocks if b.type == "text")
    if turn.role == "user":
        results = [{"role": "tool", "content": b.result_text()} for b in blocks
                   if b.type == "tool_result"]
        return results + ([{"role": "user", "content": text}] if text or not results else [])
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input or {})}}
             for b in blocks if b.type == "tool_use"]
    if calls:
        return [{"role": "assistant", "content": text or None, "tool_calls": calls}]
    return [{"role": "assistant", "content": text}]


# -- responses ------------------------------------------------------------------------
def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """A chat API tool call (zctl.serve.tools) as a ``tool_use`` block."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])}


def content_blocks(text: str, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if calls:
        return [tool_use_block(call) for call in calls]
    return [{"type": "text", "text": text}]


def stop_reason(done: GenerationDone, calls: list[dict[str, Any]] | None,
                stop_sequence: str | None) -> str:
    if calls:
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if done.stop_reason == "max_tokens" else "end_turn"


def message_usage(done: GenerationDone) -> dict[str, Any]:
    return {"input_tokens": done.prompt_tokens, "output_tokens": len(done.tokens),
            "cache_read_input_tokens": done.cached_tokens, "cache_creation_input_tokens": 0}


def message(message_id: str, model: str, done: GenerationDone,
            calls: list[dict[str, Any]] | None, stop_sequence: str | None) -> dict[str, Any]:
    """The whole (non-streamed) answer."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(done.text, calls),
            "stop_reason": stop_reason(done, calls, stop_sequence),
            "stop_sequence": stop_sequence, "usage": message_usage(done)}


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


class MessageEvents:
    """A streamed message's events: its start, a text block as the text comes (or a
    ``tool_use`` block, whole, at the end), then its stop."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id, self.model = message_id, model
        self.text_open = False

    def start(self) -> list[dict[str, Any]]:
        body = {"id": self.message_id, "type": "message", "role": "assistant",
                "model": self.model, "content": [], "stop_reason": None,
                "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [{"type": "message_start", "message": body}, {"type": "ping"}]

    def _open_text(self) -> list[dict[str, Any]]:
        if self.text_open:
            return []
        self.text_open = True
        return [{"type": "content_block_start", "index": 0,
                 "content_block": {"type": "text", "text": ""}}]

    def text(self, text: str) -> list[dict[str, Any]]:
        return self._open_text() + [{"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": text}}]

    def end(self, done: GenerationDone, calls: list[dict[str, Any]] | None, held: bool,
            stop_sequence: str | None) -> list[dict[str, Any]]:
        """The blocks' ends (``held``: nothing of the output was streamed yet), then the
        message's stop and usage."""
        events: list[dict[str, Any]] = []
        if calls:
            for index, block in enumerate(content_blocks("", calls)):
                events += [{"type": "content_block_start", "index": index,
                            "content_block": {**block, "input": {}}},
                           {"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta",
                                      "partial_json": json.dumps(block["input"])}},
                           {"type": "content_block_stop", "index": index}]
        else:
            if held and done.text:
                events += self.text(done.text)
            events += self._open_text() + [{"type": "content_block_stop", "index": 0}]
        delta = {"stop_reason": stop_reason(done, calls, stop_sequence),
                 "stop_sequence": stop_sequence}
        return events + [{"type": "message_delta", "delta": delta, "usage": message_usage(done)},
                         {"type": "message_stop"}]


def matched_stop(text: str, full: str, stops: list[str]) -> str | None:
    """The stop sequence that ended a generation: the one that begins where its text was
    cut in ``full`` (all its tokens' text, the stop included), else the first to appear
    after it; None if none did (a grammar or a stop token ended it)."""
    exact = next((s for s in stops if full[len(text):].startswith(s)), None)
    if exact is not None:
        return exact
    found = sorted((at, i) for i, s in enumerate(stops) if (at := full.find(s, len(text))) >= 0)
    return stops[found[0][1]] if found else None
