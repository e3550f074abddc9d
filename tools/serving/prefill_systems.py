"""tools.serving.prefill's three systems, each serving a chat turn and timing every token
as its client sees it.

- ``ZctlHttp``: ``zctl serve``'s OpenAI-compatible API (POST /v1/chat/completions,
  streamed, greedy, ``zctl.ignore_eos``), what users call; the server renders the
  conversation with the export's chat template. A chunk's arrival is a token's time (the
  server sends every token as it comes; ``usage`` gives the token counts).
- ``GenaiLLM``: openvino_genai's LLMPipeline fed the same token ids (the export's
  ChatTokenizer renders the conversation, as zctl's engine does), a streamer stamping
  each token. It keeps a prefix cache between calls (its default).
- ``GenaiCB``: openvino_genai's ContinuousBatchingPipeline with prefix caching on, stepped
  here: a token's time is the end of the step that made it.

``itl_run`` on the systems that serve streams at once (``serves_streams``: ZctlHttp and
GenaiCB): N short streams decoding, and (``long`` given) one
long prompt sent once each stream has ``warm`` tokens (tools.serving.prefill_report reads the
inter-token gaps of the short streams inside the long prompt's prefill).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.harness.load import RequestRecord, async_client, served_model, stream_chat
from tools.serving.prefill_prompts import Message


@dataclass
class ItlRun:
    """Short streams decoding, and maybe one long prompt among them."""

    streams: list[RequestRecord]
    ready: float  # when every short stream had its ``warm`` tokens
    long: RequestRecord | None = None


# -- zctl through its HTTP API -------------------------------------------------------------------


def chat_payload(model: str, messages: Sequence[Message], max_tokens: int) -> dict[str, Any]:
    """A streamed, greedy chat completion of exactly ``max_tokens`` tokens."""
    return {"model": model, "messages": [{"role": r, "content": c} for r, c in messages],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "zctl": {"ignore_eos": True}}


class ZctlHttp:
    """zctl serve at ``base_url``, through the harness's HTTP client (tools.harness.load)."""

    name = "zctl"
    serves_streams = True  # itl_run: short streams at once, a long prompt among them

    def __init__(self, base_url: str, timeout_s: float = 900.0) -> None:
        self.base_url, self.timeout_s = base_url, timeout_s
        self.model = asyncio.run(served_model(base_url)).id

    def turn(self, messages: Sequence[Message], max_tokens: int) -> RequestRecord:
        async def one() -> RequestRecord:
            async with async_client(self.base_url, 16, self.timeout_s) as client:
                return await stream_chat(client, chat_payload(self.model, messages, max_tokens))
        return asyncio.run(one())

    def itl_run(self, shorts: Sequence[Sequence[Message]], short_tokens: int, warm: int,
                long: Sequence[Message] | None, long_tokens: int) -> ItlRun:
        return asyncio.run(self._itl(shorts, short_tokens, warm, long, long_tokens))

    async def _itl(self, shorts: Sequence[Sequence[Message]], short_tokens: int, warm: int,
                   long: Sequence[Message] | None, long_tokens: int) -> ItlRun:
        async with async_client(self.base_url, 16, self.timeout_s) as client:
            records = [RequestRecord(start=time.perf_counter()) for _ in shorts]
            tasks = [asyncio.create_task(stream_chat(
                client, chat_payload(self.model, m, short_tokens), r))
                for m, r in zip(shorts, records, strict=True)]
            while not all(r.done or len(r.chunk_times) >= warm for r in records):
                await asyncio.sleep(0.002)
            run = ItlRun(records, time.perf_counter())
            if long is not None:
                run.long = RequestRecord(start=time.perf_counter())
                tasks.append(asyncio.create_task(stream_chat(
                    client, chat_payload(self.model, long, long_tokens), run.long)))
            await asyncio.gather(*tasks)
            return run


# -- openvino_genai ----------------------------------------------------------------------------


class GenaiLLM:
    """openvino_genai's LLMPipeline on ``model_dir`` (tools.harness.baseline), every token
    stamped as its streamer receives it; ``tokenizer`` (the zctl export's ChatTokenizer)
    makes the ids and reads the answer."""

    name = "genai"
    serves_streams = False  # one request at a time

    def __init__(self, model_dir: Path, tokenizer: Any, props: dict[str, Any]) -> None:
        from tools.harness.baseline import BaselinePipeline

        self.baseline = BaselinePipeline(model_dir, props)
        self.tokenizer = tokenizer

    def turn(self, messages: Sequence[Message], max_tokens: int) -> RequestRecord:
        record, out = self.baseline.stream(self.tokenizer.encode_chat(list(messages)),
                                           max_tokens)
        record.text = self.tokenizer.decode(out)
        return record


class GenaiCB:
    """openvino_genai's ContinuousBatchingPipeline on ``model_dir`` with prefix caching,
    stepped in this thread (tools.harness.baseline.step_requests)."""

    name = "genai_cb"
    serves_streams = True

    def __init__(self, model_dir: Path, tokenizer: Any, props: dict[str, Any],
                 max_num_seqs: int = 8) -> None:
        from tools.harness.baseline import ContinuousBatchingBaseline

        self.baseline = ContinuousBatchingBaseline(model_dir, props, max_num_seqs=max_num_seqs,
                                                   prefix_caching=True)
        self.tokenizer = tokenizer

    def _add(self, messages: Sequence[Message], max_tokens: int) -> Any:
        return self.baseline.submit(self.tokenizer.encode_chat(list(messages)), max_tokens)

    def _step(self, live: list[Any]) -> list[Any]:
        """One step: the requests still running (none once a step failed: each ended with
        the error)."""
        from tools.harness.baseline import StepFailed, step_requests

        try:
            return step_requests(self.baseline.pipe, live)
        except StepFailed:
            return []

    def turn(self, messages: Sequence[Message], max_tokens: int) -> RequestRecord:
        request = self._add(messages, max_tokens)
        live = [request]
        while live:
            live = self._step(live)
        request.record.text = self.tokenizer.decode(request.ids)
        return request.record

    def itl_run(self, shorts: Sequence[Sequence[Message]], short_tokens: int, warm: int,
                long: Sequence[Message] | None, long_tokens: int) -> ItlRun:
        live = [self._add(m, short_tokens) for m in shorts]
        records = [request.record for request in live]
        run: ItlRun | None = None
        while live:
            live = self._step(live)
            if run is None and all(r.done or len(r.chunk_times) >= warm for r in records):
                run = ItlRun(records, time.perf_counter())
                if long is not None:
                    live.append(self._add(long, long_tokens))
                    run.long = live[-1].record
        return run or ItlRun(records, time.perf_counter())
