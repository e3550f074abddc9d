"""A synthetic stage built from a shape: the exporter's graph with random weights in each
format, run by the paged and stateful runners as an exported stage is."""

from __future__ import annotations

import numpy as np
import openvino as ov
import pytest

from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.load import load_runner
from dataplane.runtime.synthetic import LayerShape, synthetic_manifest, synthetic_model

TINY = LayerShape(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=384)


def _constant_types(model: ov.Model) -> set[str]:
    return {op.get_output_element_type(0).get_type_name() for op in model.get_ops()
            if op.get_type_name() == "Constant" and op.get_friendly_name().endswith("weight")}


@pytest.mark.parametrize(("weights", "types"), [
    ("int4", {"u4", "u8"}), ("int8", {"u8"}), ("fp16", {"f16"}), ("fp32", {"f32"})])
def test_weights_are_compressed_as_the_exporter_compresses_them(weights: str,
                                                                types: set[str]) -> None:
    model = synthetic_model(TINY, 2, True, weights, group_size=64 if weights == "int4" else None)
    assert _constant_types(model) == types  # INT4 layers keep an INT8 head
    names = {op.get_type_name() for op in model.get_ops()}
    assert {"ReadValue", "Assign", "ScaledDotProductAttention"} <= names
    assert {p.get_any_name() for p in model.inputs} >= {"hidden_states", "logits_idx", "beam_idx"}


def test_a_layer_has_the_exporters_four_matmuls() -> None:
    """Q/K/V one MatMul, the output projection, gate/up one, down: as exporter/stage_module."""
    model = synthetic_model(TINY, 2, True, "int8")
    assert sum(op.get_type_name() == "MatMul" for op in model.get_ops()) == 2 * 4 + 1


@pytest.mark.parametrize("paged", [True, False])
def test_a_synthetic_stage_runs_as_an_exported_stage_runs(paged: bool) -> None:
    graph = synthetic_model(TINY, 3, True, "int4", 64)
    manifest = synthetic_manifest(TINY, 3, True, "int4", 64)
    runner = load_runner("", 0, RuntimeSpec(paged_attention=paged), manifest=manifest,
                         verify=False, graph=graph)
    for sid in (1, 2):
        runner.open_stream(sid)
        out = runner.step(sid, np.zeros((1, 4, 64), np.float32), np.arange(4))
        assert out.shape == (1, 1, 384) and np.isfinite(out).all()
    runner.regroup(10, [1, 2])
    out = runner.step_rows(10, np.ones((2, 1, 64), np.float32), np.full((2, 1), 4))
    assert out.shape == (2, 1, 384) and np.isfinite(out).all()


def test_a_shape_a_stage_cannot_have_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        synthetic_model(TINY, 0, False, "int4", 64)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        synthetic_model(LayerShape(64, 128, 3, 2, 16, 384), 1, False, "fp32")
    with pytest.raises(ValueError, match="not a multiple of the INT4 group"):
        synthetic_model(LayerShape(48, 128, 3, 3, 16, 384), 1, False, "int4", 32)
    with pytest.raises(ValueError, match="unknown weight format"):
        synthetic_model(TINY, 1, False, "int2")
