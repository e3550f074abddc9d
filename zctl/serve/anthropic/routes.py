"""Anthropic's Messages API routes; each reads its handler (zctl.serve.anthropic.messages)
from the application's state, and declares its reply's model (for /openapi.json: a route
answering in JSON returns its model as that JSON), its errors', and in ``STREAMS`` its
streamed events'."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from zctl.serve.anthropic.messages import Messages
from zctl.serve.anthropic.protocol import CountTokensRequest, MessagesRequest
from zctl.serve.anthropic.replies import (
    AnthropicError,
    Message,
    MessageEvent,
    MessageTokensCount,
)
from zctl.serve.encoding import json_reply
from zctl.serve.errors import ErrorReply

PATH = "/v1/messages"  # its errors are in Anthropic's shape
ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": AnthropicError, "description": "The request refused"},
    "5XX": {"model": AnthropicError, "description": "The request could not be served"},
    413: {"model": ErrorReply,  # (refused before any route: in OpenAI's shape)
          "description": "The body is over the limit"}}
STREAMS: dict[str, Any] = {PATH: MessageEvent}  # a streamed message's events
router = APIRouter(responses=ERRORS)


def messages_api(request: Request) -> Messages:
    return request.app.state.messages


@router.post(PATH, response_model=Message)
async def messages(body: MessagesRequest, request: Request) -> Response:
    return await messages_api(request).create(body, request)


@router.post(f"{PATH}/count_tokens", response_model=MessageTokensCount)
async def count_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
    return json_reply(await messages_api(request).count_tokens(body, request))
