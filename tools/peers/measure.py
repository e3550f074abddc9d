"""One measurement of a served system through its OpenAI API, by the benchmarks' one load
generator (tools.harness.load), the same way for zctl serve and llama-server:

- one stream: a streamed text completion of a prompt of exactly N token ids (the same
  ids for both, a different start each round, so neither side's prefix cache holds it),
  greedy, ``ignore_eos`` so both generate the same number of tokens. TTFT: request sent
  to first content chunk. Decode tok/s: (completion tokens - 1) / (last content chunk -
  first). Both servers send a chunk per token (zctl serve streams each token as it comes).
- serving: N clients through the request set's chat completions (tools.harness.load's
  ``http_level``; greedy, ``ignore_eos``): aggregate tok/s, TTFT and ITL p50/p99, errors.
  Every request on a connection of its own, for both: llama-server's HTTP library closes
  a kept-alive connection the client may already be sending the next request on (3 of 8
  sequential requests failed so with "Server disconnected without sending a response").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tools.harness.load import (
    COMPLETIONS_PATH,
    CONTEXT,
    ServeRequest,
    async_client,
    http_level,
    stream_chat,
    summarize,
)

REQUEST_TIMEOUT_S = 600.0


def prompt_ids(encode: Any, tokens: int, start: int) -> list[int]:
    """Exactly ``tokens`` token ids of the context sentences, from sentence ``start`` on
    (``encode``: text -> ids, without special tokens)."""
    ids: list[int] = []
    i = start
    while len(ids) < tokens:
        ids += encode(CONTEXT[i % len(CONTEXT)] + " ")
        i += 1
    return ids[:tokens]


async def one_stream(base_url: str, model: str, ids: Sequence[int], tokens: int) -> dict[str, Any]:
    """One greedy stream of ``tokens`` tokens after the prompt ``ids``: its figures, or
    its error (``error``)."""
    payload = {"model": model, "prompt": list(ids), "max_tokens": tokens, "temperature": 0.0,
               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    async with async_client(base_url, 1, REQUEST_TIMEOUT_S) as client:
        record = await stream_chat(client, payload, path=COMPLETIONS_PATH)
    if not record.ok:
        return {"error": record.error}
    return {"decode_tok_s": round(record.decode_tok_s or 0.0, 3),
            "ttft_ms": round(record.ttft_ms or 0.0, 2),
            "prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens}


async def serving_level(base_url: str, model: str, requests: Sequence[ServeRequest],
                        clients: int) -> dict[str, Any]:
    """``clients`` concurrent clients through ``requests``: the level's summary."""
    run = await http_level(base_url, model, requests, clients, timeout_s=REQUEST_TIMEOUT_S,
                           extra={"ignore_eos": True}, keepalive=False)
    return summarize(run)
