"""``POST /v1/chat/completions``: a conversation's ``n`` choices (zctl.serve.openai.choices),
with its tools (zctl.serve.tools) and output format, whole or streamed
(zctl.serve.openai.chat_replies)."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from zctl.serve.context import ServingContext
from zctl.serve.openai.chat_replies import ChatReplies
from zctl.serve.openai.choices import answer_choices, generations_for
from zctl.serve.openai.protocol import ChatCompletionRequest


class ChatCompletions:
    """Chat completions over ``context``."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        context = self.context
        info, request_id, gens = await generations_for(context, body, request)
        start = time.monotonic()
        replies = ChatReplies(request_id, info.model, body.n, body.tool_plan(),
                              body.include_usage)
        return await answer_choices(context, replies, gens, request, start, body.stream)
