"""The generation service: the coordinator's front door for ``zctl run``.

One thread owns a ROUTER socket and drives the coordinator's stage-0 pipeline
(``ClusterPipeline`` is not thread-safe, so generation never leaves this thread).
A request is answered with a stream of ``GenerateChunk`` messages and one
``GenerateDone``; bad requests get an ``Error`` and the service keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from controlplane.messages import Error, MessageError, from_frames, to_frames
from controlplane.service_messages import GenerateChunk, GenerateDone, GenerateRequest
from dataplane.generate import GenerationStats, Pipeline, generate_greedy
from dataplane.manifest import load_manifest
from dataplane.tokenizer import ChatTokenizer, StreamDecoder

log = logging.getLogger("zctl.service")
CHUNK_INTERVAL_S = 0.1  # how often running figures (percentiles) are recomputed and sent


def timing_summary(pipeline: Any) -> dict[str, dict[str, float]]:
    window = getattr(pipeline, "timings", None)
    return window.summary() if window is not None and len(window) else {}


class GenerationService:
    """Serve generations on ``endpoint`` using the pipeline ``get_pipeline()`` returns."""

    def __init__(self, export_dir: Path | str, get_pipeline: Callable[[], Pipeline | None],
                 endpoint: str = "tcp://127.0.0.1:*") -> None:
        self.export_dir = Path(export_dir)
        manifest = load_manifest(self.export_dir, verify_files=False)
        self.tokenizer = ChatTokenizer(self.export_dir)
        stops = set(manifest.model.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            stops.add(self.tokenizer.eos_token_id)
        self.stop_ids = sorted(stops)
        self.get_pipeline = get_pipeline
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4 << 20)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise OSError(f"generation service cannot bind {endpoint}: {exc}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.counters = {"requests": 0, "malformed": 0, "failed": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        self._thread = threading.Thread(target=self.run, name="zctl-generation", daemon=True)
        self._thread.start()
        return self.endpoint

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._sock.close(0)
        self._ctx.term()

    def run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(200):
                continue
            frames = self._sock.recv_multipart()
            identity, body = frames[0], frames[1:]
            try:
                msg, _ = from_frames(body)
                if not isinstance(msg, GenerateRequest):
                    raise MessageError(f"the generation service takes generate_request, not {msg.TYPE}")
            except MessageError as exc:
                self.counters["malformed"] += 1
                self._send(identity, Error("bad-request", str(exc)))
                continue
            self.counters["requests"] += 1
            self._generate(identity, msg)

    def _send(self, identity: bytes, msg: Any) -> None:
        try:
            self._sock.send_multipart([identity, *to_frames(msg)])
        except zmq.ZMQError as exc:  # the client went away: keep serving others
            log.info("client %r unreachable: %s", identity, exc)

    def _generate(self, identity: bytes, req: GenerateRequest) -> None:
        stats = GenerationStats()
        produced: list[int] = []
        reason, error = "max_tokens", ""
        pipeline = self.get_pipeline()
        if pipeline is None:
            self.counters["failed"] += 1
            self._send(identity, GenerateDone(req.request_id, [], "", 0, 0.0, 0.0,
                                              error="the pipeline is not wired yet"))
            return
        window = getattr(pipeline, "timings", None)
        if window is not None:
            window.clear()
        decoder = StreamDecoder(self.tokenizer)
        pending: list[int] = []
        pending_text = ""
        last_sent = time.monotonic()
        try:
            ids = self.tokenizer.encode(req.prompt, chat=req.chat)
            stops = () if req.ignore_eos else self.stop_ids
            for token in generate_greedy(pipeline, ids, req.max_tokens, stops, stats=stats):
                produced.append(token)
                if token in stops:
                    reason = "eos"
                    break
                pending.append(token)
                pending_text += decoder.push(token)
                now = time.monotonic()
                if now - last_sent >= CHUNK_INTERVAL_S or len(produced) == 1:
                    self._send(identity, GenerateChunk(
                        req.request_id, pending, pending_text, len(produced), stats.ttft_ms,
                        stats.tok_s or None, timing_summary(pipeline)))
                    pending, pending_text, last_sent = [], "", now
        except Exception as exc:  # a stage failed or timed out: report it, keep serving
            self.counters["failed"] += 1
            error, reason = f"{type(exc).__name__}: {exc}", "error"
            log.warning("generation %s failed: %s", req.request_id, error)
        if pending:
            self._send(identity, GenerateChunk(req.request_id, pending, pending_text,
                                               len(produced), stats.ttft_ms, stats.tok_s or None,
                                               timing_summary(pipeline)))
        # The final text is decoded whole: a trailing incomplete character is not held back.
        kept = produced[:-1] if reason == "eos" else produced
        self._send(identity, GenerateDone(
            req.request_id, produced, self.tokenizer.decode(kept), stats.prompt_tokens,
            stats.ttft_ms, stats.tok_s, timing_summary(pipeline), reason, error))
