"""The load tools.robustness.soak puts on the OpenAI API, through the harness's HTTP client
(tools.harness.load): a pool of prompts that fit the model's context, a mix of requests
drawn from it, N clients sending them one after another until a deadline, and a burst
that fills the server's queue.

Every request is a chat completion. The mix, per request: 15% cancelled mid-stream (the
client closes the connection after a few chunks), 15% whole (not streamed), 15% with stop
strings, 10% sampled (temperature, top_p, a seed), the rest streamed greedily;
``max_tokens`` 16-128, cut to what the prompt leaves of the context. A request counts as
completed when its answer is whole (``data: [DONE]`` after the chunks, or a JSON body
with a choice), cancelled when the client meant to leave it, cut when the deadline's
drain ended it, and an error otherwise (any status but 200, an exception, an error in
the stream, a stream that ended early).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tools.harness.load import (
    ABOUT_TEXT,
    CONTEXT,
    STANDALONE,
    RequestRecord,
    async_client,
    complete_chat,
    stream_chat,
)

MAX_TOKENS = (16, 128)
CONTEXT_SENTENCES = (0, 1, 3, 6, 12, 24)
STOPS = ([".", "\n"], [" the"], ["!", "?", ";"])
MARGIN_TOKENS = 8  # kept free of the context beside prompt + max_tokens
HTTP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # with the chat template
    room: int  # the most new tokens the context leaves it (less a margin)


def prompt_pool(tokenizer: Any, max_context: int, seed: int = 0) -> list[Prompt]:
    """Prompts from a few words to a document of a few hundred tokens, shortest first;
    only those leaving room for the largest ``max_tokens`` in ``max_context``."""
    rng = random.Random(seed)
    texts = list(STANDALONE)
    for sentences in CONTEXT_SENTENCES[1:]:
        for _ in range(4):
            first = rng.randrange(len(CONTEXT))
            doc = " ".join(CONTEXT[(first + j) % len(CONTEXT)] for j in range(sentences))
            texts.append(f"{doc}\n\n{rng.choice(ABOUT_TEXT)}")
    counts = [len(tokenizer.encode_chat([("user", t)])) for t in texts]
    pool = [Prompt(t, n, max_context - n - MARGIN_TOKENS) for t, n in zip(texts, counts,
                                                                          strict=True)]
    fits = [p for p in pool if p.room >= MAX_TOKENS[0]]
    if not fits:
        raise RuntimeError(f"no prompt fits the model's context of {max_context} tokens")
    return sorted(fits, key=lambda p: p.tokens)


@dataclass(frozen=True)
class SoakRequest:
    kind: str  # stream | whole | stop | sampled | cancel
    payload: dict[str, Any]
    cancel_after: int = 0  # content chunks read before the connection is closed


def draw_request(rng: random.Random, model: str, prompts: list[Prompt]) -> SoakRequest:
    """One request of the mix (see the module's docstring)."""
    prompt = rng.choice(prompts)
    payload: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": prompt.text}],
        "max_tokens": min(rng.randint(*MAX_TOKENS), prompt.room),
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    roll = rng.random()
    if roll < 0.15:
        return SoakRequest("cancel", {**payload, "max_tokens": min(MAX_TOKENS[1], prompt.room)},
                           cancel_after=rng.randint(1, 4))
    if roll < 0.30:
        payload = {k: v for k, v in payload.items() if k != "stream_options"}
        return SoakRequest("whole", {**payload, "stream": False})
    if roll < 0.45:
        return SoakRequest("stop", {**payload, "stop": rng.choice(STOPS)})
    if roll < 0.55:
        return SoakRequest("sampled", {**payload, "temperature": 0.8, "top_p": 0.9,
                                       "seed": rng.randrange(1 << 31)})
    return SoakRequest("stream", payload)


@dataclass
class LoadTally:
    """What the clients saw."""

    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    cut: int = 0
    errors: int = 0
    tokens: int = 0
    kinds: Counter = field(default_factory=Counter)
    error_kinds: Counter = field(default_factory=Counter)
    error_examples: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        self.error_kinds[what.split(":")[0]] += 1
        if len(self.error_examples) < 5:
            self.error_examples.append(what[:300])


async def send(client: Any, request: SoakRequest) -> tuple[str, int]:
    """Send one request (tools.harness.load): ("completed" | "cancelled", completion tokens,
    or the content chunks read before leaving), or ("error: ...", 0). Never raises but for
    a cancellation of the task."""
    if not request.payload["stream"]:
        record = await complete_chat(client, request.payload)
    else:
        record = await stream_chat(client, request.payload, leave_after=request.cancel_after)
    if not record.ok:
        return record.error, 0
    if record.left:
        return "cancelled", len(record.chunk_times)
    return "completed", record.completion_tokens


async def client_loop(client: Any, rng: random.Random, model: str, prompts: list[Prompt],
                      deadline: float, tally: LoadTally) -> None:
    """One client: a request after another until the deadline (time.monotonic())."""
    while time.monotonic() < deadline:
        request = draw_request(rng, model, prompts)
        tally.requests += 1
        tally.kinds[request.kind] += 1
        try:
            outcome, tokens = await send(client, request)
        except asyncio.CancelledError:
            tally.cut += 1
            raise
        if outcome in ("completed", "cancelled"):
            setattr(tally, outcome, getattr(tally, outcome) + 1)
            tally.tokens += tokens
        else:
            tally.error(outcome)


async def drive(api: str, model: str, prompts: list[Prompt], streams: int, load_s: float,
                drain_s: float, seed: int) -> LoadTally:
    """``streams`` clients for ``load_s`` seconds; the requests still in flight then get
    ``drain_s`` seconds before they are cut (their connections closed)."""
    tally = LoadTally()
    deadline = time.monotonic() + load_s
    async with async_client(api, streams, HTTP_TIMEOUT_S) as client:
        tasks = [asyncio.create_task(client_loop(client, random.Random(seed * 1000 + i), model,
                                                 prompts, deadline, tally))
                 for i in range(streams)]
        await asyncio.wait(tasks, timeout=load_s + drain_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return tally


def answer_kind(record: RequestRecord) -> str:
    """What a burst's request got: "200" (served whole), the HTTP status it was refused
    with ("429": over the queue), "200 without [DONE]", or the exception's name."""
    if record.ok:
        return "200"
    if record.error.startswith("no [DONE]"):
        return "200 without [DONE]"
    return record.error.split(":")[0].removeprefix("http ")


async def queue_burst(api: str, model: str, prompt: Prompt, count: int) -> dict[str, Any]:
    """``count`` streamed requests at once: how many the server took (200), how many it
    refused as over its queue (429), and any other answer (errors)."""
    payload = {"model": model, "messages": [{"role": "user", "content": prompt.text}],
               "max_tokens": MAX_TOKENS[0], "stream": True}
    async with async_client(api, count, HTTP_TIMEOUT_S) as client:
        records = await asyncio.gather(*(stream_chat(client, payload) for _ in range(count)))
    answers = Counter(answer_kind(r) for r in records)
    errors = {k: v for k, v in answers.items() if k not in ("200", "429")}
    return {"sent": count, "served": answers["200"], "rejected": answers["429"],
            "errors": errors}
