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
