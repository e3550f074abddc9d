"""The generation service's stats snapshot (``ServiceStats``): where each figure comes from.

- ``running``, ``waiting``, ``counters``: the engine, plus the service's malformed count;
  ``spec_drafted``/``spec_accepted`` are draft tokens proposed/accepted by finished and
  running generations (``GenerationEngine.token_counters``).
- Per-stage compute and per-hop network histograms, hop bytes: the executor's
  ``StepMetrics`` (dataplane.head.metrics), cumulative since the service started. A ClusterHead
  has them from its replies' timing records (every stage's compute, every hop's network
  time as dataplane.wire.timing derives it) and counts the bytes of hop 0-1 and of the last hop
  as they pass (middle hops: see ``StepMetrics``). A LocalChain has no frames: compute per
  stage is the wall time of each stage's inference, and there are no hops. When the
  coordinator re-wires, its new ClusterHead starts from zero: the old one's metrics are
  folded in at the next snapshot (one replaced again before that is lost).
- ``kv_slots``: the stages run here, read from the executor now; the others from their
  node's last heartbeat (at most about one heartbeat interval old); -1: unknown.
- Stage -> node, ``up``, ``nodes``: the coordinator's cluster status (``cluster``), in which
  the coordinator's own node is called "coordinator". A stage is up while its node serves
  it; a node while it is alive (enrolled and heartbeating, spares included). Without a
  cluster status (an in-process executor), the stages run here are "coordinator"'s, the
  others' node is "", and every stage is up while the pipeline serves.
- ``cluster``: the cluster status itself (its nodes' addresses, devices and memory, the
  stages' layers, refusals, counters and placement notes: the web page's cluster view),
  and with it ``prediction``, the running placement's predicted speed
  (controlplane/planner/running.py), as it is; None without a cluster status.
- ``decode_rates``: the engine's aggregate decode tok/s by streams decoding together, since
  the running executor began (zctl.engine.decode_rates).
- ``health``: the engine's health callback; "the pipeline is not wired yet" without an
  executor.
"""

from __future__ import annotations

from collections.abc import Callable

from controlplane.membership import ALIVE, SERVING
from controlplane.records import COORDINATOR, ClusterStatus
from dataplane.head.metrics import CumulativeHistogram, MeasuredExecutor, StepMetrics, hop_names
from zctl.engine.core import GenerationEngine
from zctl.manifest import ExportManifest
from zctl.service.messages import HistogramSnapshot, HopStats, ServiceStats, StageStats

NOT_WIRED = "the pipeline is not wired yet"
ClusterView = Callable[[], ClusterStatus | None]


def histogram_snapshot(histogram: CumulativeHistogram) -> HistogramSnapshot:
    return HistogramSnapshot(list(histogram.bounds), histogram.counts, histogram.total)


class StatsCollector:
    """Builds ``ServiceStats`` for a service's engine; call ``snapshot`` only from the thread
    that drives the executor (it folds the executor's queued samples in)."""

    def __init__(self, manifest: ExportManifest, engine: GenerationEngine,
                 get_executor: Callable[[], MeasuredExecutor | None],
                 cluster: ClusterView | None = None) -> None:
        self.engine, self.get_executor, self.cluster = engine, get_executor, cluster
        self.model = manifest.model.name
        self.max_context = manifest.model.max_position_embeddings
        self.num_stages = len(manifest.stages)
        self._retired = StepMetrics(self.num_stages, hops=False)  # of replaced executors
        self._current: StepMetrics | None = None

    def snapshot(self, counters: dict[str, int]) -> ServiceStats:
        executor = self.get_executor()
        metrics = self._metrics(executor)
        if executor is None:
            health = NOT_WIRED
        else:
            health = (self.engine.health() if self.engine.health is not None else None) or ""
        status = self.cluster() if self.cluster is not None else None
        kv_here = executor.kv_slots() if executor is not None else {}
        compute = metrics.compute + [CumulativeHistogram()
                                     for _ in range(self.num_stages - len(metrics.compute))]
        places = (self._places(status, kv_here) if status is not None
                  else [(COORDINATOR if i in kv_here else "", not health, kv_here.get(i, -1))
                        for i in range(self.num_stages)])
        stages = [StageStats(i, node, up, kv, histogram_snapshot(compute[i]))
                  for i, (node, up, kv) in enumerate(places)]
        hops = [HopStats(name, count, histogram_snapshot(histogram)) for name, count, histogram
                in zip(hop_names(len(metrics.network)), metrics.hop_bytes(), metrics.network,
                       strict=False)] if metrics.network else []
        nodes = ({n.name: n.state in ALIVE for n in status.nodes} if status is not None
                 else {COORDINATOR: True})
        return ServiceStats(self.engine.active, self.engine.waiting, dict(counters), stages,
                            hops, nodes, health, self.model, self.max_context, self.num_stages,
                            status, self.engine.decode_rates.rates())

    def _metrics(self, executor: MeasuredExecutor | None) -> StepMetrics:
        """Everything measured since the service started: the current executor's metrics
        (its queue folded in) plus those of the executors it replaced."""
        metrics = executor.metrics if executor is not None else None
        if metrics is not self._current:
            if self._current is not None:
                self._retired.absorb(self._current)
            self._current = metrics
        total = StepMetrics(self.num_stages, hops=False)
        total.absorb(self._retired)
        if metrics is not None:
            total.absorb(metrics)
        return total

    def _places(self, status: ClusterStatus, kv_here: dict[int, int]
                ) -> list[tuple[str, bool, int]]:
        """(node, up, KV slots) per stage from the cluster status."""
        nodes = {n.node_id: n for n in status.nodes}
        out = []
        for i in range(self.num_stages):
            stage = next((s for s in status.stages if s.index == i), None)
            node = nodes.get(stage.node_id) if stage is not None and stage.node_id else None
            if node is None:
                out.append(("", False, -1))
                continue
            kv = kv_here.get(i, -1) if node.local else node.kv_slots
            out.append((node.name, stage.state == SERVING, kv))
        return out
