"""openvino_genai's ContinuousBatchingPipeline serving a request set to N concurrent
clients: the baseline of tools.bench_serve.

One thread drives ``add_request`` + ``step()``: N requests are in flight from the start,
and as soon as a step ends one of them, the next request of the set is added (the client
whose request ended sends its next one), until the set is served. Every token read after
a step is stamped with that step's end, so TTFT, inter-token gaps and end-to-end latency
are recorded per request exactly as tools.serve_load records them from an HTTP stream
(a step delivering several tokens to a request is one chunk). The pipeline is set up as
tools.baseline_batching's ``ContinuousBatchingBaseline`` (same export, plugin properties,
KV cache and scheduler), the prompts are the chat-templated token ids zctl's engine feeds
(the export's own tokenizer and template), and generation is greedy with the same
``max_tokens``, stopping at the same EOS token.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tools.serve_load import LevelRun, RequestRecord, ServeRequest

# Request ids, never reused in a process; clear of those ContinuousBatchingBaseline.measure
# hands out (from 0).
REQUEST_IDS = itertools.count(1 << 20)


class GenaiServer:
    """A ContinuousBatchingPipeline on the monolithic export at ``model_dir`` serving
    :class:`ServeRequest` s; ``export_dir`` (a zctl export of the same model) gives the
    tokenizer and chat template, so both systems see the same input ids. ``prefix_caching``:
    its scheduler keeps prompts' KV for later requests, as zctl's prefix cache does."""

    def __init__(self, model_dir: Path, export_dir: Path, props: dict[str, Any] | None = None,
                 max_num_seqs: int = 16, warmup_streams: int = 4,
                 prefix_caching: bool = False) -> None:
        from tools.baseline_batching import ContinuousBatchingBaseline
        from zctl.engine.tokenizer import ChatTokenizer

        self.baseline = ContinuousBatchingBaseline(model_dir, props, max_num_seqs=max_num_seqs,
                                                   warmup_streams=warmup_streams,
                                                   prefix_caching=prefix_caching)
        self.pipe = self.baseline.pipe
        self.tokenizer = ChatTokenizer(export_dir)
        self.eos_token_id = self.tokenizer.eos_token_id
        self._ids: dict[str, list[int]] = {}

    def prompt_ids(self, request: ServeRequest) -> list[int]:
        """The request's chat-templated token ids (cached by prompt)."""
        if request.prompt not in self._ids:
            self._ids[request.prompt] = self.tokenizer.encode(request.prompt, chat=True)
        return self._ids[request.prompt]

    def config(self, max_tokens: int) -> Any:
        """Greedy, at most ``max_tokens`` new tokens, stopping at the export's EOS."""
        import openvino_genai as ov_genai

        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = max_tokens
        cfg.do_sample = False
        if self.eos_token_id is not None:
            cfg.eos_token_id = self.eos_token_id
        return cfg

    def serve(self, requests: Sequence[ServeRequest], concurrency: int) -> LevelRun:
        """Serve ``requests`` with ``concurrency`` in flight (see the module's docstring)."""
        return serve_on(self.pipe, requests, concurrency, self.prompt_ids, self.config)


def serve_on(pipe: Any, requests: Sequence[ServeRequest], concurrency: int,
             prompt_ids: Callable[[ServeRequest], list[int]],
             config: Callable[[int], Any]) -> LevelRun:
    """Drive ``pipe`` (a ContinuousBatchingPipeline: add_request, step, handles) through
    ``requests`` with ``concurrency`` of them in flight; ``config(max_tokens)`` is each
    request's GenerationConfig. A failing step ends every live request with an error and
    leaves the rest unsent (errors too)."""
    import numpy as np
    import openvino as ov

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pending = deque(requests)

    def submit(request: ServeRequest) -> tuple[Any, RequestRecord]:
        ids = prompt_ids(request)
        record = RequestRecord(request.index, time.perf_counter(), prompt_tokens=len(ids),
                               usage=True)
        tensor = ov.Tensor(np.asarray([ids], dtype=np.int64))
        return pipe.add_request(next(REQUEST_IDS), tensor, config(request.max_tokens)), record

    start = time.perf_counter()
    live = [submit(pending.popleft()) for _ in range(min(concurrency, len(pending)))]
    done: list[RequestRecord] = []
    while live:
        try:
            pipe.step()
        except Exception as exc:  # noqa: BLE001 (counted: every live request failed)
            for _, record in live:
                _end(record, f"step failed: {type(exc).__name__}: {exc}"[:300])
            done += [r for _, r in live]
            break
        now = time.perf_counter()
        still = []
        for handle, record in live:
            status = _read(handle, record, now)
            if status is None:
                still.append((handle, record))
                continue
            _end(record, status)
            done.append(record)
            if pending:
                still.append(submit(pending.popleft()))
        live = still
    for request in pending:  # never sent: the pipeline failed
        done.append(RequestRecord(request.index, start, end=start, error="not served"))
    end = max((r.end for r in done), default=start)
    return LevelRun(concurrency, sorted(done, key=lambda r: r.index), end - start)


def _read(handle: Any, record: RequestRecord, now: float) -> str | None:
    """Take the tokens a step gave the request (one chunk at ``now``); None while it runs,
    else "" when it finished, or why it did not."""
    import openvino_genai as ov_genai

    got = 0
    while handle.can_read():
        got += sum(len(out.generated_ids) for out in handle.read().values())
    if got:
        record.chunk_times.append(now)
        record.completion_tokens += got
    status = handle.get_status()  # settled: step() ran in this thread
    if status == ov_genai.GenerationStatus.RUNNING:
        return None
    return "" if status == ov_genai.GenerationStatus.FINISHED else f"status {status.name}"


def _end(record: RequestRecord, error: str) -> None:
    record.end = time.perf_counter()
    record.error = error
