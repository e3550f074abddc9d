"""The shape of an exported model, from its manifest and one stage's graph.

The manifest names the layers, hidden size, heads, head size and vocabulary; the MLP's
width is read from the first ``gate_proj`` weight in a stage's IR (its first dimension, in
every weight format the exporter writes), or half of the first fused ``gate_up_proj``
weight's (the gate and up projections as one MatMul, as the exporter writes a layer now),
scanning the XML up to it, never the weights. A mixture of experts' manifest states its
experts, their number active and their width: its layers are read as all of them sparse.
"""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from pathlib import Path

from controlplane.planner.shape import ModelShape, ShapeError
from zctl.manifest import ExportManifest

GATE = "gate_proj.weight"
GATE_UP = "gate_up_proj.weight"  # gate and up stacked: twice the MLP's width


def _mlp_width(xml: Path) -> int:
    try:
        for _, element in ElementTree.iterparse(xml, events=("end",)):
            if element.tag != "layer":
                continue
            name = element.get("name", "")
            if element.get("type") == "Const" and name.endswith((GATE, GATE_UP)):
                data = element.find("data")
                shape = data.get("shape", "") if data is not None else ""
                first = shape.split(",")[0].strip()
                stacked = 2 if name.endswith(GATE_UP) else 1
                if first.isdigit() and int(first) > 0 and int(first) % stacked == 0:
                    return int(first) // stacked
                raise ShapeError(f"{xml}: {name} has shape {shape!r}")
            element.clear()
    except (OSError, ElementTree.ParseError) as exc:
        raise ShapeError(f"{xml}: cannot read the stage's graph: {exc}") from None
    raise ShapeError(f"{xml}: no {GATE} or {GATE_UP} weight in the stage's graph")


def export_shape(manifest: ExportManifest, export_dir: Path) -> ModelShape:
    """The shape of the model exported in ``export_dir`` (ShapeError saying why not)."""
    stage = next((s for s in manifest.stages if s.layer_end > s.layer_start), None)
    if stage is None:
        raise ShapeError(f"{export_dir}: no stage holds a decoder layer")
    spec = manifest.model
    return ModelShape(
        name=spec.name, num_layers=spec.num_layers, hidden=spec.hidden_size,
        # a mixture of experts: the manifest states its experts (a layer of them all)
        intermediate=0 if spec.experts else _mlp_width(export_dir / stage.xml),
        heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        vocab=spec.vocab_size, experts=spec.experts, active_experts=spec.active_experts,
        expert_intermediate=spec.expert_intermediate, architecture=spec.architecture,
        sliding_window=spec.sliding_window if spec.sliding_layers else 0,
        sliding_layers=len(spec.sliding_layers))
