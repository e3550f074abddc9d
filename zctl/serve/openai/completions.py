"""``POST /v1/completions``: a text completion's prompts (text or token ids, one or a batch),
each answered by its ``n`` choices (zctl.serve.openai.choices), whole or streamed
(zctl.serve.openai.completion_replies); with ``echo``, the prompt before each choice's
text."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from zctl.serve.context import ServingContext
from zctl.serve.openai.choices import answer_choices, generations_for
from zctl.serve.openai.completion_replies import CompletionReplies
from zctl.serve.openai.protocol import CompletionRequest


class Completions:
    """Text completions over ``context``."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        context = self.context
        info, request_id, gens = await generations_for(context, body, request)
        start = time.monotonic()
        echo = await self.echo_texts(body) if body.echo else None  # (before any generation
        # starts: a failure here leaves none running)
        replies = CompletionReplies(request_id, info.model, body.n, echo, body.include_usage)
        return await answer_choices(context, replies, gens, request, start, body.stream)

    async def echo_texts(self, body: CompletionRequest) -> list[str]:
        """The texts an echoing completion's prompts are answered with (token ids
        detokenized as a reader sees them: special tokens left out)."""
        return [prompt if isinstance(prompt, str) else await self.context.reader_text(prompt)
                for prompt in body.prompts()]
