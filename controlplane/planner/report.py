"""A plan as plain data (JSON): what ``zctl plan --json`` prints."""

from __future__ import annotations

from typing import Any

from controlplane.planner.search import LeftOut, Placement, Plan
from zctl.manifest import layer_spec


def placement_dict(placement: Placement) -> dict[str, Any]:
    streams = placement.streams
    return {
        "nodes": list(placement.nodes),
        "stages": [{"node": s.node, "layers": [s.start, s.end], "memory_used": s.memory_used,
                    "memory_free": s.memory_free, "step_ms": s.step_s * 1e3,
                    "hop_ms": s.hop_s * 1e3} for s in placement.stages],
        "export_layers": layer_spec(placement.ranges()),  # zctl export --layers
        "tok_s": placement.tok_s,
        "ms_per_token": 1e3 / placement.tok_s,
        "streams": {"streams": streams.streams, "tok_s": streams.tok_s,
                    "row_groups": streams.groups, "rows": streams.rows},
        "ttft_s": placement.first_token.seconds,
        "prefill_chunk": placement.first_token.chunk,
        "score": placement.score,
    }


def left_out_dict(left: LeftOut) -> dict[str, Any]:
    return {"node": left.node, "reason": left.reason, "with_tok_s": left.with_tok_s}


def plan_dict(result: Plan) -> dict[str, Any]:
    """Every placement, best first (``layers`` are [start, end)), and who is left out."""
    return {
        "model": result.shape.name,
        "weights": result.weights,
        "objective": result.objective,
        "streams": result.streams,
        "exact": result.exact,
        "placements": [placement_dict(p) for p in result.placements],
        "left_out": [left_out_dict(o) for o in result.left_out],
    }
