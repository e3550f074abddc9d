"""A synthetic stage built from a shape: the exporter's graph with random weights in each
format, run by the paged and stateful runners as an exported stage is."""

from __future__ import annotations

import numpy as np
import openvino as ov
import pytest

from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.load import load_runner
from dataplane.runtime.ov_core import shared_core
from dataplane.runtime.synthetic import LayerShape, synthetic_manifest, synthetic_model
from zctl.manifest import load_manifest
from zctl.weights import INT8_CHANNELS, INT8_GROUPS

TINY = LayerShape(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=384)


def _constant_types(model: ov.Model) -> set[str]:
    return {op.get_output_element_type(0).get_type_name() for op in model.get_ops()
            if op.get_type_name() == "Constant" and op.get_friendly_name().endswith("weight")}


@pytest.mark.parametrize(("weights", "int8_form", "types"), [
    ("int4", None, {"u4", "u8"}), ("int8", None, {"i8"}), ("int8", INT8_CHANNELS, {"u8"}),
    ("fp16", None, {"f16"}), ("fp32", None, {"f32"})])
def test_weights_are_compressed_as_the_exporter_compresses_them(
        weights: str, int8_form: str | None, types: set[str]) -> None:
    model = synthetic_model(TINY, 2, True, weights, 64 if weights == "int4" else None,
                            int8_form=int8_form)
    assert _constant_types(model) == types  # INT4 layers keep an INT8 head (per channel)
    names = {op.get_type_name() for op in model.get_ops()}
    assert {"ReadValue", "Assign", "ScaledDotProductAttention"} <= names
    assert {p.get_any_name() for p in model.inputs} >= {"hidden_states", "logits_idx", "beam_idx"}


def _codes(model: ov.Model) -> dict[str, tuple[str, list[int]]]:
    return {op.get_friendly_name(): (op.get_output_element_type(0).get_type_name(),
                                     list(op.get_output_shape(0)))
            for op in model.get_ops()
            if op.get_type_name() == "Constant" and op.get_friendly_name().endswith("weight")}


def test_int8_takes_the_exporters_i8_group_of_each_matmul() -> None:
    """Groups of 128 (Q/K/V, gate/up: 256 inputs), 64 (O: 192) and per channel where none
    divides (down: 200 inputs), as exporter/int8_groups.py compresses an export."""
    shape = LayerShape(hidden=256, intermediate=200, heads=3, kv_heads=1, head_dim=64,
                       vocab=96)
    model = synthetic_model(shape, 1, True, "int8")
    codes = _codes(model)
    assert codes["self.layers.0.qkv_proj.weight"] == ("i8", [320, 2, 128])
    assert codes["self.layers.0.o_proj.weight"] == ("i8", [256, 3, 64])
    assert codes["self.layers.0.gate_up_proj.weight"] == ("i8", [400, 2, 128])
    assert codes["self.layers.0.down_proj.weight"] == ("u8", [256, 200])
    assert codes["lm_head.weight"] == ("i8", [96, 2, 128])
    scales = {op.get_friendly_name(): list(op.get_output_shape(0)) for op in model.get_ops()
              if op.get_friendly_name().endswith("/scale")}
    assert scales["self.layers.0.o_proj.weight/scale"] == [256, 3, 1]
    assert scales["self.layers.0.down_proj.weight/scale"] == [256, 1]
    assert synthetic_manifest(shape, 1, True, "int8").int8_form == INT8_GROUPS
    assert synthetic_manifest(shape, 1, True, "int8", None, INT8_CHANNELS).int8_form == \
        INT8_CHANNELS


def _compressed_matmuls(model: ov.Model) -> list[tuple]:
    """The compiled model's FullyConnected nodes (the CPU plugin's compressed MatMul), each
    as the element types and shapes of its weight inputs (codes, scales, zero points)."""
    compiled = shared_core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    found = []
    for op in compiled.get_runtime_model().get_ops():
        if op.get_rt_info()["layerType"].astype(str) != "FullyConnected":
            continue
        found.append(tuple((str(i.get_element_type()), str(i.get_partial_shape()))
                           for i in op.inputs()[1:]))
    return sorted(found)


def _weight_bytes(model: ov.Model) -> dict[str, int]:
    """Bytes of the model's compressed weights and their scales, by element type."""
    found: dict[str, int] = {}
    for op in model.get_ops():
        kind = op.get_output_element_type(0).get_type_name()
        if op.get_type_name() == "Constant" and kind in ("i8", "u8", "u4", "f16"):
            found[kind] = found.get(kind, 0) + op.get_byte_size()
    return found


@pytest.mark.slow
def test_an_int8_synthetic_stage_compiles_as_a_real_int8_export_does(tiny_exports) -> None:
    """The last stage of a tiny int8 export (2 layers and the head, the shape of TINY) and a
    synthetic one: the same compressed MatMuls once compiled, the same weight bytes."""
    export_dir = tiny_exports.get([(0, 2), (2, 4)], "int8")
    manifest = load_manifest(export_dir)
    assert manifest.int8_form == INT8_GROUPS
    real = shared_core().read_model(export_dir / manifest.stages[-1].xml)
    synthetic = synthetic_model(TINY, 2, True, "int8")
    assert len(_compressed_matmuls(real)) == 2 * 4 + 1
    assert _compressed_matmuls(synthetic) == _compressed_matmuls(real)
    assert _weight_bytes(synthetic) == _weight_bytes(real)
    per_channel = synthetic_model(TINY, 2, True, "int8", int8_form=INT8_CHANNELS)
    assert _compressed_matmuls(per_channel) != _compressed_matmuls(real)  # the test can fail


def test_a_layer_has_the_exporters_four_matmuls() -> None:
    """Q/K/V one MatMul, the output projection, gate/up one, down: as exporter/stage_module."""
    model = synthetic_model(TINY, 2, True, "int8")
    assert sum(op.get_type_name() == "MatMul" for op in model.get_ops()) == 2 * 4 + 1


@pytest.mark.parametrize(("paged", "weights"), [(True, "int4"), (False, "int4"),
                                               (True, "int8")])
def test_a_synthetic_stage_runs_as_an_exported_stage_runs(paged: bool, weights: str) -> None:
    group = 64 if weights == "int4" else None
    graph = synthetic_model(TINY, 3, True, weights, group)
    manifest = synthetic_manifest(TINY, 3, True, weights, group)
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
    with pytest.raises(ValueError, match="unknown INT8 form 'i4-groups'"):
        synthetic_model(TINY, 1, False, "int8", int8_form="i4-groups")
    with pytest.raises(ValueError, match="unknown weight format"):
        synthetic_model(TINY, 1, False, "int2")


MOE = LayerShape(hidden=64, intermediate=0, heads=4, kv_heads=2, head_dim=16, vocab=384,
                 experts=8, active_experts=2, expert_intermediate=32)


@pytest.mark.parametrize(("weights", "exact", "types"), [
    ("int4", False, {"u4"}), ("int8", False, {"i8"}), ("fp16", False, {"f16"}),
    ("int4", True, {"i8"})])
def test_a_mixture_of_experts_computes_its_routed_experts_as_an_export_does(
        weights: str, exact: bool, types: set[str]) -> None:
    """Its layers' experts stacked [experts, out, in] and compressed as an export's (exact:
    i8 codes in groups of 32, as exporter/exact_experts.py writes them, whatever the
    format), in the tiled form the CPU plugin turns into three GatherMatmuls a layer
    (tests/exporter/test_moe.py counts the same in a real export); run as a paged stage,
    rows routed to other experts in one step, never on a one-token graph (it would compute
    them all)."""
    group = 32 if weights == "int4" else None
    graph = synthetic_model(MOE, 2, True, weights, group, exact_experts=exact)
    experts = {(op.get_output_element_type(0).get_type_name(), op.get_output_shape(0)[-1])
               for op in graph.get_ops()
               if op.get_type_name() == "Constant" and ".moe." in op.get_friendly_name()
               and not op.get_friendly_name().endswith(("scale", "zero_point", "router.weight"))}
    assert {kind for kind, _ in experts} == types
    if exact:
        assert {width for _, width in experts} == {32}  # a scale per 32 inputs
    compiled = shared_core().compile_model(graph, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    kinds = [op.get_rt_info()["layerType"].astype(str)
             for op in compiled.get_runtime_model().get_ops()]
    assert kinds.count("GatherMatmul") == 3 * 2
    manifest = synthetic_manifest(MOE, 2, True, weights, group, exact_experts=exact)
    assert manifest.exact_experts is exact
    assert (manifest.model.experts, manifest.model.active_experts) == (8, 2)
    runner = load_runner("", 0, RuntimeSpec(paged_attention=True), manifest=manifest,
                         verify=False, graph=graph)
    assert runner.one_token is None
    rng = np.random.default_rng(0)
    for sid in (1, 2):
        runner.open_stream(sid)
        runner.step(sid, rng.standard_normal((1, 4, 64), np.float32), np.arange(4))
    runner.regroup(10, [1, 2])
    out = runner.step_rows(10, rng.standard_normal((2, 1, 64), np.float32), np.full((2, 1), 4))
    assert out.shape == (2, 1, 384) and np.isfinite(out).all()
