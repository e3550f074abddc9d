"""Shard placement: which layers (or which exported stage) each node should hold.

Pure functions, no sockets. Memory comes first (a node must hold its weights, a
runtime overhead and a KV-cache reserve); measured speed, when every node has one,
decides how the layers are shared among nodes that have room. Any plan a node cannot
hold is a ``PlacementError`` naming the node, what it has and what it would need.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from controlplane.records import DeviceInfo
from zctl.manifest import ExportManifest, ManifestError, check_layer_cover
from zctl.weights import WEIGHT_FORMATS, embedding_bytes_per_weight

DEFAULT_HEADROOM = 0.9
RUNTIME_OVERHEAD = 1.2  # compiled-model buffers on top of a stage's weight files


class PlacementError(ValueError):
    """No placement fits; the text names the node and the shortfall."""


def layer_range(start: int, end: int) -> str:
    """Layers [start, end) as people count them: ``0-11`` (one layer: ``3``)."""
    return f"{start}-{end - 1}" if end - start > 1 else str(start)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class NodeCapacity:
    """What placement knows of a node: usable memory, measured speed, cached shard hashes."""

    node_id: str
    memory_bytes: int
    tok_s: float | None = None
    cached: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class LayerCost:
    """Memory a stage needs: weights per layer, embedding/head extras, KV reserve."""

    layer_bytes: int
    first_extra: int = 0
    last_extra: int = 0
    kv_bytes_per_layer: int = 0
    overhead: float = RUNTIME_OVERHEAD  # compiled-model buffers on top of the raw weights

    def stage_bytes(self, start: int, end: int, num_layers: int) -> int:
        weights = (end - start) * self.layer_bytes
        if start == 0:
            weights += self.first_extra
        if end == num_layers:
            weights += self.last_extra
        return int(weights * self.overhead) + (end - start) * self.kv_bytes_per_layer

    @classmethod
    def from_export(cls, manifest: ExportManifest, export_dir: Path | str, context: int = 4096,
                    kv_bytes_per_value: int = 2, overhead: float = RUNTIME_OVERHEAD,
                    sliding_tokens: int | None = None) -> LayerCost:
        """Estimate per-layer weight bytes from the export's .bin sizes; the KV reserve is
        ``context`` tokens a layer, a sliding layer's at most ``sliding_tokens`` (None: every
        layer keeps every token), averaged over the model's layers."""
        export_dir = Path(export_dir)
        try:
            sizes = [(export_dir / s.bin).stat().st_size for s in manifest.stages]
        except OSError as exc:
            raise PlacementError(f"cannot size the export's weight files: {exc}") from None
        stages, model = manifest.stages, manifest.model
        middle = [(sz, s.num_layers) for sz, s in zip(sizes, stages, strict=True)
                  if not s.first and not s.last]
        per_weight = (embedding_bytes_per_weight(manifest.weight_format, model.hidden_size,
                                                 manifest.int8_form)
                      if manifest.weight_format in WEIGHT_FORMATS else 2.0)
        embed = int(model.vocab_size * model.hidden_size * per_weight)
        if middle:
            layer = sum(sz for sz, _ in middle) / sum(n for _, n in middle)
            first = max(0, int(sizes[0] - stages[0].num_layers * layer))
            last = max(0, int(sizes[-1] - stages[-1].num_layers * layer))
        else:
            first = min(embed, sizes[0])
            last = min(embed, sizes[-1])
            if len(stages) == 1:
                first = last = min(embed, sizes[0] // 2)
            layer = max(1.0, (sum(sizes) - first - last) / model.num_layers)
        sliding = len(model.sliding_layers) if sliding_tokens is not None else 0
        tokens = ((model.num_layers - sliding) * context
                  + sliding * min(context, sliding_tokens or context)) / model.num_layers
        kv = int(2 * model.num_kv_heads * model.head_dim * kv_bytes_per_value * tokens)
        return cls(int(layer), first, last, kv, overhead)


@dataclass(frozen=True)
class StageNeed:
    """One exported stage as placement sees it."""

    index: int
    bytes: int
    shard_hash: str


def stage_needs(manifest: ExportManifest, export_dir: Path | str,
                cost: LayerCost) -> list[StageNeed]:
    """Memory each exported stage needs: its real .bin size with overhead and KV reserve."""
    export_dir = Path(export_dir)
    needs = []
    for spec in manifest.stages:
        size = (export_dir / spec.bin).stat().st_size + (export_dir / spec.xml).stat().st_size
        need = int(size * cost.overhead) + spec.num_layers * cost.kv_bytes_per_layer
        needs.append(StageNeed(spec.index, need, manifest.stage_hash(spec.index)))
    return needs


def node_memory(devices: Sequence[DeviceInfo], ram_free: int, device: str = "CPU",
                headroom: float = DEFAULT_HEADROOM) -> int:
    """Usable bytes for a stage on ``device``: GPU memory when the plugin reports it, else RAM."""
    base = device.split(":")[0]
    memory = ram_free
    if base.startswith("GPU"):
        for dev in devices:
            if dev.memory_bytes and (dev.name == base or (base == "GPU" and dev.name == "GPU.0")):
                memory = dev.memory_bytes
                break
    return int(memory * headroom)


# -- planning a new split ---------------------------------------------------------------
def _weights(nodes: Sequence[NodeCapacity]) -> list[float]:
    known = [n.tok_s for n in nodes if n.tok_s and n.tok_s > 0]
    if not known:
        return [1.0] * len(nodes)
    mean = sum(known) / len(known)
    return [n.tok_s if n.tok_s and n.tok_s > 0 else mean for n in nodes]


def _layer_caps(num_layers: int, nodes: Sequence[NodeCapacity], cost: LayerCost) -> list[int]:
    caps = []
    last = len(nodes) - 1
    per_layer = cost.layer_bytes * cost.overhead + cost.kv_bytes_per_layer
    for i, node in enumerate(nodes):
        extra = (cost.first_extra if i == 0 else 0) + (cost.last_extra if i == last else 0)
        room = node.memory_bytes - extra * cost.overhead
        cap = min(num_layers, math.floor(room / per_layer)) if room > 0 else 0
        if cap < 1:
            what = {0: " plus the embedding", last: " plus the LM head"}.get(i, "")
            if i == 0 and i == last:
                what = " plus embedding and LM head"
            need = extra * cost.overhead + per_layer
            raise PlacementError(
                f"node {node.node_id} has {fmt_bytes(node.memory_bytes)} usable but one layer"
                f"{what} needs about {fmt_bytes(need)}")
        caps.append(cap)
    return caps


def plan_layers(num_layers: int, nodes: Sequence[NodeCapacity],
                cost: LayerCost) -> list[tuple[int, int]]:
    """Cut [0, num_layers) into one contiguous range per node, in node order.

    Node 0 takes the embedding and the last node the LM head. Each node gets at most
    what its memory holds; within that, layers follow measured speed when known (so
    stages take about equally long), else they are shared evenly.
    """
    n = len(nodes)
    if n == 0:
        raise PlacementError("no nodes to place layers on")
    if n > num_layers:
        raise PlacementError(f"{n} nodes but only {num_layers} layers: every node needs one")
    caps = _layer_caps(num_layers, nodes, cost)
    if sum(caps) < num_layers:
        total_need = cost.stage_bytes(0, num_layers, num_layers)
        total_have = sum(node.memory_bytes for node in nodes)
        raise PlacementError(
            f"the {n} node(s) can hold {sum(caps)} of {num_layers} layers: about "
            f"{fmt_bytes(total_need)} is needed and {fmt_bytes(total_have)} is usable; "
            "add nodes or use a smaller weight format")
    weights = _weights(nodes)
    ideal = [0.0] * n
    free = set(range(n))
    remaining = float(num_layers)
    while free:
        total_w = sum(weights[i] for i in free)
        share = {i: remaining * weights[i] / total_w for i in free}
        over = [i for i in free if share[i] > caps[i]]
        if not over:
            for i in free:
                ideal[i] = share[i]
            break
        for i in over:
            ideal[i] = float(caps[i])
            remaining -= caps[i]
            free.discard(i)
    counts = [min(caps[i], max(1, math.floor(ideal[i] + 1e-9))) for i in range(n)]
    diff = num_layers - sum(counts)
    while diff > 0:
        i = max((i for i in range(n) if counts[i] < caps[i]), key=lambda i: ideal[i] - counts[i])
        counts[i] += 1
        diff -= 1
    while diff < 0:
        i = min((i for i in range(n) if counts[i] > 1), key=lambda i: ideal[i] - counts[i])
        counts[i] -= 1
        diff += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def check_ranges(ranges: Sequence[tuple[int, int]], num_layers: int,
                 nodes: Sequence[NodeCapacity], cost: LayerCost) -> None:
    """Validate explicit ranges (one per node, in order) against cover and memory."""
    try:
        check_layer_cover(list(ranges), num_layers)
    except ManifestError as exc:
        raise PlacementError(str(exc)) from None
    if len(ranges) != len(nodes):
        raise PlacementError(f"{len(ranges)} layer ranges given for {len(nodes)} nodes")
    for (start, end), node in zip(ranges, nodes, strict=True):
        need = cost.stage_bytes(start, end, num_layers)
        if need > node.memory_bytes:
            raise PlacementError(
                f"node {node.node_id} has {fmt_bytes(node.memory_bytes)} usable but layers "
                f"{start}-{end - 1} need about {fmt_bytes(need)}")


# -- placing an existing export ---------------------------------------------------------
def _feasible(needs: list[int], memories: list[int]) -> bool:
    """Whether distinct nodes can take all needs (threshold matching: sorted comparison)."""
    if len(memories) < len(needs):
        return False
    needs_desc = sorted(needs, reverse=True)
    mems_desc = sorted(memories, reverse=True)
    return all(m >= s for m, s in zip(mems_desc, needs_desc, strict=False))


def assign_stages(stages: Sequence[StageNeed], nodes: Sequence[NodeCapacity], *,
                  head: str | None = None,
                  explicit: Mapping[int, str] | None = None) -> dict[int, str]:
    """Map each exported stage to a distinct node; returns {stage index: node id}.

    ``head`` (the coordinator) always takes stage 0. ``explicit`` pins stages to nodes;
    the rest go to nodes that fit, preferring one that already caches the shard, then
    the faster, then the roomier, without making the remaining stages unplaceable.
    """
    by_id = {node.node_id: node for node in nodes}
    plan: dict[int, str] = {}
    pins = dict(explicit or {})
    if head is not None:
        if head not in by_id:
            raise PlacementError(f"the head node {head} is not among the nodes")
        if pins.get(0, head) != head:
            raise PlacementError(f"stage 0 runs on the coordinator ({head}), not {pins[0]}")
        pins[0] = head
    indices = {s.index for s in stages}
    for index, node_id in sorted(pins.items()):
        if index not in indices:
            raise PlacementError(f"stage {index} does not exist (the export has {len(stages)})")
        if node_id not in by_id:
            raise PlacementError(f"stage {index} is pinned to {node_id}, which is not enrolled")
        if node_id in plan.values():
            raise PlacementError(f"node {node_id} is given more than one stage")
        need = next(s for s in stages if s.index == index)
        node = by_id[node_id]
        if need.bytes > node.memory_bytes:
            raise PlacementError(
                f"node {node_id} has {fmt_bytes(node.memory_bytes)} usable but stage {index} "
                f"needs about {fmt_bytes(need.bytes)}")
        plan[index] = node_id
    todo = sorted((s for s in stages if s.index not in plan), key=lambda s: -s.bytes)
    free = [node for node in nodes if node.node_id not in plan.values()]
    if len(free) < len(todo):
        raise PlacementError(
            f"the export has {len(stages)} stages but only {len(nodes)} node(s) are available "
            f"for them; start {len(todo) - len(free)} more node(s) or re-export with fewer stages")
    for k, stage in enumerate(todo):
        rest = [s.bytes for s in todo[k + 1:]]
        fitting = [node for node in free if node.memory_bytes >= stage.bytes]
        if not fitting:
            best = max(free, key=lambda node: node.memory_bytes)
            raise PlacementError(
                f"stage {stage.index} needs about {fmt_bytes(stage.bytes)} but the roomiest free "
                f"node ({best.node_id}) has {fmt_bytes(best.memory_bytes)} usable")
        fitting.sort(key=lambda node: (stage.shard_hash in node.cached, node.tok_s or 0.0,
                                       node.memory_bytes), reverse=True)
        for node in fitting:
            others = [m.memory_bytes for m in free if m is not node]
            if _feasible(rest, others):
                plan[stage.index] = node.node_id
                free.remove(node)
                break
        else:
            raise PlacementError(
                f"stages {', '.join(str(s.index) for s in todo[k:])} do not fit on the free "
                f"nodes ({', '.join(f'{n.node_id}: {fmt_bytes(n.memory_bytes)}' for n in free)})")
    return plan


def assign_runs(stages: Sequence[StageNeed], nodes: Sequence[NodeCapacity], *,
                head: str, explicit: Mapping[int, str] | None = None) -> dict[int, str]:
    """Map each exported stage to a node, for as many nodes as there are: one stage each
    (``assign_stages``) when there are enough nodes or stages are pinned, else contiguous
    runs of stages (``assign_contiguous``), so that one PC, or fewer PCs than stages,
    serves at once; PlacementError when the stages do not fit the nodes' memory."""
    if len(nodes) >= len(stages) or explicit:
        return assign_stages(stages, nodes, head=head, explicit=explicit)
    return assign_contiguous(stages, nodes, head=head)


def assign_contiguous(stages: Sequence[StageNeed], nodes: Sequence[NodeCapacity], *,
                      head: str) -> dict[int, str]:
    """Cut the stages into contiguous runs, one per node at most: ``head`` (the
    coordinator) takes the first run, the others follow roomiest first. Of the cuts whose
    runs fit their nodes' memory, the one whose busiest node holds the fewest bytes wins
    (a node may get no run: it stays a spare). PlacementError naming what is needed and
    what the nodes have when none fits."""
    by_id = {node.node_id: node for node in nodes}
    if head not in by_id:
        raise PlacementError(f"the head node {head} is not among the nodes")
    order = [by_id[head], *sorted((n for n in nodes if n.node_id != head),
                                  key=lambda n: (-n.memory_bytes, n.node_id))]
    sizes = [s.bytes for s in sorted(stages, key=lambda s: s.index)]
    count = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[j][i]: (busiest node's bytes, the runs as (node, end) pairs) placing stages
    # [0, i) on order[:j + 1]
    inf: tuple[float, tuple[tuple[int, int], ...]] = (math.inf, ())
    best = [[inf] * (count + 1) for _ in order]
    for i in range(1, count + 1):  # the head's run: stages [0, i)
        if prefix[i] <= order[0].memory_bytes:
            best[0][i] = (prefix[i], ((0, i),))
    for j in range(1, len(order)):
        room = order[j].memory_bytes
        for i in range(1, count + 1):
            best[j][i] = best[j - 1][i]  # node j takes nothing
            for t in range(1, i):
                load = prefix[i] - prefix[t]
                if load > room or best[j - 1][t][0] == math.inf:
                    continue
                busiest = max(best[j - 1][t][0], load)
                if busiest < best[j][i][0]:
                    best[j][i] = (busiest, (*best[j - 1][t][1], (j, i)))
    busiest, runs = best[-1][count]
    if busiest == math.inf:
        raise PlacementError(_no_fit(sizes, order))
    plan: dict[int, str] = {}
    start = 0
    for j, end in runs:
        plan.update({s: order[j].node_id for s in range(start, end)})
        start = end
    return plan


def _no_fit(sizes: Sequence[int], nodes: Sequence[NodeCapacity]) -> str:
    biggest = max(range(len(sizes)), key=lambda i: sizes[i])
    roomiest = max(nodes, key=lambda n: n.memory_bytes)
    have = ", ".join(f"{n.node_id}: {fmt_bytes(n.memory_bytes)}" for n in nodes)
    if sizes[biggest] > roomiest.memory_bytes:
        return (f"stage {biggest} needs about {fmt_bytes(sizes[biggest])} but the roomiest node "
                f"({roomiest.node_id}) has {fmt_bytes(roomiest.memory_bytes)} usable; add a "
                "roomier node, or export with smaller weights or more stages")
    return (f"the export's {len(sizes)} stages need about {fmt_bytes(sum(sizes))} in all but "
            f"the {len(nodes)} node(s) have {have} usable; add nodes, or export with smaller "
            "weights")
