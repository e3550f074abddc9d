"""INT8 in symmetric i8 groups: the group each MatMul gets, the form NNCF writes (which
fails here if a new NNCF changes it), the NNCF version check, and what exports record."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from openvino import opset13 as ops

from dataplane.runtime.ov_core import shared_core
from exporter import int8_groups
from exporter.export import ExportError, export_model
from exporter.int8_groups import (
    CHECKED_NNCF_VERSIONS,
    UncheckedNncfError,
    check_nncf_version,
    compress_int8_groups,
)
from exporter.sources import open_source
from zctl.manifest import load_manifest
from zctl.weights import INT8_CHANNELS, INT8_GROUPS, int8_group

# (in, out) of a chain of MatMuls: groups of 128, 64, 32, and none (40: per channel)
CHAIN = ((256, 192), (192, 96), (96, 40), (40, 256))
VOCAB = 50


@pytest.mark.parametrize(("k", "group"), [(4096, 128), (2048, 128), (576, 64), (2880, 64),
                                          (192, 64), (96, 32), (1440, 32), (40, None),
                                          (1, None)])
def test_the_group_is_the_largest_of_128_64_32_dividing_the_inputs(k: int, group: int | None
                                                                    ) -> None:
    assert int8_group(k) == group


def test_a_matmul_without_inputs_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one input"):
        int8_group(0)


def test_an_unchecked_nncf_is_refused_by_name() -> None:
    assert check_nncf_version() in CHECKED_NNCF_VERSIONS  # the pinned one installed here
    with pytest.raises(UncheckedNncfError, match=r"nncf 3\.5\.0.*nncf==3\.4\.0"):
        check_nncf_version("3.5.0")


def _chain_model(rng: np.random.Generator) -> tuple[ov.Model, dict[str, np.ndarray]]:
    """An embedding (Gather over [VOCAB, 256]) and CHAIN's MatMuls, float32 weights."""
    weights = {"embed": rng.standard_normal((VOCAB, CHAIN[0][0])).astype(np.float32)}
    x = ops.parameter([1, CHAIN[0][0]], np.float32, name="x")
    ids = ops.parameter([1], np.int64, name="ids")
    h = ops.add(x, ops.gather(ops.constant(weights["embed"], name="embed"), ids, 0))
    for i, (k, n) in enumerate(CHAIN):
        weights[f"w{i}"] = rng.standard_normal((n, k)).astype(np.float32)
        h = ops.matmul(h, ops.constant(weights[f"w{i}"], name=f"w{i}"), False, True)
    return ov.Model([h], [x, ids]), weights


def _only_consumer(output: ov.Output) -> ov.Node:
    targets = list(output.get_target_inputs())
    assert len(targets) == 1, [t.get_node().get_type_name() for t in targets]
    return targets[0].get_node()


def _decompressed(codes: ov.Node) -> tuple[np.ndarray, int]:
    """The weight NNCF's i8 group form stands for, checked node by node: i8 [N, K/g, g]
    -> Convert f16 -> Multiply by f16 scales [N, K/g, 1] -> Reshape [N, K] -> Convert f32;
    and its group g."""
    rows, groups, group = codes.get_output_shape(0)
    convert = _only_consumer(codes.output(0))
    assert convert.get_type_name() == "Convert"
    assert convert.get_output_element_type(0) == ov.Type.f16
    multiply = _only_consumer(convert.output(0))
    assert multiply.get_type_name() == "Multiply"
    scale_node = next(i.get_source_output().get_node() for i in multiply.inputs()
                      if i.get_source_output().get_node() is not convert)
    assert scale_node.get_type_name() == "Constant"
    assert scale_node.get_output_element_type(0) == ov.Type.f16
    assert list(scale_node.get_output_shape(0)) == [rows, groups, 1]
    reshape = _only_consumer(multiply.output(0))
    assert reshape.get_type_name() == "Reshape"
    assert list(reshape.get_output_shape(0)) == [rows, groups * group]
    scales = scale_node.get_data().astype(np.float32)
    values = codes.get_data().astype(np.float32) * scales
    return values.reshape(rows, groups * group), group


def test_nncf_writes_i8_groups_of_each_matmul_and_the_embedding() -> None:
    """The form the CPU plugin runs and the measurements were taken in: a new NNCF that
    writes another (or picks other groups) fails here."""
    model, weights = _chain_model(np.random.default_rng(0))
    compressed = compress_int8_groups(model)
    constants = {op.get_friendly_name(): op for op in compressed.get_ops()
                 if op.get_type_name() == "Constant"}
    for name, weight in weights.items():
        codes = constants[name]
        k = weight.shape[1]
        if int8_group(k) is None:  # per output channel, u8 with a zero point, as before
            assert codes.get_output_element_type(0) == ov.Type.u8
            assert list(codes.get_output_shape(0)) == list(weight.shape)
            continue
        assert codes.get_output_element_type(0) == ov.Type.i8, name
        values, group = _decompressed(codes)
        assert group == int8_group(k), name
        # symmetric, codes -128..127 and a scale per group of about its largest magnitude
        # over 128: each weight within a step of that (the largest clipped to 127)
        step = np.abs(weight).reshape(weight.shape[0], -1, group).max(axis=2) / 127
        error = np.abs(values - weight).reshape(step.shape[0], -1, group)
        assert (error <= step[..., None] * 1.02).all(), name


def test_i8_groups_compile_and_compute_the_float_model_closely() -> None:
    model, _ = _chain_model(np.random.default_rng(1))
    reference = shared_core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    compressed = shared_core().compile_model(compress_int8_groups(model.clone()), "CPU",
                                         {"INFERENCE_PRECISION_HINT": "f32",
                                          "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"})
    x = np.random.default_rng(2).standard_normal((1, CHAIN[0][0])).astype(np.float32)
    ids = np.array([7])
    want = reference([x, ids])[0]
    got = compressed([x, ids])[0]
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
    assert not np.array_equal(got, want)  # compressed, not left in float


def _weight_types(export_dir: Path) -> dict[str, tuple[str, int]]:
    """Each compressed weight Constant's (element type, rank) over an export's stages."""
    found = {}
    for stage in load_manifest(export_dir).stages:
        for op in shared_core().read_model(export_dir / stage.xml).get_ops():
            name = op.get_friendly_name()
            if op.get_type_name() == "Constant" and name.endswith(".weight"):
                found[f"{stage.index}:{name}"] = (op.get_output_element_type(0).get_type_name(),
                                                  len(op.get_output_shape(0)))
    return found


@pytest.mark.slow
def test_an_int8_export_is_in_i8_groups_and_says_so(tiny_exports) -> None:
    export_dir = tiny_exports.get([(0, 2), (2, 4)], "int8")
    assert load_manifest(export_dir).int8_form == INT8_GROUPS
    kinds = _weight_types(export_dir)
    assert any("embed" in name for name in kinds) and any("lm_head" in name for name in kinds)
    assert set(kinds.values()) == {("i8", 3)}, "every MatMul, the embedding and the head"


@pytest.mark.slow
def test_static_and_int4_exports_keep_int8_per_channel(tiny_exports) -> None:
    static = tiny_exports.get([(0, 2), (2, 4)], "int8", static=(160, 8))
    assert load_manifest(static).int8_form == INT8_CHANNELS
    assert set(_weight_types(static).values()) == {("u8", 2)}
    int4 = tiny_exports.get([(0, 2), (2, 4)], "int4")
    assert load_manifest(int4).int8_form == INT8_CHANNELS
    fp32 = tiny_exports.get([(0, 2), (2, 4)])
    assert load_manifest(fp32).int8_form is None


def test_an_int8_export_with_an_unchecked_nncf_is_refused_and_writes_nothing(
        tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8_groups, "CHECKED_NNCF_VERSIONS", ("0.0.1",))
    with pytest.raises(ExportError, match="nncf==0.0.1"):
        export_model(open_source(str(tiny_llama_dir)), [(0, 4)], "int8", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
