"""The OpenAI API's requests, and how they map onto the engine's.

Requests are pydantic models (unknown fields are ignored, as OpenAI clients send many);
``to_generations`` turns one into a ``zctl.engine.requests.GenerationRequest`` per choice
(``n``). The other APIs' requests are read as the chat completion they ask for
(``chat_request``). Replies are built in zctl.serve.openai.replies.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from zctl.engine.requests import (
    MAX_NEW_TOKENS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    ChatMessage,
    GenerationRequest,
)
from zctl.serve.errors import ApiError, validation_error
from zctl.serve.tools import (
    MAX_TOOLS,
    ToolChoice,
    ToolDef,
    ToolError,
    ToolPlan,
    called_text,
    plan_tools,
    tool_grammar,
    with_tools_prompt,
)
from zctl.service.messages import MAX_DETOKENIZE

MAX_CHOICES = 16  # n: each choice is a generation of its own, counted against --max-queue
MAX_PROMPTS = 64  # a text completion's batch of prompts (each prompt's n choices count too)


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


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat completion another API's request reads as, checked (a 400 that names the
    first problem)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


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
