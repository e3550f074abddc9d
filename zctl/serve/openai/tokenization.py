"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's routes): a prompt's (or a chat's, with
its tools) token ids as its generation would be prompted with them, and ids back to
text; each counts against --max-queue while the generation service answers it."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from zctl.serve.context import ServingContext, new_request_id
from zctl.serve.openai.protocol import DetokenizeBody, TokenizeBody
from zctl.service.messages import DetokenizeRequest


class Tokenization:
    """Tokenizing and detokenizing over ``context``."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def tokenize(self, body: TokenizeBody, request: Request) -> dict[str, Any]:
        """The ids a generation of the same prompt (or chat, with its tools) would see."""
        info = await self.context.check_request(request, body.model)
        reply = await self.context.prompt_tokens(body.generation(new_request_id()))
        return {"count": len(reply.tokens), "max_model_len": info.max_context,
                "tokens": reply.tokens,
                "token_strs": reply.pieces if body.return_token_strs else None}

    async def detokenize(self, body: DetokenizeBody, request: Request) -> dict[str, Any]:
        await self.context.check_request(request, body.model)
        reply = await self.context.tokens(DetokenizeRequest(new_request_id(), body.tokens))
        return {"prompt": reply.text}
