"""OpenAI's Responses API (``/v1/responses``) as shapes (pure): its request, read as the chat
completion it asks for; the response object, its output items and its streamed events
(pydantic models, as the API's reference has them), built from the engine's chunks and
end.

A request's ``input`` (text, or items: messages, earlier ``function_call`` items and their
``function_call_output``) and ``instructions`` become a chat conversation, its flat
function ``tools`` and ``text.format`` the chat API's tools and ``response_format``, so a
response runs the generation a chat completion runs. Only what zctl can answer is taken:
text in and out, function tools, JSON output; anything else (images, built-in tools,
background runs) is a 400 that names it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from zctl.engine.requests import MAX_NEW_TOKENS, MAX_TOP_LOGPROBS, GenerationDone, TokenLogprob
from zctl.serve.errors import ApiError
from zctl.serve.openai.chat_replies import ChatTokenLogprob, token_logprobs
from zctl.serve.openai.protocol import ChatCompletionRequest, ZctlOptions, chat_request
from zctl.serve.tools import MAX_TOOLS, ToolCall, ToolOutput

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # ``include`` asks for the tokens' logprobs
MAX_METADATA = 16


# -- requests -------------------------------------------------------------------------
class InputPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str = ""

    @model_validator(mode="after")
    def _text_only(self) -> InputPart:
        if self.type not in ("input_text", "output_text", "text"):
            raise ValueError(f"content of type {self.type!r} is not supported (text only)")
        return self


class InputItem(BaseModel):
    """One input item: a message, an earlier function call, or a call's output."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None

    @model_validator(mode="after")
    def _complete(self) -> InputItem:
        need = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                "function_call_output": ("call_id", "output")}[self.type]
        missing = [f for f in need if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} item needs {', '.join(missing)}")
        return self

    def text(self) -> str:
        value = self.output if self.type == "function_call_output" else self.content
        return value if isinstance(value, str) else "".join(p.text for p in value or [])


class FunctionTool(BaseModel):
    """A function the model may call (the Responses API's flat form)."""

    model_config = ConfigDict(extra="ignore")
    type: str
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _function_only(self) -> FunctionTool:
        if self.type != "function":
            raise ValueError(f"tools of type {self.type!r} are not supported (function only)")
        return self


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON of a schema (flat)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = ConfigDict(extra="ignore")
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stream: bool = False
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA)
    background: bool = False
    truncation: Literal["disabled"] | None = None  # "auto" (dropping turns) is not done
    zctl: ZctlOptions = Field(default_factory=ZctlOptions)

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[InputItem]) -> str | list[InputItem]:
        if isinstance(value, list) and not value:
            raise ValueError("input is empty")
        return value

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: bool) -> bool:
        if value:
            raise ValueError("background responses are not supported")
        return value

    @field_validator("include")
    @classmethod
    def _includable(cls, value: list[str] | None) -> list[str] | None:
        unknown = set(value or []) - {LOGPROBS_INCLUDE}
        if unknown:
            raise ValueError(f"{sorted(unknown)} is not supported (only {LOGPROBS_INCLUDE!r})")
        return value

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def input_turns(self) -> list[dict[str, Any]]:
        """This request's input as chat messages (instructions not included)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_as_turns(self.input)

    def chat(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion this response runs: ``history`` (a previous response's
        conversation), then the input, the instructions first as the system message."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {
            "model": self.model, "messages": system + history + self.input_turns(),
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "seed": self.seed, "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs if self.logprobs else None,
            "zctl": self.zctl.model_dump(exclude_unset=True)}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description or "", "parameters": t.parameters}}
                for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = choice if isinstance(choice, str) else {
                "type": "function", "function": {"name": choice.name}}
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
        return chat_request(body)


def items_as_turns(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls as one assistant turn's
    ``tool_calls``, a call's output as a ``tool`` turn."""
    turns: list[dict[str, Any]] = []
    for item in items:
        if item.type == "message":
            turns.append({"role": item.role, "content": item.text()})
        elif item.type == "function_call_output":
            turns.append({"role": "tool", "content": item.text()})
        else:
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if turns and turns[-1]["role"] == "assistant" and turns[-1].get("tool_calls"):
                turns[-1]["tool_calls"].append(call)
            else:
                turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return turns


# -- the response object --------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class OutputText(BaseModel):
    """A message's text part."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class MessageItem(BaseModel):
    """An assistant message output item (no content part yet while it opens)."""

    type: Literal["message"] = "message"
    id: str
    status: str
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    """A function call output item."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = MessageItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseBody(BaseModel):
    """The response object, as ``POST`` and ``GET /v1/responses`` answer with it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: None = None
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None
    metadata: dict[str, str]


def output_items(tools: ToolOutput, done: GenerationDone, message_id: str,
                 logprobs: list[TokenLogprob] | None) -> list[OutputItem]:
    """A finished generation's output items: its function calls, or one message."""
    calls = tools.calls(done)
    if calls:
        return [function_call_item(call) for call in calls]
    return [message_item(message_id, done.text, logprobs, "completed")]


def function_call_item(call: ToolCall) -> FunctionCallItem:
    """A chat API tool call (zctl.serve.tools) as a Responses ``function_call`` item."""
    return FunctionCallItem(id=new_id("fc"), call_id=call.id, name=call.function.name,
                            arguments=call.function.arguments, status="completed")


def text_part(text: str, logprobs: list[TokenLogprob] | None) -> OutputText:
    return OutputText(text=text, logprobs=token_logprobs(logprobs) if logprobs else [])


def message_item(item_id: str, text: str | None, logprobs: list[TokenLogprob] | None,
                 status: str) -> MessageItem:
    """An assistant message item (``text`` None: no content part yet)."""
    content = [] if text is None else [text_part(text, logprobs)]
    return MessageItem(id=item_id, status=status, content=content)


def response_usage(done: GenerationDone) -> ResponseUsage:
    output = len(done.tokens)
    return ResponseUsage(input_tokens=done.prompt_tokens,
                         input_tokens_details=InputTokensDetails(
                             cached_tokens=done.cached_tokens),
                         output_tokens=output, total_tokens=done.prompt_tokens + output)


class ResponseObject:
    """One response's object as it goes: ``in_progress``, then its end (``completed``,
    ``incomplete`` when ``max_output_tokens`` cut it, or ``failed``)."""

    def __init__(self, req: ResponsesRequest, model: str, tools: ToolOutput) -> None:
        self.req, self.model, self.tools = req, model, tools
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.output: list[OutputItem] = []
        self.status = "in_progress"
        self.usage: ResponseUsage | None = None
        self.incomplete: IncompleteDetails | None = None
        self.error: ResponseError | None = None

    def finish(self, done: GenerationDone, logprobs: list[TokenLogprob] | None,
               message_id: str) -> None:
        self.output = output_items(self.tools, done, message_id, logprobs)
        cut = done.stop_reason == "max_tokens"
        self.status = "incomplete" if cut else "completed"
        self.incomplete = IncompleteDetails() if cut else None
        if cut:
            for item in self.output:
                item.status = "incomplete"
        self.usage = response_usage(done)

    def fail(self, error: ApiError) -> None:
        self.status = "failed"
        self.error = ResponseError(code=error.code or error.type, message=error.message)

    def body(self) -> ResponseBody:
        req = self.req
        fmt = req.text.format if req.text else TextFormat()
        choice = req.tool_choice
        return ResponseBody(
            id=self.id, created_at=self.created_at, status=self.status, error=self.error,
            incomplete_details=self.incomplete, instructions=req.instructions,
            max_output_tokens=req.max_output_tokens, model=self.model,
            output=[item.model_copy(deep=True) for item in self.output],
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id, store=req.store,
            temperature=1.0 if req.temperature is None else req.temperature,
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            tool_choice=(choice or "auto") if isinstance(choice, str | None)
            else choice.model_dump(),
            tools=[{**t.model_dump(), "strict": True} for t in req.tools or []],
            top_p=1.0 if req.top_p is None else req.top_p, usage=self.usage,
            metadata=req.metadata or {})


class ResponseDeleted(BaseModel):
    """``DELETE /v1/responses/{id}``'s answer."""

    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


# -- its streamed events --------------------------------------------------------------
class ResponseEvent(BaseModel):
    """One streamed event, numbered in its stream."""

    type: str
    sequence_number: int


class ResponseStateEvent(ResponseEvent):
    """``response.created``, ``.in_progress``, ``.completed``, ``.incomplete``, ``.failed``."""

    response: ResponseBody


class OutputItemEvent(ResponseEvent):
    """``response.output_item.added`` and ``.done``."""

    output_index: int
    item: OutputItem


class ContentPartEvent(ResponseEvent):
    """``response.content_part.added`` and ``.done``."""

    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(ResponseEvent):
    """``response.output_text.delta``."""

    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[ChatTokenLogprob]


class TextDoneEvent(ResponseEvent):
    """``response.output_text.done``."""

    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[ChatTokenLogprob]


class ArgumentsDeltaEvent(ResponseEvent):
    """``response.function_call_arguments.delta``."""

    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(ResponseEvent):
    """``response.function_call_arguments.done``."""

    item_id: str
    output_index: int
    arguments: str


ResponseStreamEvent = (ResponseStateEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent
                       | TextDoneEvent | ArgumentsDeltaEvent | ArgumentsDoneEvent)


class ResponseEvents:
    """A streamed response's events, each numbered in turn: the opening, the message's
    text as it comes, and its end (a call comes whole there, as a chat stream's does)."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.seq = 0
        self.message_id = new_id("msg")
        self.text = ""
        self.opened = False  # the message item and its text part announced
        self.logprobs: list[TokenLogprob] = []

    def _next(self) -> int:
        self.seq += 1
        return self.seq - 1

    def _state(self, kind: str) -> ResponseStateEvent:
        return ResponseStateEvent(type=kind, sequence_number=self._next(),
                                  response=self.response.body())

    def _item(self, kind: str, index: int, item: OutputItem) -> OutputItemEvent:
        return OutputItemEvent(type=kind, sequence_number=self._next(), output_index=index,
                               item=item)

    def _part(self, kind: str, part: OutputText) -> ContentPartEvent:
        return ContentPartEvent(type=kind, sequence_number=self._next(),
                                item_id=self.message_id, output_index=0, content_index=0,
                                part=part)

    def opening(self) -> list[ResponseEvent]:
        body = self.response.body()
        return [ResponseStateEvent(type=kind, sequence_number=self._next(), response=body)
                for kind in ("response.created", "response.in_progress")]

    def _open(self) -> list[ResponseEvent]:
        if self.opened:
            return []
        self.opened = True
        return [self._item("response.output_item.added", 0,
                           message_item(self.message_id, None, None, "in_progress")),
                self._part("response.content_part.added", text_part("", None))]

    def delta(self, text: str, logprobs: list[TokenLogprob]) -> list[ResponseEvent]:
        """New text of the message (and its tokens' logprobs)."""
        self.text += text
        self.logprobs += logprobs
        lps = token_logprobs(logprobs) if logprobs else []
        return self._open() + [TextDeltaEvent(
            type="response.output_text.delta", sequence_number=self._next(),
            item_id=self.message_id, output_index=0, content_index=0, delta=text, logprobs=lps)]

    def ending(self, done: GenerationDone, logprobs: list[TokenLogprob] | None,
               held: bool) -> list[ResponseEvent]:
        """The events closing the output (``held``: nothing was streamed of it yet), then
        the response's end."""
        self.response.finish(done, logprobs, self.message_id)
        events: list[ResponseEvent] = []
        for index, item in enumerate(self.response.output):
            if isinstance(item, FunctionCallItem):
                events += self._call(index, item)
            else:
                if held:  # text held back while it might have been a call: whole here
                    self.text = ""
                    events += self.delta(done.text, logprobs or [])
                events += self._open()
                part = item.content[0]
                events += [TextDoneEvent(type="response.output_text.done",
                                         sequence_number=self._next(), item_id=self.message_id,
                                         output_index=0, content_index=0, text=part.text,
                                         logprobs=part.logprobs),
                           self._part("response.content_part.done", part),
                           self._item("response.output_item.done", index, item)]
        kind = "response.incomplete" if self.response.status == "incomplete" \
            else "response.completed"
        return events + [self._state(kind)]

    def _call(self, index: int, item: FunctionCallItem) -> list[ResponseEvent]:
        opened = item.model_copy(update={"arguments": "", "status": "in_progress"})
        return [self._item("response.output_item.added", index, opened),
                ArgumentsDeltaEvent(type="response.function_call_arguments.delta",
                                    sequence_number=self._next(), item_id=item.id,
                                    output_index=index, delta=item.arguments),
                ArgumentsDoneEvent(type="response.function_call_arguments.done",
                                   sequence_number=self._next(), item_id=item.id,
                                   output_index=index, arguments=item.arguments),
                self._item("response.output_item.done", index, item)]

    def failure(self, error: ApiError) -> list[ResponseEvent]:
        self.response.fail(error)
        return [self._state("response.failed")]
