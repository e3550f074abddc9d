"""The planner's memory model against the weight files of real (tiny) exports."""

from __future__ import annotations

import pytest

from controlplane.planner.export_shape import export_shape
from controlplane.planner.memory import embedding_bytes, layer_weight_bytes
from controlplane.planner.presets import PRESETS
from controlplane.planner.references import derive_profile, reference_speed
from zctl.manifest import load_manifest


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_stage_weights_match_a_real_exports_files_within_2_percent(tiny_exports,
                                                                    weights: str) -> None:
    """Each stage's .bin: its layers, and the embedding (stage 0) or LM head (the last), with
    INT8's scales counted (i8 groups of an int8 export; u8 per channel of an int4 export's
    embedding and head); leaving them out is 3% short here."""
    export_dir = tiny_exports.get([(0, 2), (2, 4)], weights)
    manifest = load_manifest(export_dir)
    shape = export_shape(manifest, export_dir)
    for stage in manifest.stages:
        estimate = (stage.num_layers * layer_weight_bytes(shape, weights, manifest.int8_form)
                    + embedding_bytes(shape, weights, manifest.int8_form))
        size = (export_dir / stage.bin).stat().st_size
        assert estimate == pytest.approx(size, rel=0.02), (stage.index, estimate, size)


@pytest.mark.parametrize("weights", ["int4", "int8", "fp16"])
def test_exact_experts_cost_an_i8_code_and_a_32nd_of_a_scale_in_every_format(
        weights: str) -> None:
    """gpt-oss-20b's 32 experts a layer (3 x 2880 x 2880 weights each) at 1 + 2/32 bytes,
    the rest of the layer as the format has it; a dense model has no experts to change."""
    shape = PRESETS["gpt-oss-20b"]
    experts = 32 * 3 * 2880 * 2880
    assert sum(shape.expert_weights_by_inputs().values()) == experts
    per_weight = {"int4": 0.5 + 2.5 / 64, "int8": 1 + 2 / 64, "fp16": 2.0}[weights]
    exact = layer_weight_bytes(shape, weights, exact_experts=True)
    assert exact - layer_weight_bytes(shape, weights) == pytest.approx(
        experts * (1 + 2 / 32 - per_weight))
    profile = derive_profile(reference_speed("desktop-ddr5"), shape, weights, 1 << 40,
                             exact_experts=True)
    plain = derive_profile(reference_speed("desktop-ddr5"), shape, weights, 1 << 40)
    assert (profile.layer_bytes > plain.layer_bytes) is (weights != "fp16")  # fp16: 2 bytes
    assert (profile.decode_s[0] > plain.decode_s[0]) is (weights != "fp16")  # read as such
    dense = PRESETS["llama-3.1-8b"]
    assert layer_weight_bytes(dense, "int4", exact_experts=True) == layer_weight_bytes(
        dense, "int4")
