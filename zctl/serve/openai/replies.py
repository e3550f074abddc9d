"""OpenAI's chat and text completion replies (pure), built from the engine's chunks and
ends: each streamed chunk, the whole reply, usage and logprobs (``ReplyShape``)."""

from __future__ import annotations

import time
from typing import Any

from zctl.engine.requests import GenerationDone, TokenLogprob
from zctl.serve.metrics import finish_reason
from zctl.serve.tools import ToolOutput, ToolPlan


def usage(dones: list[GenerationDone], per_prompt: int = 1) -> dict[str, Any]:
    """OpenAI's usage object for a request's choices, ``per_prompt`` (``n``) for each of its
    prompts in turn: each prompt counted once (as OpenAI does for ``n``), every choice's
    tokens; ``cached_tokens``: the prompts' tokens the prefix cache held for their first
    choices."""
    leaders = dones[::per_prompt]
    prompt, completion = sum(d.prompt_tokens for d in leaders), sum(len(d.tokens) for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in leaders)}}


def _piece(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """The chat API's ``logprobs`` object for these tokens."""
    return {"content": [
        {**_piece(lp.text, lp.logprob),
         "top_logprobs": [_piece(t, v) for t, v in zip(lp.top_texts, lp.top_logprobs,
                                                        strict=True)]}
        for lp in logprobs], "refusal": None}


def text_logprobs(logprobs: list[TokenLogprob], offset: int = 0,
                  first_unscored: bool = False) -> dict[str, Any]:
    """The completions API's (legacy) ``logprobs`` object; ``offset`` is where the text of
    the first token starts in the completion. ``first_unscored``: the first token is a
    prompt's first, which nothing comes before (null, as OpenAI has it)."""
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.text)
    out = {"tokens": [lp.text for lp in logprobs],
           "token_logprobs": [lp.logprob for lp in logprobs],
           "top_logprobs": [dict(zip(lp.top_texts, lp.top_logprobs, strict=True))
                            for lp in logprobs],
           "text_offset": offsets}
    if first_unscored and logprobs:
        out["token_logprobs"][0] = out["top_logprobs"][0] = None
    return out


def echoed_logprobs(prompt: str, prompt_lps: list[TokenLogprob],
                    logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """An echoed completion's ``logprobs``: the prompt's tokens (the first unscored), then
    the completion's, whose offsets start where the prompt's text ends."""
    head, tail = text_logprobs(prompt_lps, 0, first_unscored=True), text_logprobs(logprobs,
                                                                                   len(prompt))
    return {key: head[key] + tail[key] for key in head}


class ReplyShape:
    """Builds one chat or text completion's chunks and reply: ids, timestamps and the model
    are fixed; ``index`` names the choice a chunk belongs to."""

    def __init__(self, chat: bool, request_id: str, model: str, per_prompt: int = 1,
                 tools: ToolPlan = ToolPlan([]), echo: list[str] | None = None) -> None:
        self.chat, self.model = chat, model
        self.per_prompt = per_prompt  # choices per prompt (n): a batch's prompts in turn
        self.tools = ToolOutput(tools)  # the functions a choice may call (zctl.serve.tools)
        self.echo = echo  # a completion's prompts, echoed before their choices' text
        self._echoed: set[int] = set()  # streamed choices whose prompt went out
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}  # per choice: where its next chunk's text starts

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, text: str, logprobs: list[TokenLogprob] | None, finish: str | None = None,
              role: bool = False, index: int = 0) -> dict[str, Any]:
        """One streamed chunk of choice ``index``: new text (and its tokens' logprobs), or
        its end."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else (
                {"content": text} if text or finish is None else {})
            choice = {"index": index, "delta": delta,
                      "logprobs": chat_logprobs(logprobs) if logprobs else None,
                      "finish_reason": finish}
            return {**self._envelope("chat.completion.chunk"), "choices": [choice]}
        offset = self.text_offsets.get(index, 0)
        lps = text_logprobs(logprobs, offset) if logprobs else None
        self.text_offsets[index] = offset + len(text)
        choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": finish}
        return {**self._envelope("text_completion"), "choices": [choice]}

    def echo_chunk(self, index: int, prompt_lps: list[TokenLogprob] | None
                   ) -> dict[str, Any] | None:
        """A streamed completion's echoed prompt (and its logprobs, if asked), once per
        choice, before its text; None when not echoing or already sent."""
        if self.echo is None or index in self._echoed:
            return None
        self._echoed.add(index)
        prompt = self.echo[index // self.per_prompt]
        self.text_offsets[index] = len(prompt)
        lps = text_logprobs(prompt_lps, 0, first_unscored=True) if prompt_lps else None
        choice = {"index": index, "text": prompt, "logprobs": lps, "finish_reason": None}
        return {**self._envelope("text_completion"), "choices": [choice]}

    def usage_chunk(self, dones: list[GenerationDone]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(kind), "choices": [], "usage": usage(dones, self.per_prompt)}

    def reply(self, dones: list[GenerationDone], logprobs: list[list[TokenLogprob] | None],
              prompt_logprobs: list[list[TokenLogprob]] | None = None) -> dict[str, Any]:
        """The whole (non-streamed) answer: a choice per generation, in order (an echoed
        completion's prompts' logprobs in ``prompt_logprobs``)."""
        prompts = prompt_logprobs or [[] for _ in dones]
        choices = [self._choice(i, done, lps, plps) for i, (done, lps, plps)
                   in enumerate(zip(dones, logprobs, prompts, strict=True))]
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(kind), "choices": choices,
                "usage": usage(dones, self.per_prompt)}

    def holds(self, index: int, text: str = "") -> bool:
        """Whether choice ``index``'s streamed text is held back (``ToolOutput.holds``)."""
        return self.tools.holds(index, text)

    def ending(self, done: GenerationDone) -> tuple[list[dict[str, Any]] | None, str]:
        """A finished choice's tool calls (None: it is text, or was cut short) and its
        finish reason."""
        calls = self.tools.calls(done)
        return calls, "tool_calls" if calls else finish_reason(done)

    def tool_chunk(self, index: int, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """A streamed choice's tool calls, whole, in one chunk."""
        delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**self._envelope("chat.completion.chunk"), "choices": [choice]}

    def _choice(self, index: int, done: GenerationDone, logprobs: list[TokenLogprob] | None,
                prompt_lps: list[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            calls, reason = self.ending(done)
            message = {"role": "assistant", "content": None, "tool_calls": calls} if calls \
                else {"role": "assistant", "content": done.text}
            return {"index": index, "message": message,
                    "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
                    "finish_reason": reason}
        text, lps = done.text, text_logprobs(logprobs) if logprobs is not None else None
        if self.echo is not None:
            prompt = self.echo[index // self.per_prompt]
            text = prompt + text
            if logprobs is not None:
                lps = echoed_logprobs(prompt, prompt_lps, logprobs)
        return {"index": index, "text": text, "logprobs": lps,
                "finish_reason": finish_reason(done)}
