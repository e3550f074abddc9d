"""OpenAI's routes (and vLLM's ``/tokenize`` and ``/detokenize``); each reads its handler
(zctl.serve.openai.*) from the application's state."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from zctl.serve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    TokenizeBody,
)
from zctl.serve.openai.responses_protocol import ResponsesRequest

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await request.app.state.chat.create(body, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await request.app.state.completions.create(body, request)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    return await request.app.state.responses.create(body, request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
    return JSONResponse(request.app.state.responses.retrieve(response_id, request))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    return JSONResponse(request.app.state.responses.delete(response_id, request))


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, request: Request) -> dict[str, Any]:
    return await request.app.state.tokenization.tokenize(body, request)


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, request: Request) -> dict[str, Any]:
    return await request.app.state.tokenization.detokenize(body, request)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return await request.app.state.models.list(request)


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
    return await request.app.state.models.retrieve(model_id, request)
