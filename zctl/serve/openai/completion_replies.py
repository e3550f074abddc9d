"""A text completion's replies (pure): the whole ``text_completion`` and its streamed chunks
as OpenAI's API reference has them, built from the engine's chunks and ends
(``CompletionReplies``), with the tokens' (legacy) logprobs, and with ``echo`` the prompt
before each choice's text."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel

from zctl.engine.requests import GenerationChunk, GenerationDone, TokenLogprob
from zctl.serve.metrics import finish_reason
from zctl.serve.openai.replies import CompletionUsage, FinishReason, usage


class CompletionLogprobs(BaseModel):
    """The completions API's (legacy) ``logprobs``: each token's text, logprob, likeliest
    tokens at its position, and where its text starts in the choice's."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: a prompt's first token, unscored
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def text_logprobs(logprobs: list[TokenLogprob], offset: int = 0,
                  first_unscored: bool = False) -> CompletionLogprobs:
    """The logprobs of these tokens; ``offset`` is where the text of the first starts in
    the completion. ``first_unscored``: the first token is a prompt's first, which nothing
    comes before (null, as OpenAI has it)."""
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.text)
    scores: list[float | None] = [lp.logprob for lp in logprobs]
    tops: list[dict[str, float] | None] = [dict(zip(lp.top_texts, lp.top_logprobs, strict=True))
                                           for lp in logprobs]
    if first_unscored and logprobs:
        scores[0] = tops[0] = None
    return CompletionLogprobs(tokens=[lp.text for lp in logprobs], token_logprobs=scores,
                              top_logprobs=tops, text_offset=offsets)


def echoed_logprobs(prompt: str, prompt_lps: list[TokenLogprob],
                    logprobs: list[TokenLogprob]) -> CompletionLogprobs:
    """An echoed completion's logprobs: the prompt's tokens (the first unscored), then the
    completion's, whose offsets start where the prompt's text ends."""
    head = text_logprobs(prompt_lps, 0, first_unscored=True)
    tail = text_logprobs(logprobs, len(prompt))
    return CompletionLogprobs(tokens=head.tokens + tail.tokens,
                              token_logprobs=head.token_logprobs + tail.token_logprobs,
                              top_logprobs=head.top_logprobs + tail.top_logprobs,
                              text_offset=head.text_offset + tail.text_offset)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None  # None: a streamed chunk of a choice not yet ended


class Completion(BaseModel):
    """``POST /v1/completions``'s whole answer."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class CompletionChunk(BaseModel):
    """One event of a streamed text completion: new text of one of its choices."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]


class CompletionChunkWithUsage(CompletionChunk):
    """A chunk of a stream that asked for its usage (``stream_options.include_usage``):
    null in every chunk but the last, which has no choices."""

    usage: CompletionUsage | None


class CompletionReplies:
    """Builds one text completion's chunks and whole reply (a ``ChoiceReplies``): ``echo``,
    its prompts' texts, each before its choices' text; ``include_usage``: its stream ends
    with its usage."""

    def __init__(self, request_id: str, model: str, per_prompt: int = 1,
                 echo: list[str] | None = None, include_usage: bool = False) -> None:
        self.model, self.per_prompt, self.include_usage = model, per_prompt, include_usage
        self.echo = echo
        self._echoed: set[int] = set()  # streamed choices whose prompt went out
        self.id = "cmpl-" + request_id
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}  # per choice: where its next chunk's text starts

    def _chunk(self, index: int, text: str, logprobs: CompletionLogprobs | None,
               finish: FinishReason | None = None) -> CompletionChunk:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=finish)
        if self.include_usage:
            return CompletionChunkWithUsage(id=self.id, created=self.created, model=self.model,
                                            choices=[choice], usage=None)
        return CompletionChunk(id=self.id, created=self.created, model=self.model,
                               choices=[choice])

    def _echo(self, index: int, prompt_lps: list[TokenLogprob]) -> list[BaseModel]:
        """Choice ``index``'s echoed prompt (and its logprobs, if asked), once, before its
        text; none when not echoing or already sent."""
        if self.echo is None or index in self._echoed:
            return []
        self._echoed.add(index)
        prompt = self.echo[index // self.per_prompt]
        self.text_offsets[index] = len(prompt)
        lps = text_logprobs(prompt_lps, 0, first_unscored=True) if prompt_lps else None
        return [self._chunk(index, prompt, lps)]

    def opening(self, choices: int) -> list[BaseModel]:
        return []

    def text_chunks(self, index: int, chunk: GenerationChunk) -> list[BaseModel]:
        """The echoed prompt first (the stream's first chunk has its logprobs), then the
        new text (and its tokens' logprobs)."""
        chunks = self._echo(index, chunk.prompt_logprobs)
        if chunk.text or chunk.logprobs:
            offset = self.text_offsets.get(index, 0)
            self.text_offsets[index] = offset + len(chunk.text)
            chunks.append(self._chunk(index, chunk.text, text_logprobs(chunk.logprobs, offset)
                                      if chunk.logprobs else None))
        return chunks

    def ending(self, index: int, done: GenerationDone) -> tuple[list[BaseModel], BaseModel]:
        """The echoed prompt if no text came before, then the finish reason."""
        return self._echo(index, []), self._chunk(index, "", None, finish_reason(done))

    def closing(self, dones: list[GenerationDone]) -> list[BaseModel]:
        if not self.include_usage:
            return []
        return [CompletionChunkWithUsage(id=self.id, created=self.created, model=self.model,
                                         choices=[], usage=usage(dones, self.per_prompt))]

    def reply(self, dones: list[GenerationDone], logprobs: list[list[TokenLogprob] | None],
              prompt_logprobs: list[list[TokenLogprob]]) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model,
                          choices=[self._choice(i, done, lps, plps) for i, (done, lps, plps)
                                   in enumerate(zip(dones, logprobs, prompt_logprobs,
                                                    strict=True))],
                          usage=usage(dones, self.per_prompt))

    def _choice(self, index: int, done: GenerationDone, logprobs: list[TokenLogprob] | None,
                prompt_lps: list[TokenLogprob]) -> CompletionChoice:
        text, lps = done.text, text_logprobs(logprobs) if logprobs is not None else None
        if self.echo is not None:
            prompt = self.echo[index // self.per_prompt]
            text = prompt + text
            if logprobs is not None:
                lps = echoed_logprobs(prompt, prompt_lps, logprobs)
        return CompletionChoice(index=index, text=text, logprobs=lps,
                                finish_reason=finish_reason(done))
