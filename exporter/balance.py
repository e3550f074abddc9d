"""Stage balance: layer ranges whose stages take about equally long to compute.

Pure functions, no sockets and no OpenVINO. A pipeline of stages streams at the pace of
its slowest stage once several streams are in flight, so an even split of *layers* is
not an even split of *time*: the last stage also runs the final norm and the LM head,
which for a small-vocabulary-heavy model like SmolLM2 (49k x 576) costs as much as
several decoder layers. Costs here are in "decoder-layer equivalents": a stage with
``n`` layers costs ``n`` plus the head (last stage) or the embedding (first stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zctl.weights import decoder_layer_weights

# The LM head's cost per weight relative to a decoder layer's, on CPU with INT4 layers
# and an INT8 head (the export's default): measured with one core per stage, the head
# of SmolLM2-135M (8.0 layers' worth of weights) took 4.9-5.5 layers' time and that of
# a Llama-3.2-1B shape (4.3 layers' worth) took 2.3. Decode is not purely weight-bound:
# a small layer pays fixed per-op costs (norms, RoPE, attention) that the head does not.
HEAD_COST_PER_WEIGHT = 0.62


def head_cost_layers(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int,
                     head_dim: int, vocab: int) -> float:
    """Estimated cost of the final norm + LM head in decoder-layer equivalents."""
    layer = decoder_layer_weights(hidden, intermediate, num_heads, num_kv_heads, head_dim)
    return HEAD_COST_PER_WEIGHT * vocab * hidden / max(1, layer)


def stage_costs(ranges: Sequence[tuple[int, int]], num_layers: int, last_extra: float = 0.0,
                first_extra: float = 0.0) -> list[float]:
    """Cost of each stage of ``ranges`` in decoder-layer equivalents."""
    costs = []
    for start, end in ranges:
        cost = float(end - start)
        if start == 0:
            cost += first_extra
        if end == num_layers:
            cost += last_extra
        costs.append(cost)
    return costs


def balanced_split(num_layers: int, num_stages: int, last_extra: float = 0.0,
                   first_extra: float = 0.0,
                   speeds: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """Contiguous ranges, one per stage, minimising the slowest stage's time.

    A stage's time is its cost (layers plus the head or embedding extra) divided by its
    node's relative speed (``speeds``, default all equal). Every stage gets at least one
    layer. Ties go to the split closest to even, then to earlier stages taking more.
    """
    if num_stages < 1 or num_stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    if last_extra < 0 or first_extra < 0:
        raise ValueError("stage extras must be >= 0")
    speeds = list(speeds) if speeds is not None else [1.0] * num_stages
    if len(speeds) != num_stages or any(s <= 0 for s in speeds):
        raise ValueError(f"need {num_stages} positive speeds, got {speeds}")

    def stage_time(stage: int, start: int, end: int) -> float:
        cost = float(end - start)
        if stage == 0:
            cost += first_extra
        if stage == num_stages - 1:
            cost += last_extra
        return cost / speeds[stage]

    # best[s][e]: (slowest time, unevenness) of stages 0..s-1 covering layers [0, e).
    inf = (float("inf"), float("inf"))
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    even = num_layers / num_stages
    for s in range(1, num_stages + 1):
        for end in range(s, num_layers - (num_stages - s) + 1):
            for start in range(s - 1, end):
                prev = best[s - 1][start]
                if prev == inf:
                    continue
                t = stage_time(s - 1, start, end)
                cand = (round(max(prev[0], t), 9), prev[1] + abs(end - start - even))
                if cand <= best[s][end]:  # on a tie the later start: earlier stages take more
                    best[s][end] = cand
                    cut[s][end] = start
    ranges, end = [], num_layers
    for s in range(num_stages, 0, -1):
        start = cut[s][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]


def default_split(source: Any, stages: int) -> list[tuple[int, int]]:
    """The layer split ``--stages N`` means: stages of about equal compute.

    ``source`` is a model source (exporter.sources: ``num_layers``, ``decoder_shape()``).
    The last stage also runs the LM head, so it gets fewer layers (SmolLM2 in 2 stages:
    0-16 and 17-29).
    """
    shape = source.decoder_shape()
    head = head_cost_layers(shape.hidden_size, decode_mlp_width(shape, source.num_layers),
                            shape.num_heads, shape.num_kv_heads, shape.head_dim,
                            shape.vocab_size)
    return balanced_split(source.num_layers, stages, head)


def decode_mlp_width(shape: Any, num_layers: int) -> int:
    """The MLP width a decode step computes, on average over the layers: a dense layer's
    ``intermediate_size``; a mixture of experts' sparse layer (``sparse_layers``) its active
    experts' (``active_experts`` x ``expert_intermediate``), not all of them, nor the one
    expert gpt-oss's config calls its intermediate size."""
    if not shape.experts:
        return int(shape.intermediate_size)
    sparse = len(shape.sparse_layers) / max(1, num_layers)
    active = shape.active_experts * shape.expert_intermediate
    return round(sparse * active + (1.0 - sparse) * shape.intermediate_size)


def measured_head_cost(ranges: Sequence[tuple[int, int]], stage_ms: Sequence[float]) -> float:
    """The head's cost in layer equivalents, from measured per-stage compute times.

    Assumes the stages' nodes are equally fast (a local cluster, a uniform fleet): the
    per-layer time comes from the stages without the head, the head is what the last
    stage takes beyond its layers.
    """
    if len(ranges) != len(stage_ms) or len(ranges) < 2:
        raise ValueError("need the ranges and compute times of at least two stages")
    if any(ms <= 0 for ms in stage_ms):
        raise ValueError(f"compute times must be > 0, got {list(stage_ms)}")
    body_layers = sum(end - start for start, end in ranges[:-1])
    per_layer = sum(stage_ms[:-1]) / body_layers
    last_layers = ranges[-1][1] - ranges[-1][0]
    return max(0.0, stage_ms[-1] / per_layer - last_layers)


def rebalanced_split(ranges: Sequence[tuple[int, int]],
                     stage_ms: Sequence[float]) -> list[tuple[int, int]]:
    """The balanced split suggested by measured per-stage compute times of ``ranges``."""
    num_layers = ranges[-1][1]
    return balanced_split(num_layers, len(ranges), measured_head_cost(ranges, stage_ms))


def format_layers(ranges: Sequence[tuple[int, int]]) -> str:
    """Ranges as the ``--layers`` option spells them (inclusive): "0-17,18-29"."""
    return ",".join(f"{start}-{end - 1}" for start, end in ranges)


def suggest_layers(layers: Sequence[str], stage_ms: Sequence[float]) -> str | None:
    """``--layers`` for a re-export whose stages would take about equally long, or None.

    ``layers`` are the stages' inclusive ranges as shown ("0-14", "15-29"), ``stage_ms``
    their measured compute. None when there is nothing to suggest: one stage, missing
    times, or the split is already the balanced one. Assumes equally fast nodes.
    """
    if len(layers) < 2 or len(stage_ms) != len(layers) or any(ms <= 0 for ms in stage_ms):
        return None
    try:
        ranges = [(int(a), int(b) + 1) for a, b in (text.split("-") for text in layers)]
        suggested = rebalanced_split(ranges, stage_ms)
    except ValueError:
        return None
    return None if suggested == ranges else format_layers(suggested)
