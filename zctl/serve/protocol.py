"""The OpenAI API's request and response shapes, and how they map onto the engine's.

Requests are pydantic models (unknown fields are ignored, as OpenAI clients send many);
``to_generations`` turns one into an ``zctl.engine.requests.GenerationRequest`` per choice (``n``).
Responses are built by small pure functions from the engine's chunks and ends. ``ApiError`` is an
error in the shape OpenAI clients parse: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator

from zctl.engine.requests import (
    BAD_REQUEST,
    MAX_NEW_TOKENS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    UNAVAILABLE,
    ChatMessage,
    GenerationDone,
    GenerationRequest,
    TokenLogprob,
)
from zctl.serve.tools import (
    MAX_TOOLS,
    ToolChoice,
    ToolDef,
    ToolError,
    ToolPlan,
    called_text,
    plan_tools,
    tool_calls,
    tool_grammar,
    with_tools_prompt,
)
from zctl.service.messages import MAX_DETOKENIZE

FINISH_REASONS = {"eos": "stop", "stop": "stop", "max_tokens": "length"}
MAX_CHOICES = 16  # n: each choice is a generation of its own, counted against --max-queue
MAX_PROMPTS = 64  # a text completion's batch of prompts (each prompt's n choices count too)


class ApiError(Exception):
    """An error reply: HTTP ``status`` and the OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def engine_error(done: GenerationDone) -> ApiError:
    """The API error for a generation the engine refused or could not finish."""
    if done.error_kind == BAD_REQUEST:
        return ApiError(400, done.error.removeprefix("bad request: "))
    if done.error_kind == UNAVAILABLE:
        return ApiError(503, done.error, "service_unavailable", code="pipeline_down")
    return ApiError(500, done.error or "the generation failed", "internal_error")


# -- requests -------------------------------------------------------------------------
class ZctlOptions(BaseModel):
    """zctl's own extras, sent by OpenAI clients through ``extra_body={"zctl": {...}}``."""

    model_config = ConfigDict(extra="forbid")
    top_k: int = Field(0, ge=0, le=1 << 20)
    speculative: str | None = None  # "off", "lookup", "pipelined" or "draft:PATH"; None: the
    # server's default
    k: int | None = Field(None, ge=0, le=32)  # draft tokens per step (0: adaptive)
    ignore_eos: bool = False
    # what the last stage sends back when logits are needed (zctl.engine.payloads)
    logits_payload: Literal["auto", "fp16", "fp32"] = "auto"
    # the output held to one of these (zctl.engine.constraints), as vLLM's guided_* fields
    regex: str | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)  # Lark, or llama.cpp's GBNF
    choice: list[str] | None = Field(None, min_length=1)


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema and OpenAI's name for it."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON of a schema."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str = ""


class ChatTurn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's earlier calls

    def text(self) -> str:
        if isinstance(self.content, list):
            if any(p.type != "text" for p in self.content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            return "".join(p.text for p in self.content)
        if not self.content and self.tool_calls:
            return called_text(self.tool_calls)  # the calls, as the model wrote them
        return self.content or ""


class SamplingFields(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    # vLLM's extras, top-level as vLLM takes them (top_k and ignore_eos also in ``zctl``)
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=1 << 20)  # -1 or 0: none
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    zctl: ZctlOptions = Field(default_factory=ZctlOptions)

    @field_validator("temperature", "top_p", "n", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_p", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI's API takes null for these: the default."""
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings")
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def tool_plan(self) -> ToolPlan:
        """The functions the reply may call, and whether it must (zctl.serve.tools)."""
        return ToolPlan([])

    def grammar(self) -> tuple[str, str]:
        """The engine's (grammar_kind, grammar) for the output: ("", "") for free text."""
        found: list[tuple[str, str]] = []
        if (plan := self.tool_plan()).functions:
            found.append(tool_grammar(plan))
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("json_schema", '{"type": "object"}'))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ApiError(400, "response_format json_schema needs json_schema.schema",
                               param="response_format")
            found.append(("json_schema", json.dumps(fmt.json_schema.schema_)))
        options = self.zctl
        if options.regex is not None:
            found.append(("regex", options.regex))
        if options.grammar is not None:
            found.append(("grammar", options.grammar))
        if options.choice is not None:
            found.append(("choice", json.dumps(options.choice)))
        if len(found) > 1:
            raise ApiError(400, "give one of tools with a tool_choice, response_format (JSON), "
                           "zctl.regex, zctl.grammar and zctl.choice", param="response_format")
        return found[0] if found else ("", "")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatTurn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None

    def tool_plan(self) -> ToolPlan:
        try:
            return plan_tools(self.tools, self.tool_choice)
        except ToolError as exc:
            raise ApiError(400, str(exc), param="tool_choice") from None

    def turns(self) -> list[tuple[str, str]]:
        """The conversation as (role, text), the functions it may call shown in its system
        message."""
        turns = [(t.role, t.text()) for t in self.messages]
        plan = self.tool_plan()
        return with_tools_prompt(turns, plan) if plan.functions else turns


TokenIds = list[Annotated[StrictInt, Field(ge=0)]]
Prompt = str | list[int]  # a text completion's prompt: text, or token ids


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]  # OpenAI's four forms
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's too)
    suffix: None = None

    def prompts(self) -> list[Prompt]:
        """The prompts: one (text or token ids), or a batch of them (each answered by its
        own ``n`` choices, in order)."""
        given = self.prompt
        one = isinstance(given, str) or (bool(given) and isinstance(given[0], int))
        prompts: list[Prompt] = [given] if one else list(given)  # type: ignore[list-item]
        if not 1 <= len(prompts) <= MAX_PROMPTS or not all(prompts):
            raise ApiError(400, f"prompt takes a string, token ids, or a list of 1.."
                           f"{MAX_PROMPTS} of either (none empty)", param="prompt")
        return prompts


class TokenizeBody(BaseModel):
    """``POST /tokenize`` (vLLM's route): a text completion's ``prompt``, or a chat's
    ``messages`` (with its ``tools``), as the ids its generation would be prompted with;
    ``model`` may be left out."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatTurn] | None = Field(None, min_length=1)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    return_token_strs: bool = False

    def generation(self, request_id: str) -> GenerationRequest:
        """The engine's request the ids are those of (nothing is generated)."""
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "give a prompt or messages", param="prompt")
        model = self.model or ""
        req: ChatCompletionRequest | CompletionRequest = (
            CompletionRequest(model=model, prompt=self.prompt) if self.messages is None else
            ChatCompletionRequest(model=model, messages=self.messages, tools=self.tools,
                                  tool_choice=self.tool_choice))
        return to_generation(req, request_id)


class DetokenizeBody(BaseModel):
    """``POST /detokenize`` (vLLM's route): token ids back to text, special tokens kept."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE)


def speculation(options: ZctlOptions, default: tuple[str, int]) -> tuple[str, int]:
    """The request's (mode, k): its own, else the server's default; "off" is none."""
    mode = default[0] if options.speculative is None else options.speculative
    mode = "" if mode == "off" else mode
    return mode, default[1] if options.k is None else options.k


def to_generations(req: ChatCompletionRequest | CompletionRequest, request_id: str,
                   default_speculation: tuple[str, int] = ("", 0)) -> list[GenerationRequest]:
    """The engine's requests for an API request's choices: ``n`` for each prompt (a text
    completion may give a batch), prompt by prompt; ids ``request_id`` (one choice) or
    ``request_id-i`` for choice i, and with a seed, seed + j for a prompt's choice j (each
    reproducible, and different from the prompt's others when sampling)."""
    first = to_generation(req, request_id, default_speculation)  # grammar, turns: once
    prompts = [prompt_fields(p) for p in req.prompts()] if isinstance(req, CompletionRequest) \
        else [{}]  # (a chat's one conversation is first's)
    if req.n == 1 and len(prompts) == 1:
        return [first]
    return [replace(first, request_id=f"{request_id}-{p * req.n + j}", **prompt,
                    seed=None if req.seed is None else (req.seed + j) % (1 << 63))
            for p, prompt in enumerate(prompts) for j in range(req.n)]


def prompt_fields(prompt: Prompt) -> dict[str, Any]:
    """A completion prompt as the engine's request fields: text, or token ids."""
    return {"prompt": prompt, "prompt_ids": []} if isinstance(prompt, str) else \
        {"prompt": "", "prompt_ids": list(prompt)}


def to_generation(req: ChatCompletionRequest | CompletionRequest, request_id: str,
                  default_speculation: tuple[str, int] = ("", 0)) -> GenerationRequest:
    """The engine's request for an API request (chat turns, or a text completion's first
    prompt)."""
    mode, k = speculation(req.zctl, default_speculation)
    top_k = req.zctl.top_k if req.top_k is None else max(0, req.top_k)
    common: dict[str, Any] = dict(
        request_id=request_id, ignore_eos=req.zctl.ignore_eos or bool(req.ignore_eos),
        speculative=mode, k=k, temperature=req.temperature, top_k=top_k, top_p=req.top_p,
        min_p=req.min_p, seed=req.seed,
        stop=req.stop_list(), chunk_interval_ms=0, logits_payload=req.zctl.logits_payload,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, logit_bias=dict(req.logit_bias or {}),
        stop_token_ids=list(req.stop_token_ids or []))
    common["grammar_kind"], common["grammar"] = req.grammar()
    if isinstance(req, ChatCompletionRequest):
        limit = req.max_completion_tokens or req.max_tokens
        return GenerationRequest(
            messages=[ChatMessage(role, text) for role, text in req.turns()],
            max_tokens=limit or 0, chat=True, logprobs=req.logprobs,
            top_logprobs=req.top_logprobs or 0, **common)
    return GenerationRequest(
        **prompt_fields(req.prompts()[0]), max_tokens=req.max_tokens or 16, chat=False,
        logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0,
        prompt_logprobs=req.echo and req.logprobs is not None, **common)


# -- responses ------------------------------------------------------------------------
def usage(dones: list[GenerationDone], per_prompt: int = 1) -> dict[str, Any]:
    """OpenAI's usage object for a request's choices, ``per_prompt`` (``n``) for each of its
    prompts in turn: each prompt counted once (as OpenAI does for ``n``), every choice's
    tokens; ``cached_tokens``: the prompts' tokens the prefix cache held for their first
    choices."""
    leaders = dones[::per_prompt]
    prompt, completion = sum(d.prompt_tokens for d in leaders), sum(len(d.tokens) for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in leaders)}}


def finish_reason(done: GenerationDone) -> str:
    return FINISH_REASONS.get(done.stop_reason, "stop")


def _piece(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """The chat API's ``logprobs`` object for these tokens."""
    return {"content": [
        {**_piece(lp.text, lp.logprob),
         "top_logprobs": [_piece(t, v) for t, v in zip(lp.top_texts, lp.top_logprobs,
                                                        strict=True)]}
        for lp in logprobs], "refusal": None}


def text_logprobs(logprobs: list[TokenLogprob], offset: int = 0,
                  first_unscored: bool = False) -> dict[str, Any]:
    """The completions API's (legacy) ``logprobs`` object; ``offset`` is where the text of
    the first token starts in the completion. ``first_unscored``: the first token is a
    prompt's first, which nothing comes before (null, as OpenAI has it)."""
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.text)
    out = {"tokens": [lp.text for lp in logprobs],
           "token_logprobs": [lp.logprob for lp in logprobs],
           "top_logprobs": [dict(zip(lp.top_texts, lp.top_logprobs, strict=True))
                            for lp in logprobs],
           "text_offset": offsets}
    if first_unscored and logprobs:
        out["token_logprobs"][0] = out["top_logprobs"][0] = None
    return out


def echoed_logprobs(prompt: str, prompt_lps: list[TokenLogprob],
                    logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """An echoed completion's ``logprobs``: the prompt's tokens (the first unscored), then
    the completion's, whose offsets start where the prompt's text ends."""
    head, tail = text_logprobs(prompt_lps, 0, first_unscored=True), text_logprobs(logprobs,
                                                                                   len(prompt))
    return {key: head[key] + tail[key] for key in head}


class ResponseShape:
    """Builds one request's chunks and reply: ids, timestamps and the model are fixed;
    ``index`` names the choice a chunk belongs to."""

    def __init__(self, chat: bool, request_id: str, model: str, per_prompt: int = 1,
                 tools: ToolPlan = ToolPlan([]), echo: list[str] | None = None) -> None:
        self.chat, self.model = chat, model
        self.per_prompt = per_prompt  # choices per prompt (n): a batch's prompts in turn
        self.tools = tools  # the functions a choice may call (zctl.serve.tools)
        self.echo = echo  # a completion's prompts, echoed before their choices' text
        self._echoed: set[int] = set()  # streamed choices whose prompt went out
        self._calling: dict[int, bool] = {}  # "auto": whether choice i's output is a call
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}  # per choice: where its next chunk's text starts

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, text: str, logprobs: list[TokenLogprob] | None, finish: str | None = None,
              role: bool = False, index: int = 0) -> dict[str, Any]:
        """One streamed chunk of choice ``index``: new text (and its tokens' logprobs), or
        its end."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else (
                {"content": text} if text or finish is None else {})
            choice = {"index": index, "delta": delta,
                      "logprobs": chat_logprobs(logprobs) if logprobs else None,
                      "finish_reason": finish}
            return {**self._envelope("chat.completion.chunk"), "choices": [choice]}
        offset = self.text_offsets.get(index, 0)
        lps = text_logprobs(logprobs, offset) if logprobs else None
        self.text_offsets[index] = offset + len(text)
        choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": finish}
        return {**self._envelope("text_completion"), "choices": [choice]}

    def echo_chunk(self, index: int, prompt_lps: list[TokenLogprob] | None
                   ) -> dict[str, Any] | None:
        """A streamed completion's echoed prompt (and its logprobs, if asked), once per
        choice, before its text; None when not echoing or already sent."""
        if self.echo is None or index in self._echoed:
            return None
        self._echoed.add(index)
        prompt = self.echo[index // self.per_prompt]
        self.text_offsets[index] = len(prompt)
        lps = text_logprobs(prompt_lps, 0, first_unscored=True) if prompt_lps else None
        choice = {"index": index, "text": prompt, "logprobs": lps, "finish_reason": None}
        return {**self._envelope("text_completion"), "choices": [choice]}

    def usage_chunk(self, dones: list[GenerationDone]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(kind), "choices": [], "usage": usage(dones, self.per_prompt)}

    def reply(self, dones: list[GenerationDone], logprobs: list[list[TokenLogprob] | None],
              prompt_logprobs: list[list[TokenLogprob]] | None = None) -> dict[str, Any]:
        """The whole (non-streamed) answer: a choice per generation, in order (an echoed
        completion's prompts' logprobs in ``prompt_logprobs``)."""
        prompts = prompt_logprobs or [[] for _ in dones]
        choices = [self._choice(i, done, lps, plps) for i, (done, lps, plps)
                   in enumerate(zip(dones, logprobs, prompts, strict=True))]
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(kind), "choices": choices,
                "usage": usage(dones, self.per_prompt)}

    def holds(self, index: int, text: str = "") -> bool:
        """Whether choice ``index``'s streamed text is held back, as a call is (it comes
        whole at its end); ``text`` is its next chunk's. Under "auto" the output's first
        character tells: a call begins with ``{`` and text never does (zctl.serve.tools)."""
        if not self.tools.functions:
            return False
        if not self.tools.optional:
            return True
        if index not in self._calling:
            if not text:
                return True  # nothing shown yet: undecided
            self._calling[index] = text.startswith("{")
        return self._calling[index]

    def ending(self, done: GenerationDone) -> tuple[list[dict[str, Any]] | None, str]:
        """A finished choice's tool calls (None: it is text, or was cut short) and its
        finish reason."""
        calls = tool_calls(done.text) if self.tools.functions and \
            done.stop_reason in ("eos", "stop") else None
        return calls, "tool_calls" if calls else finish_reason(done)

    def tool_chunk(self, index: int, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """A streamed choice's tool calls, whole, in one chunk."""
        delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**self._envelope("chat.completion.chunk"), "choices": [choice]}

    def _choice(self, index: int, done: GenerationDone, logprobs: list[TokenLogprob] | None,
                prompt_lps: list[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            calls, reason = self.ending(done)
            message = {"role": "assistant", "content": None, "tool_calls": calls} if calls \
                else {"role": "assistant", "content": done.text}
            return {"index": index, "message": message,
                    "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
                    "finish_reason": reason}
        text, lps = done.text, text_logprobs(logprobs) if logprobs is not None else None
        if self.echo is not None:
            prompt = self.echo[index // self.per_prompt]
            text = prompt + text
            if logprobs is not None:
                lps = echoed_logprobs(prompt, prompt_lps, logprobs)
        return {"index": index, "text": text, "logprobs": lps,
                "finish_reason": finish_reason(done)}
