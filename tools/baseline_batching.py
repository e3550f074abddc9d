"""openvino_genai serving N users at once: its ContinuousBatchingPipeline, and the
arithmetic of N streams' throughput (served at once, or one after another by one
LLMPipeline). tools.baseline puts the two side by side (``GenaiUsers``): the baseline of
tools/bench_microbatch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.bench_common import genai_greedy_config, genai_token_ids

# Distinct openers, one per concurrent user (N streams take the first N).
STREAM_PROMPTS: tuple[str, ...] = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a steam engine turns heat into motion, step by step.",
    "The history of the printing press begins in fifteenth-century Mainz, where",
    "List the planets of the solar system and one surprising fact about each.",
    "Describe a busy morning market in a small coastal town.",
    "Give three tips for someone learning to play the violin as an adult.",
    "Why do leaves change colour in autumn? Answer for a ten-year-old.",
    "Draft a polite email asking a neighbour to move their bicycle.",
)


def stream_throughput(step_s: Sequence[float],
                      step_tokens: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Aggregate and per-stream throughput of N streams served by one stepped batch.

    ``step_s[i]`` is when step i ended (seconds since the requests were submitted, so
    wall = ``step_s[-1]``); ``step_tokens[i][j]`` is how many tokens stream j received in
    step i. Prefill is separated by time: ``prefill_s`` ends at the step in which the last
    stream received its first token, and the decode aggregate counts only tokens of later
    steps over ``decode_s = wall - prefill_s``. Per stream, decode tok/s is (tokens after its
    first) / (last token - first token) and ``ttft_ms`` is its first-token time.
    """
    if not step_s or len(step_s) != len(step_tokens):
        raise ValueError("need one token row per step, and at least one step")
    n = len(step_tokens[0])
    if n == 0 or any(len(row) != n for row in step_tokens):
        raise ValueError("every step row needs one count per stream")
    first: list[int | None] = [None] * n
    last = [0] * n
    for i, row in enumerate(step_tokens):
        for j, k in enumerate(row):
            if k:
                first[j] = i if first[j] is None else first[j]
                last[j] = i
    if any(f is None for f in first):
        raise ValueError("a stream received no token")
    firsts = [f for f in first if f is not None]
    per_stream = [sum(row[j] for row in step_tokens) for j in range(n)]
    wall = float(step_s[-1])
    prefill_end = max(firsts)
    prefill_s = float(step_s[prefill_end])
    decode_s = wall - prefill_s
    decode_tokens = sum(sum(row) for row in step_tokens[prefill_end + 1:])
    stream_tok_s = []
    for j, f in enumerate(firsts):
        span = float(step_s[last[j]] - step_s[f])
        after = per_stream[j] - step_tokens[f][j]
        stream_tok_s.append(after / span if span > 0 else 0.0)
    total = sum(per_stream)
    return {"streams": n, "tokens": total, "stream_tokens": per_stream, "wall_s": wall,
            "prefill_s": prefill_s, "decode_s": decode_s, "decode_tokens": decode_tokens,
            "aggregate_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
            "aggregate_incl_prefill_tok_s": total / wall if wall > 0 else 0.0,
            "per_stream_tok_s": stream_tok_s,
            "ttft_ms": [float(step_s[f]) * 1000.0 for f in firsts]}


def sequential_throughput(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The same summary for N users served one after another (one LLMPipeline).

    ``runs`` are ``tools.baseline.BaselinePipeline.generate_timed`` results, one per user. Each run's
    prefill is its TTFT, so decode = wall - TTFT; the decode aggregate equals a single
    user's decode rate (aggregate throughput does not grow with N, latency does).
    """
    if not runs:
        raise ValueError("no runs")
    walls = [r["wall_ms"] / 1000.0 for r in runs]
    prefills = [r["ttft_ms"] / 1000.0 for r in runs]
    gen = [int(r["n_generated"]) for r in runs]
    decode_s = sum(w - p for w, p in zip(walls, prefills, strict=True))
    decode_tokens = sum(g - 1 for g in gen)  # the first token of each run comes from prefill
    wall = sum(walls)
    starts = [sum(walls[:j]) for j in range(len(runs))]  # user j waits for users < j
    return {"streams": len(runs), "tokens": sum(gen), "stream_tokens": gen, "wall_s": wall,
            "prefill_s": sum(prefills), "decode_s": decode_s, "decode_tokens": decode_tokens,
            "aggregate_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
            "aggregate_incl_prefill_tok_s": sum(gen) / wall if wall > 0 else 0.0,
            "per_stream_tok_s": [(g - 1) / (w - p) if w > p else 0.0
                                 for g, w, p in zip(gen, walls, prefills, strict=True)],
            "ttft_ms": [(s + p) * 1000.0 for s, p in zip(starts, prefills, strict=True)]}


class ContinuousBatchingBaseline:
    """openvino_genai.ContinuousBatchingPipeline serving N concurrent greedy requests.

    The micro-batching baseline: same export and plugin ``props`` as tools.baseline's
    ``BaselinePipeline`` (``ATTENTION_BACKEND`` is dropped: continuous batching is always
    paged attention).
    The scheduler gets a fixed KV cache of ``cache_gb`` GB, no prefix caching unless
    ``prefix_caching`` (so repeated prompts pay their prefill every run) and the default
    256-token batch budget with dynamic split-fuse. :meth:`measure` drives ``step()``
    itself and timestamps every step, so prefill and decode are split by time (see
    :func:`stream_throughput`).
    """

    def __init__(self, model_dir: Path, props: dict[str, Any] | None = None, device: str = "CPU",
                 cache_gb: int = 1, max_num_seqs: int = 16, warmup_streams: int = 4,
                 prefix_caching: bool = False) -> None:
        import openvino_genai as ov_genai

        self._genai = ov_genai
        sched = ov_genai.SchedulerConfig()
        sched.cache_size = cache_gb
        sched.max_num_seqs = max_num_seqs
        sched.enable_prefix_caching = prefix_caching
        sched.dynamic_split_fuse = True
        self.props = {k: v for k, v in (props or {}).items() if k != "ATTENTION_BACKEND"}
        start = time.perf_counter()
        self.pipe = ov_genai.ContinuousBatchingPipeline(str(model_dir), sched, device, self.props)
        self.load_s = time.perf_counter() - start
        self.tokenizer = self.pipe.get_tokenizer()
        self._next_id = 0
        if warmup_streams > 0:  # first steps pay one-off kernel compilation (~0.5 s)
            prompts = [self.encode(p) for p in STREAM_PROMPTS[:warmup_streams]]
            self.measure(prompts, 8)
            self.measure(prompts[:1], 8)

    def encode(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` (no chat template), as ``BaselinePipeline.encode``."""
        return genai_token_ids(self.tokenizer, prompt)

    def measure(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                max_new_tokens: int) -> dict[str, Any]:
        """Submit one request per prompt at once, step until all finish, summarise.

        Every request generates exactly ``max_new_tokens`` greedy tokens (ignore_eos).
        Returns :func:`stream_throughput`'s dict plus ``token_ids`` (per stream) and
        ``n_input`` (prompt lengths); ``aggregate_tok_s`` is the decode-only aggregate.
        """
        import numpy as np
        import openvino as ov

        ids = [self.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        if not ids:
            raise ValueError("no prompts")
        cfg = genai_greedy_config(self._genai, max_new_tokens)
        tensors = [ov.Tensor(np.asarray([x], dtype=np.int64)) for x in ids]
        out: list[list[int]] = [[] for _ in ids]
        step_s: list[float] = []
        step_tokens: list[list[int]] = []
        start = time.perf_counter()
        handles = []
        for t in tensors:
            handles.append(self.pipe.add_request(self._next_id, t, cfg))
            self._next_id += 1
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
            step_s.append(time.perf_counter() - start)
            row = []
            for j, h in enumerate(handles):
                got = [int(x) for o in h.read().values() for x in o.generated_ids] \
                    if h.can_read() else []
                out[j] += got
                row.append(len(got))
            step_tokens.append(row)
        statuses = [h.get_status() for h in handles]
        bad = [j for j, o in enumerate(out) if len(o) != max_new_tokens]
        if bad:
            raise RuntimeError(f"streams {bad} stopped early ({statuses}): KV cache too small?")
        return {**stream_throughput(step_s, step_tokens), "token_ids": out,
                "n_input": [len(x) for x in ids]}
