"""The MLP's width read from a stage's IR: a gate projection's first dimension, or half a
fused gate-and-up projection's; a graph with neither is a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.planner.export_shape import _mlp_width
from controlplane.planner.shape import ShapeError


def _ir(tmp_path: Path, name: str, shape: str) -> Path:
    xml = tmp_path / "stage0.xml"
    xml.write_text(f'<net><layers><layer id="0" name="x" type="Parameter"/>'
                   f'<layer id="1" name="{name}" type="Const"><data shape="{shape}"/></layer>'
                   f'</layers></net>')
    return xml


@pytest.mark.parametrize("name, shape, width", [
    ("self.layers.0.mlp.gate_proj.weight", "1536, 9, 64", 1536),  # INT4 groups, separate
    ("self.layers.0.gate_up_proj.weight", "3072, 576", 1536),  # fused, as exported now
])
def test_the_mlp_width_comes_from_the_gate_or_half_the_fused_gate_and_up(
        tmp_path: Path, name: str, shape: str, width: int) -> None:
    assert _mlp_width(_ir(tmp_path, name, shape)) == width


def test_a_graph_without_a_gate_or_an_odd_fused_one_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ShapeError, match="no gate_proj.weight or gate_up_proj.weight"):
        _mlp_width(_ir(tmp_path, "self.layers.0.down_proj.weight", "576, 1536"))
    with pytest.raises(ShapeError, match="has shape '3071, 576'"):
        _mlp_width(_ir(tmp_path, "self.layers.0.gate_up_proj.weight", "3071, 576"))


def test_an_exports_sliding_layers_are_its_shapes(tmp_path: Path) -> None:
    """The manifest's sliding window and layers (a Gemma 3 or gpt-oss export) make the
    shape's, so the planner reserves a sliding layer's window of KV, not the context's."""
    from dataclasses import replace

    from controlplane.planner.export_shape import export_shape
    from dataplane.runtime.synthetic import LayerShape, synthetic_manifest

    manifest = synthetic_manifest(LayerShape(64, 128, 4, 2, 16, 384), 6, True, "fp32")
    stage = replace(manifest.stages[0], xml="stage0.xml")
    manifest = replace(manifest, stages=(stage,), model=replace(
        manifest.model, sliding_window=512, sliding_layers=(0, 1, 2, 3, 4)))
    _ir(tmp_path, "self.layers.0.gate_up_proj.weight", "256, 64")
    shape = export_shape(manifest, tmp_path)
    assert (shape.sliding_window, shape.sliding_layers, shape.intermediate) == (512, 5, 128)
    plain = export_shape(replace(manifest, model=replace(manifest.model, sliding_layers=())),
                         tmp_path)
    assert (plain.sliding_window, plain.sliding_layers) == (0, 0)
