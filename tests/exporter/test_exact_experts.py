"""Exact experts (exporter.exact_experts): MXFP4 weights become i8 codes times power-of-two
scales per group of 32 with the very same values; a tiny gpt-oss whose experts are MXFP4,
exported so, cut in 3 uneven stages, gives transformers' greedy tokens, and its experts
run compressed in i8 inside the CPU plugin's GatherMatmul; weights that are no MXFP4
values, a model without experts and a malformed manifest field are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.runtime.ov_core import shared_core
from exporter.exact_experts import InexactExpertsError, exact_groups
from exporter.export import ExportError, export_model
from exporter.mxfp4 import dequantize_rows, quantize_rows
from exporter.sources import open_source
from exporter.verify import DEFAULT_PROMPTS, verify_export
from tests.helpers.mxfp4_checkpoints import mxfp4_and_dense
from tests.helpers.tiny_models import build_llama
from zctl.manifest import ManifestError, load_manifest, manifest_from_dict
from zctl.weights import EXACT_EXPERT_GROUP

LAYERS = 3
SPLIT = [(0, 1), (1, 2), (2, 3)]
GPT_OSS = dict(arch="gpt_oss", layers=LAYERS, head_dim=16, intermediate=32,
               num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
               swiglu_limit=1.5, pad_token_id=None)
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                    "model.layers.*.mlp.router"]}


def _product(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return (codes.astype(np.float32) * scales.astype(np.float32)).reshape(
        *codes.shape[:-2], -1)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([1e-4, 0.02, 3.0]),
       zero_rows=st.booleans())
def test_mxfp4_weights_take_i8_codes_of_the_very_same_values(seed: int, spread: float,
                                                             zero_rows: bool) -> None:
    weight = torch.randn(3, 5, 4 * EXACT_EXPERT_GROUP,
                         generator=torch.Generator().manual_seed(seed)) * spread
    if zero_rows:
        weight[1, 2] = 0.0  # an all-zero group: codes 0
        weight[2, 0, :EXACT_EXPERT_GROUP] = -0.0
    values = dequantize_rows(*quantize_rows(weight)).numpy()
    codes, scales = exact_groups(values)
    assert codes.dtype == np.int8 and scales.dtype == np.float16
    assert codes.shape == (3, 5, 4, EXACT_EXPERT_GROUP) and scales.shape == (3, 5, 4, 1)
    assert np.abs(codes).max() <= 12  # twice E2M1's largest, 6
    assert np.array_equal(_product(codes, scales), values)
    exponents = np.log2(scales.astype(np.float32))
    assert np.array_equal(exponents, np.round(exponents))  # powers of two


def test_weights_that_are_no_mxfp4_values_are_refused_by_name() -> None:
    weight = np.random.default_rng(0).normal(0, 0.02, (2, 4, 64)).astype(np.float32)
    with pytest.raises(InexactExpertsError, match=r"experts\.up: the group of 32 inputs at "
                                                  r"\[0, 0, 0\] is no i8 code times a power"):
        exact_groups(weight, "experts.up")
    # MXFP4 values, but one a little off: that group alone is named
    exact = dequantize_rows(*quantize_rows(torch.from_numpy(weight))).numpy()
    exact[1, 3, 40] *= 1.01
    with pytest.raises(InexactExpertsError, match=r"at \[1, 3, 1\]"):
        exact_groups(exact)
    with pytest.raises(InexactExpertsError, match="48 inputs are no whole groups of 32"):
        exact_groups(exact[..., :48])
    exact[0, 0, 0] = np.inf
    with pytest.raises(InexactExpertsError, match="not finite"):
        exact_groups(exact)
    # i8 codes times a power of two, but beyond f16's scales (2^-30): refused, not rounded
    with pytest.raises(InexactExpertsError, match=r"scale 2\^-30"):
        exact_groups(np.full((1, 32), 2.0 ** -30, np.float32))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A tiny gpt-oss with its experts in MXFP4 as gpt-oss publishes them; the same weights
    dense, as transformers dequantizes them (Hugging Face's reference); the random model
    itself, whose experts are no MXFP4 values."""
    root = tmp_path_factory.mktemp("exact_experts")
    model = build_llama(root / "random", tied=False, norm_spread=0.3, bias_spread=0.5,
                        **GPT_OSS)
    projections = [f"model.layers.{layer}.mlp.experts.{projection}"
                   for layer in range(LAYERS) for projection in ("gate_up_proj", "down_proj")]
    return (*mxfp4_and_dense(model, root, projections, MXFP4_CONFIG), model)


@pytest.fixture(scope="module")
def exact_export(checkpoints: tuple[Path, Path, Path],
                 tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exact_export") / "fp32"
    export_model(open_source(str(checkpoints[0])), SPLIT, "fp32", out, exact_experts=True)
    return out


def test_an_mxfp4_gpt_oss_exports_its_greedy_tokens_with_exact_experts(
        exact_export: Path, checkpoints: tuple[Path, Path, Path]) -> None:
    manifest = load_manifest(exact_export)
    assert manifest.exact_experts and json.loads(manifest.to_json())["exact_experts"] is True
    results = verify_export(exact_export, DEFAULT_PROMPTS, 32, str(checkpoints[1]))
    assert [r.exact for r in results] == [True] * len(DEFAULT_PROMPTS)


def test_exact_experts_run_compressed_in_i8_inside_gather_matmul(exact_export: Path) -> None:
    """Every expert weight is stored as i8 codes (no float copy left in the stage), and
    the compiled stage's GatherMatmuls read them as i8."""
    core = shared_core()
    for index, (start, end) in enumerate(SPLIT):
        model = core.read_model(str(exact_export / f"stage{index}.xml"))
        stored = sorted(tuple(op.get_output_shape(0)) for op in model.get_ordered_ops()
                        if op.get_type_name() == "Constant"
                        and op.get_output_element_type(0).get_type_name() == "i8")
        assert stored == sorted([(4, 64, 2, EXACT_EXPERT_GROUP), (4, 64, 1, EXACT_EXPERT_GROUP)]
                                * (end - start)), index
        compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        gathers = [op for op in compiled.get_runtime_model().get_ordered_ops()
                   if op.get_rt_info()["layerType"].astype(str) == "GatherMatmul"]
        assert len(gathers) == 2 * (end - start), index
        assert all(op.input(1).get_element_type().get_type_name() == "i8"
                   for op in gathers), index


def test_int4_with_exact_experts_compresses_the_rest_and_keeps_the_experts(
        checkpoints: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """NNCF takes the attention to INT4 and the router to INT8, and leaves the experts'
    exact codes as they are (their bytes: the fp32 export's expert codes)."""
    out = tmp_path / "int4"
    export_model(open_source(str(checkpoints[0])), [(0, LAYERS)], "int4", out,
                 exact_experts=True)
    model = shared_core().read_model(str(out / "stage0.xml"))
    types: dict[str, list[tuple[int, ...]]] = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Constant":
            kind = op.get_output_element_type(0).get_type_name()
            types.setdefault(kind, []).append(tuple(op.get_output_shape(0)))
    assert sorted(types["i8"]) == sorted([(4, 64, 2, EXACT_EXPERT_GROUP), (4, 64, 1, EXACT_EXPERT_GROUP)]
                                         * LAYERS)
    assert types["u4"] and types["u8"]  # the attention in INT4; router, embedding, head INT8
    assert load_manifest(out).exact_experts


def test_experts_that_are_no_mxfp4_values_are_refused_before_a_stage_is_written(
        checkpoints: tuple[Path, Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "random"
    with pytest.raises(ExportError, match=r"random: __module\.layers\.0\.moe/.*MatMul "
                                          r"\(expert 0\): the group of 32 inputs"):
        export_model(open_source(str(checkpoints[2])), SPLIT, "int4", out, exact_experts=True)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_model_without_experts_is_refused(tmp_path: Path) -> None:
    model = build_llama(tmp_path / "llama", layers=2)
    with pytest.raises(ExportError, match="this model has no experts"):
        export_model(open_source(str(model)), [(0, 2)], "int4", tmp_path / "out",
                     exact_experts=True)
    assert not (tmp_path / "out").exists()


def test_the_manifest_field_is_a_boolean_written_only_when_set(exact_export: Path) -> None:
    raw = json.loads((exact_export / "manifest.json").read_text())
    assert not manifest_from_dict({k: v for k, v in raw.items()
                                   if k != "exact_experts"}).exact_experts
    with pytest.raises(ManifestError, match="exact_experts has the wrong type"):
        manifest_from_dict({**raw, "exact_experts": "yes"})
    dense = {**raw["model"], "experts": 0, "active_experts": 0, "expert_intermediate": 0}
    with pytest.raises(ManifestError, match="exact_experts is true for a model without "
                                            "experts"):
        manifest_from_dict({**raw, "model": dense})


def test_a_cluster_of_it_asks_its_nodes_to_profile_exact_experts(exact_export: Path,
                                                                 tmp_path: Path) -> None:
    """The coordinator serving the export asks each node for a profile of its experts
    exact (its own profile task too), and refuses, by name, a profile that timed them in
    the weight format; the node stays."""
    from controlplane import messages as m
    from controlplane.nodeinfo import openvino_version
    from controlplane.planner.profile import GRAPH_VERSION
    from controlplane.records import ProfileRecord
    from tests.helpers.control import Cluster, RawNode, enrol_msg, node, wait_for

    cluster = Cluster(tmp_path, exact_export)
    raw = None
    try:
        coord = cluster.coordinator()
        assert coord.profile_task is not None and coord.profile_task.exact_experts
        raw = RawNode(coord.endpoint, b"raw-1")
        raw.send(*m.to_frames(enrol_msg("raw-1")))
        request = raw.recv_until(m.ProfileRequest)
        assert request.exact_experts and request.weights == "fp32"
        plain = ProfileRecord(coord.shape.fingerprint(), "fp32", "CPU", openvino_version(),
                              [1e-4] * 4, [1e-3] * 4, 1e4, 1e-4, 1 << 20, 1 << 30,
                              graph=GRAPH_VERSION, engine_decode_s=[1e-4] * 4)
        raw.send(*m.to_frames(m.ProfileReport("measured", plain)))
        wait_for(lambda: node(coord.status(), "raw-1").profile_state.startswith("failed"),
                 what="the refusal")
        status = node(coord.status(), "raw-1")
        assert "experts in the weight format, not exact experts" in status.profile_state
        assert status.profile is None and status.state not in ("dead", "left", "failed")
    finally:
        if raw is not None:
            raw.close()
        cluster.close()
