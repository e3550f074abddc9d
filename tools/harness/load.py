"""The benchmarks' one HTTP load client, for any OpenAI-compatible server (zctl serve):
chat completions streamed over SSE (POST /v1/chat/completions with ``stream`` and
``stream_options.include_usage``) or whole, each recorded as its client saw it
(``RequestRecord``); N concurrent clients through a shared list of requests, modelled on
vLLM's benchmark_serving (``http_level``); the model a server serves (GET /v1/models);
and the request set of the serving benchmark, mixed prompts and ``max_tokens``.

Definitions, the same for every system measured (tools.serving.serve):

- TTFT: from sending the request to the first chunk carrying content.
- ITL (inter-token latency): the gaps between successive content chunks, pooled over the
  level's requests, as a client sees them. A chunk may carry several tokens (zctl's
  generation service sends a stream's new tokens every 100 ms): the gaps are then chunk
  gaps, not token gaps, and ``tokens_per_chunk`` (completion tokens / content chunks)
  says how many tokens a gap covered on average. TPOT, per request (last chunk - first
  chunk) / (completion tokens - 1), is the per-token figure whatever the chunking.
- Aggregate tok/s: completion tokens of the level's successful requests (from the
  server's ``usage``, not assumed from ``max_tokens``) / the level's wall time (first
  request sent to last request ended).
- An error: HTTP status != 200, an exception (connection, timeout, bad JSON), an error
  object in the stream, or a stream that ended without ``data: [DONE]`` (unless the client
  left it on purpose: ``leave_after``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tools.harness.stats import aggregate_tok_s, p50_p99_ms, percentile, seconds_as_ms

# -- the request set -------------------------------------------------------------------------

# Sentences of a "document" the longer prompts carry (about 13-17 tokens each).
CONTEXT = (
    "The harbour town wakes early, when the fishing boats return with the night's catch.",
    "Merchants set out baskets of bread, cheese and dried fruit along the narrow quay.",
    "A lighthouse on the northern cliff has guided ships past the reef for two centuries.",
    "Its keeper climbs one hundred and twelve steps every evening to light the lamp.",
    "In winter, storms from the west push waves over the sea wall and flood the market.",
    "The school teaches children to read tide tables before they learn long division.",
    "Every spring the town holds a festival with music, boat races and a parade of lanterns.",
    "Tourists arrive by ferry in summer, filling the cafes and the small stone museum.",
    "The museum keeps a collection of ship models, old charts and letters from sailors.",
    "A railway line was planned in the last century but never built across the marshes.",
    "Most families still keep a small garden where they grow potatoes, beans and herbs.",
    "The mayor is elected every four years by a show of hands in the town square.",
    "A new wind farm offshore now supplies most of the electricity the town uses.",
    "Some older residents say the turbines have changed the way the birds migrate.",
    "The local newspaper prints one edition a week and is delivered by bicycle.",
    "Young people often leave for the city but many come back to raise their families.",
)
# Instructions after a document, and stand-alone prompts for the short requests.
ABOUT_TEXT = (
    "Summarise the text above in detail.",
    "Write a story set in the town described above.",
    "List every fact in the text above and explain why it matters.",
    "Describe a day in the life of someone living in the town above.",
)
STANDALONE = (
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a steam engine turns heat into motion, step by step.",
    "Describe a busy morning market in a small coastal town.",
    "Give ten tips for someone learning to play the violin as an adult, with reasons.",
    "Why do leaves change colour in autumn? Answer for a ten-year-old, in detail.",
    "Explain how a bicycle's gears work and when to change them.",
)
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
CONTEXT_SENTENCES = (0, 0, 3, 8, 16, 24)  # a prompt's document: 0 to ~400 tokens
MAX_TOKENS = (16, 32, 64, 128, 192, 256)


@dataclass(frozen=True)
class ServeRequest:
    """One request of the set: a user message and the tokens it may generate."""

    index: int
    prompt: str
    max_tokens: int

    def messages(self) -> list[dict[str, str]]:
        """The chat form of the request."""
        return [{"role": "user", "content": self.prompt}]


def request_set(n: int, seed: int = 0) -> list[ServeRequest]:
    """``n`` requests of mixed prompt length (a stand-alone question, or a document of up to
    ~400 tokens and a question about it: 40-440 tokens with SmolLM2's chat template) and
    mixed ``max_tokens`` (16..256), deterministic for (n, seed): the same list for every
    system measured."""
    if n < 1:
        raise ValueError(f"need at least one request, got {n}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sentences = rng.choice(CONTEXT_SENTENCES)
        if sentences:
            first = rng.randrange(len(CONTEXT))
            doc = " ".join(CONTEXT[(first + j) % len(CONTEXT)] for j in range(sentences))
            prompt = f"{doc}\n\n{rng.choice(ABOUT_TEXT)}"
        else:
            prompt = rng.choice(STANDALONE)
        out.append(ServeRequest(i, prompt, rng.choice(MAX_TOKENS)))
    return out


# -- what a request recorded, and the statistics ------------------------------------------------


@dataclass
class RequestRecord:
    """One request as its client saw it: when it was sent, when each content chunk arrived,
    when its stream closed (``end``), its token counts (``usage``: the completion tokens
    are the server's), the text that came back, why it failed (``error``), and whether the
    client left the stream on purpose (``left``)."""

    index: int = 0
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    usage: bool = False  # completion_tokens came from the server's usage
    error: str = ""
    text: str = ""
    left: bool = False

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def done(self) -> bool:
        """Whether the request has ended (its stream closed, or it failed)."""
        return self.end > 0.0

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def ttft_ms(self) -> float | None:
        """TTFT in ms of a request that succeeded (None otherwise)."""
        return (self.chunk_times[0] - self.start) * 1e3 if self.ok and self.chunk_times else None

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first over the time from the first to the last (None: fewer
        than two, or a failed request)."""
        t = self.chunk_times
        if not self.ok or self.completion_tokens < 2 or len(t) < 2 or t[-1] <= t[0]:
            return None
        return (self.completion_tokens - 1) / (t[-1] - t[0])

    def gaps_s(self) -> list[float]:
        """The gaps between successive content chunks."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last chunk - first chunk) / (tokens - 1)."""
        if self.completion_tokens < 2 or len(self.chunk_times) < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)


@dataclass
class LevelRun:
    """A concurrency level's requests and its wall time."""

    concurrency: int
    records: list[RequestRecord]
    wall_s: float


def summarize(run: LevelRun) -> dict[str, Any]:
    """A level's figures: aggregate tok/s over its successful requests, TTFT, ITL and
    TPOT p50/p99, end-to-end p50, errors (and what they were), token counts."""
    good = [r for r in run.records if r.ok]
    tokens = sum(r.completion_tokens for r in good)
    chunks = sum(len(r.chunk_times) for r in good)
    prompt = [r.prompt_tokens for r in good if r.prompt_tokens is not None]
    return {
        "concurrency": run.concurrency,
        "requests": len(run.records),
        "tok_s": round(aggregate_tok_s(tokens, run.wall_s), 2),
        "ttft_ms": p50_p99_ms([r.ttft_s for r in good if r.ttft_s is not None]),
        "itl_ms": p50_p99_ms([g for r in good for g in r.gaps_s()]),
        "tpot_ms": p50_p99_ms([t for r in good if (t := r.tpot_s()) is not None]),
        "e2e_ms_p50": seconds_as_ms(percentile([r.end - r.start for r in good], 50)),
        "errors": len(run.records) - len(good),
        "error_kinds": dict(Counter(r.error.split(":")[0] for r in run.records if r.error)),
        "completion_tokens": tokens,
        "prompt_tokens_mean": round(sum(prompt) / len(prompt), 1) if prompt else None,
        "tokens_per_chunk": round(tokens / chunks, 3) if chunks else None,
        "without_usage": sum(1 for r in good if not r.usage),
        "wall_s": round(run.wall_s, 3),
    }


# -- N concurrent clients ------------------------------------------------------------------------


async def run_clients(requests: Sequence[ServeRequest], concurrency: int,
                      send: Callable[[ServeRequest], Awaitable[RequestRecord]]) -> LevelRun:
    """``concurrency`` clients, each sending the next request of the shared list as soon
    as its previous one ended, until every request is served; wall time from the first
    request to the last one's end."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    queue = list(reversed(requests))
    records: list[RequestRecord] = []

    async def client() -> None:
        while queue:
            records.append(await send(queue.pop()))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(concurrency, len(requests)))))
    end = max((r.end for r in records), default=start)
    return LevelRun(concurrency, sorted(records, key=lambda r: r.index), end - start)


def chat_payload(model: str, request: ServeRequest) -> dict[str, Any]:
    """The streamed, greedy chat completion a request of the set is sent as."""
    return {"model": model, "messages": request.messages(), "max_tokens": request.max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


def read_event(record: RequestRecord, data: str, now: float) -> bool:
    """Apply one SSE ``data:`` payload to ``record``; True once it is ``[DONE]``."""
    if data == "[DONE]":
        return True
    chunk = json.loads(data)
    if not isinstance(chunk, dict):
        raise ValueError(f"a stream chunk is not an object: {data[:80]}")
    if chunk.get("error"):
        raise ValueError(f"error in stream: {str(chunk['error'])[:200]}")
    for choice in chunk.get("choices") or []:
        content = (choice.get("delta") or {}).get("content") or choice.get("text")
        if content:
            record.chunk_times.append(now)
            record.text += content
            break
    usage = chunk.get("usage")
    if usage:
        record.completion_tokens = int(usage["completion_tokens"])
        record.prompt_tokens = usage.get("prompt_tokens")
        record.usage = True
    return False


async def stream_chat(client: Any, payload: dict[str, Any], record: RequestRecord | None = None,
                      headers: dict[str, str] | None = None,
                      leave_after: int = 0, path: str = CHAT_PATH) -> RequestRecord:
    """One streamed chat completion through ``client`` (an httpx.AsyncClient on the
    server's base URL), filling ``record`` as its chunks arrive (a fresh one if None);
    ``leave_after`` > 0: the client closes the stream once that many content chunks came
    (``left``); ``path``: COMPLETIONS_PATH streams a text completion (a prompt of text or
    token ids) the same way. Errors are recorded, never raised."""
    record = RequestRecord() if record is None else record
    record.start = time.perf_counter()
    finished = False
    try:
        async with client.stream("POST", path, headers=headers, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread())[:300].decode(errors="replace")
                record.error = f"http {response.status_code}: {body}"
            else:
                async for line in response.aiter_lines():
                    if line.startswith("data:") and read_event(
                            record, line[5:].strip(), time.perf_counter()):
                        finished = True
                    if leave_after and len(record.chunk_times) >= leave_after:
                        record.left = True
                        break  # leaving the block closes the connection
                if not finished and not record.left:
                    record.error = "no [DONE]: the stream ended early"
    except Exception as exc:  # noqa: BLE001 (every failure is a counted error)
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.end = time.perf_counter()
    if record.ok and not record.usage:
        record.completion_tokens = len(record.chunk_times)  # counted as without_usage
    return record


async def complete_chat(client: Any, payload: dict[str, Any],
                        headers: dict[str, str] | None = None) -> RequestRecord:
    """One whole (not streamed) chat completion through ``client``: its text and token
    counts, the answer's arrival its one chunk. Errors are recorded, never raised."""
    record = RequestRecord(start=time.perf_counter())
    try:
        answer = await client.post("/v1/chat/completions", headers=headers,
                                   json={**payload, "stream": False})
        if answer.status_code != 200:
            record.error = f"http {answer.status_code}: {answer.text[:300]}"
        elif not (body := answer.json()).get("choices"):
            record.error = f"no choices: {answer.text[:200]}"
        else:
            record.chunk_times.append(time.perf_counter())
            record.text = body["choices"][0].get("message", {}).get("content") or ""
            record.completion_tokens = int(body["usage"]["completion_tokens"])
            record.prompt_tokens = body["usage"].get("prompt_tokens")
            record.usage = True
    except Exception as exc:  # noqa: BLE001 (every failure is a counted error)
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.end = time.perf_counter()
    return record


def async_client(base_url: str, connections: int, timeout_s: float = 300.0,
                 keepalive: bool = True) -> Any:
    """An httpx.AsyncClient on ``base_url`` for ``connections`` requests at once
    (``keepalive`` False: a fresh connection for every request)."""
    import httpx

    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s, connect=10.0),
                             limits=httpx.Limits(max_connections=connections,
                                                 max_keepalive_connections=connections
                                                 if keepalive else 0))


def auth_headers(api_key: str | None) -> dict[str, str] | None:
    """The header that carries ``api_key`` (None without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


async def http_level(base_url: str, model: str, requests: Sequence[ServeRequest],
                     concurrency: int, api_key: str | None = None,
                     timeout_s: float = 300.0, extra: dict[str, Any] | None = None,
                     keepalive: bool = True) -> LevelRun:
    """``concurrency`` clients streaming ``requests`` from the server at ``base_url``
    (``extra``: fields added to every request, e.g. ignore_eos; ``keepalive`` False: each
    request on a connection of its own)."""
    headers = auth_headers(api_key)
    async with async_client(base_url, concurrency, timeout_s, keepalive) as client:
        return await run_clients(requests, concurrency, lambda r: stream_chat(
            client, {**chat_payload(model, r), **(extra or {})}, RequestRecord(r.index),
            headers))


@dataclass(frozen=True)
class ServedModel:
    """The model a server serves: its id and (zctl serve says it) its context length."""

    id: str
    max_model_len: int | None


async def served_model(base_url: str, api_key: str | None = None) -> ServedModel:
    """The server's first model (GET /v1/models: data[0])."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as client:
        response = await client.get("/v1/models", headers=auth_headers(api_key))
        response.raise_for_status()
        data = response.json()["data"][0]
        context = data.get("max_model_len")
        return ServedModel(str(data["id"]), None if context is None else int(context))
