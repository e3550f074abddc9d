"""Anthropic's Messages API (``/v1/messages``) requests (pure), each read as the chat
completion it asks for (its replies: zctl.serve.anthropic.replies).

A request's ``system`` and ``messages`` (text blocks, ``tool_use`` blocks of earlier
calls and their ``tool_result`` blocks) become a chat conversation, its ``tools`` (name,
description, ``input_schema``) and ``tool_choice`` the chat API's, so a message runs the
generation a chat completion runs. Images, documents and extended thinking are not
served: a 400 that names them (thinking blocks in the history are left out, as Anthropic
leaves them out of the prompt).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from zctl.engine.requests import MAX_NEW_TOKENS, MAX_STOP_STRINGS
from zctl.serve.openai.protocol import ChatCompletionRequest, ZctlOptions, chat_request
from zctl.serve.tools import MAX_TOOLS


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
