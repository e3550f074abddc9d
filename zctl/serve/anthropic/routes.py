"""Anthropic's Messages API routes; each reads its handler (zctl.serve.anthropic.messages)
from the application's state."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from zctl.serve.anthropic.messages import Messages
from zctl.serve.anthropic.protocol import CountTokensRequest, MessagesRequest

PATH = "/v1/messages"  # its errors are in Anthropic's shape
router = APIRouter()


def messages_api(request: Request) -> Messages:
    return request.app.state.messages


@router.post(PATH)
async def messages(body: MessagesRequest, request: Request) -> Response:
    return await messages_api(request).create(body, request)


@router.post(f"{PATH}/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
    return JSONResponse(await messages_api(request).count_tokens(body, request))
