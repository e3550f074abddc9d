"""The cluster as people watch it, from the generation service's ``ServiceStats``: the
stages in order, each with its node (address, device, layers, memory, KV slots), the
per-stage compute and per-hop network latency (p50/p95) over a recent window, the
tokens per second, the requests running and waiting, the placement and its predicted
speed against the measured one. Pure: no sockets, no clock (the caller passes both
snapshots and the seconds between them).

``stage_rows`` is the one place a stage's node, layers and device are read from a cluster
status: ``zctl run``'s dashboard and the web page's cluster view both show them so. The
latency figures are read from the same cumulative histograms ``/metrics`` exports
(``ServiceStats``): their difference over the window and its quantiles
(``HistogramSnapshot.since`` and ``quantile``); a node is named by ``NodeStatus.name``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controlplane.membership import ALIVE
from controlplane.placement import layer_range
from controlplane.planner.running import NoPrediction, streams_prediction
from controlplane.records import ClusterStatus, NodeStatus, PredictionStatus
from dataplane.head.metrics import hop_names
from zctl.service.messages import HistogramSnapshot, ServiceStats

VIEW_VERSION = 1  # the JSON's "version": bumped when a field changes meaning


@dataclass(frozen=True)
class StageRow:
    """Where a stage runs: its node (the coordinator's own is "coordinator"), the node's
    host and data address, its first device, the stage's layers ("0-11"; one layer: "3"),
    the node's state and memory (bytes), and the KV slots the node last reported (-1:
    unknown)."""

    index: int
    node: str
    host: str
    address: str
    device: str
    layers: str
    state: str
    ram_free: int
    ram_total: int
    kv_slots: int


def stage_rows(status: ClusterStatus) -> list[StageRow]:
    """The stages in order, each with the node that runs it (blank fields: none does)."""
    nodes = {n.node_id: n for n in status.nodes}
    rows = []
    for stage in sorted(status.stages, key=lambda s: s.index):
        node = nodes.get(stage.node_id or "")
        layers = layer_range(stage.layer_start, stage.layer_end)  # as cluster status shows it
        if node is None:
            rows.append(StageRow(stage.index, "", "", "", "", layers, stage.state, 0, 0, -1))
            continue
        rows.append(StageRow(stage.index, node.name, node.host, node.data_addr,
                             node.devices[0].name if node.devices else "", layers,
                             stage.state, node.ram_free, node.ram_total, node.kv_slots))
    return rows


# -- latency over a window, from cumulative histograms ----------------------------------
def latency(histogram: HistogramSnapshot) -> dict[str, Any]:
    """p50, p95 (ms, None: nothing counted) and how many values they are of."""
    p50, p95 = histogram.quantile(0.5), histogram.quantile(0.95)
    return {"p50": None if p50 is None else round(p50, 3),
            "p95": None if p95 is None else round(p95, 3), "count": sum(histogram.counts)}


# -- the whole view ----------------------------------------------------------------------
def prediction_view(prediction: PredictionStatus | None, streams: int) -> dict[str, Any] | None:
    """The running placement's predicted speed for ``streams`` streams (at least one), and
    per node its step and the hop after it; None without a prediction made."""
    if prediction is None:
        return None
    try:
        tok_s: float | None = streams_prediction(prediction, max(streams, 1)).tok_s
        error = ""
    except NoPrediction as exc:
        tok_s, error = None, str(exc)
    return {"tok_s": None if tok_s is None else round(tok_s, 2), "streams": max(streams, 1),
            "error": error, "nodes": prediction.nodes,
            "stage_ms": [round(ms, 3) for ms in prediction.stage_ms],
            "hop_ms": [round(ms, 3) for ms in prediction.hop_ms]}


def node_view(node: NodeStatus) -> dict[str, Any]:
    return {"id": node.name, "host": node.host, "address": node.data_addr,
            "state": node.state, "alive": node.state in ALIVE, "stage": node.stage,
            "devices": [d.name for d in node.devices], "ram_free": node.ram_free,
            "ram_total": node.ram_total, "kv_slots": node.kv_slots,
            "last_seen_s": round(node.last_seen_s, 2)}


def cluster_view(now: ServiceStats, before: ServiceStats | None, seconds: float
                 ) -> dict[str, Any]:
    """The cluster view (JSON-ready, docs/web.md): ``now``'s state, with latency and tok/s
    over the ``seconds`` since ``before`` (since the service started without one)."""
    earlier_stages = {s.index: s for s in before.stages} if before is not None else {}
    earlier_hops = {h.name: h for h in before.hops} if before is not None else {}
    status = now.cluster
    rows = {r.index: r for r in stage_rows(status)} if status is not None else {}
    measured_hops = {h.name for h in now.hops}
    after = hop_names(len(now.stages)) if now.stages else []  # the hop after each stage
    stages = []
    for position, stage in enumerate(now.stages):
        row = rows.get(stage.index)
        earlier = earlier_stages.get(stage.index)
        stages.append({
            "index": stage.index, "node": stage.node_id, "up": stage.up,
            "kv_slots": stage.kv_slots,
            "host": row.host if row else "", "address": row.address if row else "",
            "device": row.device if row else "", "layers": row.layers if row else "",
            "state": row.state if row else ("serving" if stage.up else "down"),
            "ram_free": row.ram_free if row else 0, "ram_total": row.ram_total if row else 0,
            "hop": after[position] if after[position] in measured_hops else None,
            "compute_ms": latency(stage.compute_ms.since(
                earlier.compute_ms if earlier else None))})
    hops = []
    for hop in now.hops:
        earlier_hop = earlier_hops.get(hop.name)
        sent = hop.bytes - (earlier_hop.bytes if earlier_hop else 0)
        hops.append({"name": hop.name,
                     "network_ms": latency(hop.network_ms.since(
                         earlier_hop.network_ms if earlier_hop else None)),
                     "bytes_per_s": round(sent / seconds, 1) if seconds > 0 and sent >= 0
                     else None})
    generated = now.counters.get("generated_tokens", 0) - (
        before.counters.get("generated_tokens", 0) if before is not None else 0)
    tok_s = round(generated / seconds, 2) if before is not None and seconds > 0 \
        and generated >= 0 else None
    return {
        "version": VIEW_VERSION, "model": now.model, "health": now.health,
        "pipeline": status.pipeline if status is not None else
        ("serving" if not now.health else "down"),
        "epoch": status.epoch if status is not None else 0,
        "running": now.running, "waiting": now.waiting, "window_s": round(seconds, 3),
        "tok_s": tok_s, "stages": stages, "hops": hops,
        "nodes": [node_view(n) for n in sorted(
            status.nodes, key=lambda n: (n.stage is None, n.stage or 0, n.node_id))]
        if status is not None else [],
        "plan": {"placement": status.placement, "error": status.plan_error,
                 "left_out": dict(status.left_out)} if status is not None else None,
        "prediction": prediction_view(now.prediction, now.running),
        "counters": {k: now.counters.get(k, 0) for k in (
            "requests", "cancelled", "failed", "generated_tokens", "prefix_tokens_saved")},
    }
