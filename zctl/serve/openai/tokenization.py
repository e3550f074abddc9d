"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's routes): a prompt's (or a chat's, with
its tools) token ids as its generation would be prompted with them, and ids back to
text; each counts against --max-queue while the generation service answers it."""

from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel

from zctl.serve.context import ServingContext, new_request_id
from zctl.serve.openai.protocol import DetokenizeBody, TokenizeBody
from zctl.service.messages import DetokenizeRequest


class TokenizeReply(BaseModel):
    """A prompt's token ids (and with ``return_token_strs`` each one's text), and the
    model's context length."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeReply(BaseModel):
    prompt: str  # the ids' text


class Tokenization:
    """Tokenizing and detokenizing over ``context``."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def tokenize(self, body: TokenizeBody, request: Request) -> TokenizeReply:
        """The ids a generation of the same prompt (or chat, with its tools) would see."""
        info = await self.context.check_request(request, body.model)
        reply = await self.context.prompt_tokens(body.generation(new_request_id()))
        return TokenizeReply(count=len(reply.tokens), max_model_len=info.max_context,
                             tokens=reply.tokens,
                             token_strs=reply.pieces if body.return_token_strs else None)

    async def detokenize(self, body: DetokenizeBody, request: Request) -> DetokenizeReply:
        await self.context.check_request(request, body.model)
        reply = await self.context.tokens(DetokenizeRequest(new_request_id(), body.tokens))
        return DetokenizeReply(prompt=reply.text)
