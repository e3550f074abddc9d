"""The generation service: the coordinator's ZeroMQ front door for ``zctl run``.

One thread owns a ROUTER socket and drives a ``GenerationEngine`` (zctl.engine.core) on the
coordinator's stage-0 executor: it takes ``GenerationRequest`` messages, hands them to the
engine, and sends back the engine's ``GenerationChunk`` events and one ``GenerationDone``
per request, as they are, to the client that asked; ``GenerateCancel`` stops one;
``ServiceStatsRequest`` is answered with a ``ServiceStats`` snapshot (zctl.service.stats);
``TokenizeRequest`` and ``DetokenizeRequest`` with a ``TokensReply``.
Malformed requests get an ``Error`` and the service keeps serving. A client that vanishes
(or stops reading) has its generations cancelled: they free the stages at once. The
executor is never touched by another thread (``ClusterHead`` is not thread-safe).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from controlplane.messages import (
    Error,
    MessageError,
    from_frames,
    registration,
    to_frames,
    type_tag,
)
from controlplane.sockets import router_socket
from dataplane.head.metrics import MeasuredExecutor
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.draft_model import DraftModels
from dataplane.runtime.kv.blocks import sliding_tokens
from zctl.engine.core import POLL_S, RESUME_TIMEOUT_S, GenerationEngine
from zctl.engine.kv_cost import EVERY_TOKEN, KvCost
from zctl.engine.requests import DEFAULT_MAX_STREAMS, GenerationRequest, RequestRefused
from zctl.engine.sampling_defaults import model_sampling
from zctl.engine.tokenizer import ChatTokenizer, TokenizerError
from zctl.manifest import ExportManifest, load_manifest
from zctl.service.messages import (
    DetokenizeRequest,
    GenerateCancel,
    ServiceStatsRequest,
    TokenizeRequest,
    TokensReply,
)
from zctl.service.stats import ClusterView, StatsCollector

log = logging.getLogger("zctl.service")
# The largest request the engine accepts: MAX_PROMPT_CHARS characters, each up to 12 bytes
# of JSON (an escaped surrogate pair, ``\ud83d\ude00``), with room for its other fields.
# Anything bigger drops the sender's connection (MAXMSGSIZE), so this must hold them all.
MAX_REQUEST_BYTES = 16 << 20
# what may wait for a client that reads slower than its generations stream (a busy HTTP
# front door with 16 streams of a fast model queued ~1,000 chunks within a second, and was
# taken for gone at ZeroMQ's default of 1,000): a client found not reading past this is.
CLIENT_QUEUE_MESSAGES = 100_000
IDLE_WAIT_MS = 200  # how long the loop waits for a request while nothing generates


SERVED = (GenerationRequest, GenerateCancel, ServiceStatsRequest, TokenizeRequest,
          DetokenizeRequest)
SERVED_TAGS = [registration(cls).tag for cls in SERVED]


def tokens_reply(engine: GenerationEngine, msg: TokenizeRequest | DetokenizeRequest
                 ) -> TokensReply:
    """A tokenize request's prompt ids (as its generation would see them) and their token
    strings, or a detokenize request's text; what is wrong with either in ``error``."""
    tokenizer, rid = engine.tokenizer, msg.request_id
    if isinstance(msg, DetokenizeRequest):
        bad = next((t for t in msg.tokens if not 0 <= t < engine.vocab_size), None)
        if bad is not None:
            return TokensReply(rid, [], [], error=f"token id {bad} is outside the model's "
                               f"vocabulary of {engine.vocab_size}")
        return TokensReply(rid, list(msg.tokens), [], text=tokenizer.decode(
            list(msg.tokens), skip_special_tokens=msg.skip_special_tokens))
    try:
        ids = engine.prompt_ids(msg.generation)
    except (TokenizerError, RequestRefused) as exc:
        return TokensReply(rid, [], [], error=str(exc))
    return TokensReply(rid, ids, [tokenizer.backend.id_to_token(t) or "" for t in ids])


KV_BYTES_PER_VALUE = 4  # what a KV value is budgeted at: a copied-out prefix is f32


def kv_bytes_per_token(manifest: ExportManifest) -> int:
    """Bytes one token's KV takes on the fullest stage (keys and values of its layers),
    at ``KV_BYTES_PER_VALUE``: an upper bound (the CPU plugin keeps its own KV in u8)."""
    model = manifest.model
    layers = max(s.layer_end - s.layer_start for s in manifest.stages)
    return layers * 2 * model.num_kv_heads * model.head_dim * KV_BYTES_PER_VALUE


def kv_tokens(manifest: ExportManifest, megabytes: int) -> int:
    """Tokens of KV that ``megabytes`` hold on the fullest stage."""
    return megabytes * 2**20 // kv_bytes_per_token(manifest)


def kv_cost(manifest: ExportManifest, runtime: RuntimeSpec | None) -> KvCost:
    """What a stream's tokens cost against ``kv_tokens``' budget on stages compiled as
    ``runtime`` says: a sliding layer keeps its window, its margin and a step's token, over
    block edges on paged stages, with a slack on stateful ones whose export lets them trim
    (``kv.blocks.sliding_tokens``); elsewhere, or with no runtime known, every layer keeps
    every token."""
    model = manifest.model
    kept = sliding_tokens(runtime, model)
    if kept is None or not model.sliding_layers:
        return EVERY_TOKEN
    sliding = set(model.sliding_layers)
    stages = tuple((s.layer_end - s.layer_start - n, n) for s in manifest.stages
                   for n in [len(sliding & set(range(s.layer_start, s.layer_end)))])
    return KvCost(stages, kept)


class GenerationService:
    """Serve generations on ``endpoint`` using the executor ``get_executor()`` returns.

    The engine's stop tokens, chat template and default sampling (for what a request
    leaves out) come from ``export_dir``. ``stage_runtime``: what the stages are compiled
    with (None: not known; RuntimeSpec's defaults for drafts): it says what a stream's KV
    costs against the budget (``kv_cost``), and draft models of speculative requests are
    loaded with it (a draft model runs as stage 0 does). ``cluster`` returns the coordinator's
    cluster status, which stats read the stages' nodes and node liveness from (None: no
    control plane, the executor is all there is). ``kv_memory_mb``: the KV a stage may hold
    for running streams and cached prefixes together (None: no limit), ``prefix_cache_mb``
    how much of it cached prefixes may (0: no prefix cache); see ``kv_tokens``."""

    def __init__(self, export_dir: Path | str, get_executor: Callable[[], MeasuredExecutor | None],
                 endpoint: str = "tcp://127.0.0.1:*", max_streams: int = DEFAULT_MAX_STREAMS,
                 row_groups: int = 0, shared_cores: bool = False,
                 health: Callable[[], str | None] | None = None,
                 resume_timeout_s: float = RESUME_TIMEOUT_S,
                 stage_runtime: RuntimeSpec | None = None,
                 cluster: ClusterView | None = None, kv_memory_mb: int | None = None,
                 prefix_cache_mb: int = 0) -> None:
        self.export_dir = Path(export_dir)
        manifest = load_manifest(self.export_dir, verify_files=False)
        tokenizer = ChatTokenizer(self.export_dir)
        stops = set(manifest.model.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
        draft_runtime = stage_runtime  # a draft model runs as stage 0 does
        self.engine = GenerationEngine(
            tokenizer, sorted(stops), get_executor, max_streams=max_streams,
            row_groups=row_groups, shared_cores=shared_cores, health=health,
            resume_timeout_s=resume_timeout_s,
            load_drafter=DraftModels(manifest.model.vocab_size, draft_runtime),
            max_context=manifest.model.max_position_embeddings,
            vocab_size=manifest.model.vocab_size,
            kv_budget_tokens=None if kv_memory_mb is None else kv_tokens(manifest, kv_memory_mb),
            kv_cost=kv_cost(manifest, stage_runtime),
            prefix_cache_tokens=kv_tokens(manifest, prefix_cache_mb),
            sampling_defaults=model_sampling(manifest.generation_config))
        self._stats = StatsCollector(manifest, self.engine, get_executor, cluster)
        self._ctx = zmq.Context()
        self._sock = router_socket(self._ctx, MAX_REQUEST_BYTES, send_hwm=CLIENT_QUEUE_MESSAGES)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._ctx.term()
            raise OSError(f"generation service cannot bind {endpoint}: {exc}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._malformed = 0
        self._unreachable = 0  # clients found gone (or not reading), their generations cancelled
        self._gone: set[Any] = set()  # clients found unreachable (their events are dropped)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def counters(self) -> dict[str, int]:
        """Requests taken, malformed, failed, cancelled, the most streams at once, clients
        found unreachable, tokens generated (generated_tokens), draft tokens proposed and
        accepted (spec_drafted, spec_accepted), the prefix cache's (prefix_*:
        GenerationEngine.prefix_counters), and structured output's (structured_requests,
        forced_tokens): GenerationEngine.token_counters."""
        return {**self.engine.counters, "malformed": self._malformed,
                "unreachable": self._unreachable, **self.engine.token_counters(),
                **self.engine.prefix_counters()}

    @property
    def stop_ids(self) -> list[int]:
        return self.engine.stop_ids

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
            if self._sock.poll(0 if self.engine.busy else IDLE_WAIT_MS):
                self._receive_all()
            settled = set(self._gone)  # their generations were cancelled when found gone:
            for client, event in self.engine.poll(POLL_S):  # their ends come out now
                self._send(client, event)
            self._gone -= settled  # nothing more is meant for them: forget them

    def _receive_all(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            self._gone.discard(identity)  # it is back
            try:
                msg, _ = from_frames(body)
                if not isinstance(msg, SERVED):
                    raise MessageError("the generation service takes "
                                       f"{', '.join(SERVED_TAGS)}, not {type_tag(msg)}")
            except MessageError as exc:
                self._malformed += 1
                self._send(identity, Error("bad-request", str(exc)))
                continue
            if isinstance(msg, GenerateCancel):
                self.engine.cancel(identity, msg.request_id)
            elif isinstance(msg, ServiceStatsRequest):
                self._send_stats(identity)
            elif isinstance(msg, TokenizeRequest | DetokenizeRequest):
                self._send(identity, tokens_reply(self.engine, msg))
            else:
                self.engine.submit(identity, msg)

    def _send_stats(self, identity: Any) -> None:
        try:
            stats: Any = self._stats.snapshot(self.counters)
        except Exception as exc:  # noqa: BLE001 - a figure must never stop the service
            log.exception("could not gather the service's stats")
            stats = Error("internal", f"stats failed: {type(exc).__name__}: {exc}",
                          ServiceStatsRequest.TYPE)
        self._send(identity, stats)

    def _send(self, identity: Any, msg: Any) -> None:
        if identity in self._gone:
            return
        try:
            self._sock.send_multipart([identity, *to_frames(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # gone (EHOSTUNREACH) or not reading (EAGAIN)
            self._receive_all()  # first what it said before it went (Ctrl-C: a cancel)
            self._gone.add(identity)
            cancelled = self.engine.cancel_client(identity)
            self._unreachable += cancelled > 0  # (not one whose last answer could not go)
            log.info("client %r unreachable (%s): %d generation(s) cancelled", identity, exc,
                     cancelled)
