"""What chat and text completion replies share: their usage (``CompletionUsage``), their
choices' ``finish_reason``, and what a builder of either API's replies does
(``ChoiceReplies``: zctl.serve.openai.chat_replies, zctl.serve.openai.completion_replies),
which zctl.serve.openai.choices drives."""

from __future__ import annotations

from typing import Literal, Protocol

from pydantic import BaseModel

from zctl.engine.requests import GenerationChunk, GenerationDone, TokenLogprob

FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # of the prompt tokens, those the prefix cache held


class CompletionUsage(BaseModel):
    """A request's tokens: its prompts' (each counted once) and every choice's."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(dones: list[GenerationDone], per_prompt: int = 1) -> CompletionUsage:
    """The usage of a request's choices, ``per_prompt`` (``n``) for each of its prompts in
    turn: each prompt counted once (as OpenAI does for ``n``), every choice's tokens;
    ``cached_tokens``: the prompts' tokens the prefix cache held for their first
    choices."""
    leaders = dones[::per_prompt]
    prompt, completion = sum(d.prompt_tokens for d in leaders), sum(len(d.tokens) for d in dones)
    return CompletionUsage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(d.cached_tokens for d in leaders)))


class ChoiceReplies(Protocol):
    """One completion's replies (pure), built from its choices' engine events: ids,
    timestamps and the model are fixed; ``index`` names the choice a chunk belongs to.
    Chat and text completions each build their own."""

    model: str
    per_prompt: int  # choices per prompt (n): a batch's prompts in turn

    def opening(self, choices: int) -> list[BaseModel]:
        """The stream's chunks before any choice's text."""
        ...

    def text_chunks(self, index: int, chunk: GenerationChunk) -> list[BaseModel]:
        """The stream's chunks for a generation's new text (none while it is held)."""
        ...

    def ending(self, index: int, done: GenerationDone) -> tuple[list[BaseModel], BaseModel]:
        """A choice's end in the stream: what was held back of it, then its
        ``finish_reason``'s chunk."""
        ...

    def closing(self, dones: list[GenerationDone]) -> list[BaseModel]:
        """The stream's chunks once every choice ended (its usage, if asked for)."""
        ...

    def reply(self, dones: list[GenerationDone], logprobs: list[list[TokenLogprob] | None],
              prompt_logprobs: list[list[TokenLogprob]]) -> BaseModel:
        """The whole (non-streamed) answer: a choice per generation, in order, with its
        tokens' logprobs (if asked for) and its prompt's (an echo's)."""
        ...
