"""OpenAI's routes (and vLLM's ``/tokenize`` and ``/detokenize``); each reads its handler
(zctl.serve.openai.*) from the application's state, and declares its reply's model (for
/openapi.json: a route answering in JSON returns its model as that JSON), its errors',
and in ``STREAMS`` its streamed events'."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from zctl.serve.encoding import json_reply
from zctl.serve.errors import ErrorReply
from zctl.serve.openai.chat_replies import ChatCompletion, ChatCompletionChunkWithUsage
from zctl.serve.openai.completion_replies import Completion, CompletionChunkWithUsage
from zctl.serve.openai.models import ModelCard, ModelList
from zctl.serve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    TokenizeBody,
)
from zctl.serve.openai.responses_protocol import (
    ResponseBody,
    ResponseDeleted,
    ResponsesRequest,
    ResponseStreamEvent,
)
from zctl.serve.openai.tokenization import DetokenizeReply, TokenizeReply

ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorReply, "description": "The request refused"},
    "5XX": {"model": ErrorReply, "description": "The request could not be served"}}
# a streamed reply's events (``stream``: true); without stream_options.include_usage a
# chunk has no ``usage``
STREAMS: dict[str, Any] = {"/v1/chat/completions": ChatCompletionChunkWithUsage,
                           "/v1/completions": CompletionChunkWithUsage,
                           "/v1/responses": ResponseStreamEvent}

router = APIRouter(responses=ERRORS)


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await request.app.state.chat.create(body, request)


@router.post("/v1/completions", response_model=Completion)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await request.app.state.completions.create(body, request)


@router.post("/v1/responses", response_model=ResponseBody)
async def responses(body: ResponsesRequest, request: Request) -> Response:
    return await request.app.state.responses.create(body, request)


@router.get("/v1/responses/{response_id}", response_model=ResponseBody)
async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
    return JSONResponse(request.app.state.responses.retrieve(response_id, request))


@router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted)
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    return json_reply(request.app.state.responses.delete(response_id, request))


@router.post("/tokenize", response_model=TokenizeReply)
async def tokenize(body: TokenizeBody, request: Request) -> JSONResponse:
    return json_reply(await request.app.state.tokenization.tokenize(body, request))


@router.post("/detokenize", response_model=DetokenizeReply)
async def detokenize(body: DetokenizeBody, request: Request) -> JSONResponse:
    return json_reply(await request.app.state.tokenization.detokenize(body, request))


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> JSONResponse:
    return json_reply(await request.app.state.models.list(request))


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def model(model_id: str, request: Request) -> JSONResponse:
    return json_reply(await request.app.state.models.retrieve(model_id, request))
