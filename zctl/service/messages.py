"""The generation service's wire schema (client <-> coordinator): request, cancel, chunks,
done, the stats snapshot a metrics endpoint is built from, and tokenizing (a prompt's
token ids as a generation would see them, and ids back to text).

A generation's request, chunks and end are the engine's own dataclasses
(zctl.engine.requests), carried in the control plane's envelope under their type tags
(``generate_request``, ``generate_chunk``, ``generate_done``), a request checked as the
engine checks it; the service's other messages are defined here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from controlplane.checks import need
from controlplane.messages import Message, register, register_record
from controlplane.records import ClusterStatus, PredictionStatus
from zctl.engine.decode_rates import DecodeRate
from zctl.engine.requests import GenerationChunk, GenerationDone, GenerationRequest

MAX_DETOKENIZE = 1 << 20  # token ids one detokenize_request may carry

GenerationEvent = GenerationChunk | GenerationDone  # what a generation's stream carries


def check_generation(request: GenerationRequest, where: str = "generate_request") -> None:
    """Refuse a generation request the engine would refuse (MessageError, saying where)."""
    problem = request.problem()
    need(problem is None, f"{where}.{problem}")


# Client -> coordinator: generate for this prompt, streaming tokens back; coordinator ->
# client: newly generated tokens and text, then how the generation ended.
register_record("generate_request", GenerationRequest, check_generation)
register_record("generate_chunk", GenerationChunk)
register_record("generate_done", GenerationDone)


@register
@dataclass(frozen=True)
class GenerateCancel(Message):
    """Client -> coordinator: stop my generation ``request_id`` (it ends with the tokens it
    has, stop_reason "cancelled", and its KV slots are freed on every stage)."""

    TYPE: ClassVar[str] = "generate_cancel"
    request_id: str

    def check(self) -> None:
        need(0 < len(self.request_id) <= 64, "generate_cancel.request_id must be 1..64 chars")


@register
@dataclass(frozen=True)
class TokenizeRequest(Message):
    """Client -> generation service: the token ids ``generation`` would be prompted with
    (its messages through the chat template, or its prompt); nothing runs. Answered by a
    TokensReply with the generation's ``request_id``."""

    TYPE: ClassVar[str] = "tokenize_request"
    generation: GenerationRequest

    @property
    def request_id(self) -> str:
        return self.generation.request_id

    def check(self) -> None:
        check_generation(self.generation, "tokenize_request.generation")


@register
@dataclass(frozen=True)
class DetokenizeRequest(Message):
    """Client -> generation service: the text of these token ids (special tokens kept
    unless ``skip_special_tokens``).
    Answered by a TokensReply with the same ``request_id``."""

    TYPE: ClassVar[str] = "detokenize_request"
    request_id: str
    tokens: list[int]
    skip_special_tokens: bool = False  # True: the text a completion's reader sees

    def check(self) -> None:
        need(0 < len(self.request_id) <= 64, "detokenize_request.request_id must be 1..64 chars")
        need(len(self.tokens) <= MAX_DETOKENIZE,
             f"detokenize_request.tokens: at most {MAX_DETOKENIZE} ids")


@register
@dataclass(frozen=True)
class TokensReply(Message):
    """Generation service -> client: a tokenize_request's ids and each one's token string
    (``pieces``), or a detokenize_request's ``text``; ``error`` says why neither came (a
    chat template that refused the messages, an id outside the vocabulary)."""

    TYPE: ClassVar[str] = "tokens_reply"
    request_id: str
    tokens: list[int]
    pieces: list[str]
    text: str = ""
    error: str = ""


# -- stats: what the HTTP server's /metrics is built from ------------------------------
@dataclass(frozen=True)
class HistogramSnapshot:
    """A cumulative histogram (since the service started): what it counted since an
    earlier snapshot (``since``), and its quantiles (``quantile``)."""

    bounds: list[float]  # bucket upper bounds in ms, ascending (+Inf implicit)
    counts: list[int]  # len(bounds) + 1 per-bucket counts (NOT cumulative); last = +Inf
    total: float = 0.0  # sum of all observed values, ms

    def problem(self) -> str | None:
        if len(self.counts) != len(self.bounds) + 1:
            return f"has {len(self.counts)} counts for {len(self.bounds)} bounds (needs one more)"
        if any(a >= b for a, b in zip(self.bounds, self.bounds[1:], strict=False)):
            return "has bounds that are not strictly ascending"
        if any(c < 0 for c in self.counts):
            return "has a negative count"
        return None

    def since(self, before: HistogramSnapshot | None) -> HistogramSnapshot:
        """What this counted since ``before`` (this itself when there is no ``before``, its
        buckets differ, or it counts less: a histogram that started again)."""
        if before is None or before.bounds != self.bounds:
            return self
        counts = [a - b for a, b in zip(self.counts, before.counts, strict=True)]
        if any(c < 0 for c in counts):
            return self
        return HistogramSnapshot(self.bounds, counts, max(self.total - before.total, 0.0))

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1) of the values counted, interpolated linearly inside
        its bucket as Prometheus's ``histogram_quantile`` does (the +Inf bucket: its lower
        bound); None when it counted nothing."""
        total = sum(self.counts)
        if total == 0:
            return None
        rank = q * total
        seen = 0
        for i, count in enumerate(self.counts):
            if count and seen + count >= rank:
                if i == len(self.bounds):
                    return self.bounds[-1]
                low = self.bounds[i - 1] if i else 0.0
                return low + (self.bounds[i] - low) * (rank - seen) / count
            seen += count
        return self.bounds[-1]


@dataclass(frozen=True)
class StageStats:
    index: int  # stage index (0 = the coordinator's)
    node_id: str  # who runs it ("coordinator" for stage 0)
    up: bool  # the node is enrolled, alive and serving this stage
    kv_slots: int  # KV slots held on that stage now (all its streams and row groups), -1 unknown
    compute_ms: HistogramSnapshot  # per-step compute time on that stage


@dataclass(frozen=True)
class HopStats:
    name: str  # "0-1", "1-2", ..., "1-c" (last stage -> coordinator)
    bytes: int  # bytes of the frames that hop carried, cumulative
    network_ms: HistogramSnapshot  # per-step network time on that hop (HopTiming.network_ms)


@register
@dataclass(frozen=True)
class ServiceStatsRequest(Message):
    """Client -> generation service: send me a ServiceStats snapshot."""

    TYPE: ClassVar[str] = "service_stats_request"


@register
@dataclass(frozen=True)
class ServiceStats(Message):
    """Generation service -> client: running figures, for a metrics endpoint (see
    zctl.service.stats for where each comes from)."""

    TYPE: ClassVar[str] = "service_stats"
    running: int  # generations running
    waiting: int  # queued in the engine
    # the engine's counters (requests, failed, cancelled, peak_streams) + malformed +
    # "spec_drafted", "spec_accepted": speculative tokens proposed / accepted, cumulative
    # over finished and running generations
    counters: dict[str, int]
    stages: list[StageStats]
    hops: list[HopStats]
    nodes: dict[str, bool]  # every known node id -> up (alive), spares included
    health: str = ""  # "" while the pipeline serves, else why not (the engine's health callback)
    model: str = ""  # the export's model name (manifest.model.name)
    max_context: int = 0  # manifest.model.max_position_embeddings
    num_stages: int = 0
    # the coordinator's cluster status the snapshot was made with (None: no status)
    cluster: ClusterStatus | None = None
    # aggregate decode speed on the running executor by streams decoding together
    # (zctl.engine.decode_rates): the measured side of the prediction's N streams
    decode_rates: list[DecodeRate] = field(default_factory=list)

    @property
    def prediction(self) -> PredictionStatus | None:
        """The running placement's predicted speed, as the cluster status has it (None: no
        status)."""
        return self.cluster.prediction if self.cluster is not None else None

    def check(self) -> None:
        need(self.running >= 0 and self.waiting >= 0, "service_stats: negative running/waiting")
        for i, rate in enumerate(self.decode_rates):
            need(rate.streams >= 1 and rate.tokens >= 0 and rate.seconds > 0,
                 f"service_stats.decode_rates[{i}]: streams must be >= 1, tokens >= 0 and "
                 "seconds > 0")
        named = [(f"stages[{i}].compute_ms", s.compute_ms) for i, s in enumerate(self.stages)]
        named += [(f"hops[{i}].network_ms", h.network_ms) for i, h in enumerate(self.hops)]
        for name, histogram in named:
            problem = histogram.problem()
            need(problem is None, f"service_stats.{name} {problem}")
