"""Prometheus metrics of ``zctl serve``, in the text format, with vLLM's names where a
metric means what one of vLLM's means.

Request figures (time to first token, inter-token latency, end-to-end latency, tokens,
finished requests) are measured here, as the HTTP clients see them, and so is the server's
own queue (requests in flight, and the ``--max-queue`` beyond which it answers 429). The
cluster's figures (requests running and waiting, nodes up, KV slots per stage, per-stage
compute and per-hop network histograms, bytes per hop, speculative tokens) come from the
generation service's ``ServiceStats`` at scrape time and are exported as they are,
through ``ClusterCollector``; so is the running placement's predicted tok/s, which the
coordinator's status makes (controlplane/planner/running.py), beside the decode tok/s
measured of the last finished generation and the aggregate measured at each number of
streams decoding together (zctl.engine.decode_rates).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from zctl.engine.requests import GenerationDone
from zctl.service.messages import HistogramSnapshot, ServiceStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# how a generation ended, as vLLM's ``finished_reason`` and OpenAI's ``finish_reason`` say it
FINISH_REASONS = {"eos": "stop", "stop": "stop", "max_tokens": "length"}
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
               0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def finish_reason(done: GenerationDone) -> str:
    """"stop" or "length": how ``done`` ended, as the metrics and OpenAI's replies say it."""
    return FINISH_REASONS.get(done.stop_reason, "stop")


def histogram_family(name: str, doc: str, label: str,
                     snapshots: dict[str, HistogramSnapshot]) -> HistogramMetricFamily:
    """A Prometheus histogram (seconds) from cumulative millisecond bucket counts."""
    family = HistogramMetricFamily(name, doc, labels=[label])
    for value, snap in snapshots.items():
        running, buckets = 0, []
        for bound, count in zip([*snap.bounds, float("inf")], snap.counts, strict=True):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound / 1e3), running))
        family.add_metric([value], buckets, snap.total / 1e3)
    return family


def cluster_metrics(stats: ServiceStats, model: str) -> list[Metric]:
    """The cluster's figures in one ServiceStats, as metric families."""
    running = GaugeMetricFamily("vllm:num_requests_running", "Requests generating now",
                                labels=["model_name"])
    running.add_metric([model], stats.running)
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting for a stream",
                                labels=["model_name"])
    waiting.add_metric([model], stats.waiting)
    drafted = CounterMetricFamily("vllm:spec_decode_num_draft_tokens", "Speculative tokens "
                                  "drafted", labels=["model_name"])
    drafted.add_metric([model], stats.counters.get("spec_drafted", 0))
    accepted = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens", "Speculative "
                                   "tokens accepted", labels=["model_name"])
    accepted.add_metric([model], stats.counters.get("spec_accepted", 0))
    prefix = [CounterMetricFamily(name, doc, labels=["model_name"]) for name, doc in (
        ("vllm:prefix_cache_queries", "Prompts looked up in the prefix cache"),
        ("vllm:prefix_cache_hits", "Prompts whose start was found in the prefix cache"),
        ("zctl_prefix_cache_tokens_saved", "Prompt tokens not prefilled: their KV was cached"),
        ("zctl_prefix_cache_evictions", "Cached prefixes evicted (budget, or room for streams)"))]
    for family, key in zip(prefix, ("prefix_lookups", "prefix_hits", "prefix_tokens_saved",
                                    "prefix_evictions"), strict=True):
        family.add_metric([model], stats.counters.get(key, 0))
    structured = [CounterMetricFamily(name, doc, labels=["model_name"]) for name, doc in (
        ("zctl_structured_requests", "Generations held to a grammar (a JSON Schema, regex, "
                                     "grammar, choices or a tool call)"),
        ("zctl_forced_tokens", "Tokens a grammar forced, fed without a step of their own "
                               "(jump-forward)"))]
    for family, key in zip(structured, ("structured_requests", "forced_tokens"), strict=True):
        family.add_metric([model], stats.counters.get(key, 0))
    cached = GaugeMetricFamily("zctl_prefix_cache_tokens", "Tokens of KV held as cached "
                               "prefixes on each stage", labels=["model_name"])
    cached.add_metric([model], stats.counters.get("prefix_cached_tokens", 0))
    node_up = GaugeMetricFamily("zctl_node_up", "1 while the node is alive", labels=["node"])
    for node, up in sorted(stats.nodes.items()):
        node_up.add_metric([node], float(up))
    kv = GaugeMetricFamily("zctl_stage_kv_slots", "KV slots held on the stage (all its "
                           "streams)", labels=["stage", "node"])
    stage_up = GaugeMetricFamily("zctl_stage_up", "1 while the stage's node serves it",
                                 labels=["stage", "node"])
    for stage in stats.stages:
        labels = [str(stage.index), stage.node_id]
        stage_up.add_metric(labels, float(stage.up))
        if stage.kv_slots >= 0:
            kv.add_metric(labels, stage.kv_slots)
    hop_bytes = CounterMetricFamily("zctl_hop_bytes", "Bytes of the frames the hop carried",
                                    labels=["hop"])
    for hop in stats.hops:
        hop_bytes.add_metric([hop.name], hop.bytes)
    compute = histogram_family("zctl_stage_compute_seconds", "Compute time of a step on the "
                               "stage", "stage",
                               {str(s.index): s.compute_ms for s in stats.stages})
    network = histogram_family("zctl_hop_network_seconds", "Network time of a step's frame "
                               "on the hop", "hop", {h.name: h.network_ms for h in stats.hops})
    return [running, waiting, drafted, accepted, *prefix, cached, *structured, node_up, stage_up, kv,
            hop_bytes, compute, network, predicted_metric(stats, model),
            measured_aggregate_metric(stats, model)]


def predicted_metric(stats: ServiceStats, model: str) -> GaugeMetricFamily:
    """The running placement's predicted aggregate decode tok/s at each stream count (no
    sample while there is no prediction: a profile or a link not measured yet)."""
    family = GaugeMetricFamily("zctl_predicted_tok_s", "Predicted decode tok/s of the running "
                               "placement with this many streams, all of them together (the "
                               "planner's model of time on the nodes' profiles and links)",
                               labels=["model_name", "streams"])
    prediction = stats.prediction
    if prediction is not None and not prediction.error:
        for entry in prediction.streams:
            family.add_metric([model, str(entry.streams)], entry.tok_s)
    return family


def measured_aggregate_metric(stats: ServiceStats, model: str) -> GaugeMetricFamily:
    """The aggregate decode tok/s measured on the running placement at each number of
    streams decoding together, beside ``zctl_predicted_tok_s`` (a stream count appears once
    a second of decoding was spent at it)."""
    family = GaugeMetricFamily("zctl_measured_aggregate_tok_s", "Decode tok/s of all the "
                               "streams together, measured while this many decoded, since the "
                               "running placement began", labels=["model_name", "streams"])
    for rate in stats.decode_rates:
        family.add_metric([model, str(rate.streams)], rate.tok_s)
    return family


class ClusterCollector:
    """Exports the latest ServiceStats (set before each scrape) as it is."""

    def __init__(self) -> None:
        self.stats: ServiceStats | None = None
        self.model = ""

    def collect(self) -> Iterator[Metric]:
        if self.stats is not None:
            yield from cluster_metrics(self.stats, self.model)


class ServeMetrics:
    """The server's registry: request figures observed here plus the cluster's."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens",
                             labels, buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, end to "
                             "end", labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", labels,
                                         registry=self.registry)
        self.finished = Counter("vllm:request_success", "Requests finished",
                                [*labels, "finished_reason"], registry=self.registry)
        self.errors = Counter("zctl_api_errors", "Requests answered with an error",
                              ["status"], registry=self.registry)
        self.in_flight = Gauge("zctl_api_requests_in_flight", "Requests the server holds now "
                               "(running or waiting); beyond zctl_api_max_queue it answers 429",
                               registry=self.registry)
        self.max_queue = Gauge("zctl_api_max_queue", "Requests in flight beyond which new ones "
                               "get 429 (--max-queue)", registry=self.registry)
        self.measured_tok_s = Gauge("zctl_measured_tok_s", "Decode tok/s of the last finished "
                                    "generation (its tokens after the first over the time they "
                                    "took, as the engine measured them)", labels,
                                    registry=self.registry)
        self.cluster = ClusterCollector()
        self.registry.register(self.cluster)  # type: ignore[arg-type]

    def render(self, stats: ServiceStats | None, model: str, in_flight: int = 0,
               max_queue: int = 0) -> bytes:
        """The text format: the request figures, the server's queue (``in_flight`` of
        ``max_queue``) and the cluster's ``stats`` (none: the service did not answer)."""
        self.cluster.stats, self.cluster.model = stats, model
        self.in_flight.set(in_flight)
        self.max_queue.set(max_queue)
        return generate_latest(self.registry)


class RequestClock:
    """Feeds one request's latencies into the metrics as its tokens arrive."""

    def __init__(self, metrics: ServeMetrics, model: str, start: float,
                 counts_prompt: bool = True) -> None:
        """``counts_prompt``: False for a request's second and later choices (``n``), whose
        prompt is the first's."""
        self.metrics, self.model = metrics, model
        self.start = self.last = start
        self.first = True
        self.counts_prompt = counts_prompt

    def tokens(self, count: int, now: float) -> None:
        if count <= 0:
            return
        if self.first:
            self.metrics.ttft.labels(self.model).observe(now - self.start)
            self.first, count = False, count - 1
        if count:  # several tokens in one reply (speculation): the gap is theirs to share
            gap = (now - self.last) / count
            for _ in range(count):
                self.metrics.itl.labels(self.model).observe(gap)
        self.last = now

    def done(self, done: GenerationDone, now: float) -> None:
        """A generation that ended well (``done``): its latency, tokens, reason and speed."""
        m = self.metrics
        m.e2e.labels(self.model).observe(now - self.start)
        if self.counts_prompt:
            m.prompt_tokens.labels(self.model).inc(done.prompt_tokens)
        m.generation_tokens.labels(self.model).inc(len(done.tokens))
        m.finished.labels(self.model, finish_reason(done)).inc()
        if done.tok_s > 0:
            m.measured_tok_s.labels(self.model).set(done.tok_s)
