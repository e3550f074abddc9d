"""tools/decode/kernel_repro: the compressed weights it builds compute what their numpy
dequantization does, its pure summaries, its refusals, and its stage and runner cases on
the tiny model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import typer

from dataplane.runtime.ov_core import shared_core
from dataplane.runtime.synthetic import LayerShape
from tools.decode.kernel_repro import (
    CASES,
    SHAPES,
    ModelShape,
    alternated_us,
    forms_case,
    layer_case,
    main,
    matmul_model,
    nncf_form,
    parse_cases,
    parse_forms,
    parse_sides,
    per_node_us,
    plugin_properties,
    round_ratios,
    runner_case,
    stage_case,
    stage_feeds,
    static_copy,
    top_nodes,
)
from tools.decode.weight_forms import FormWeight

EXACT = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}


def test_projections_are_the_fused_layers_matmuls() -> None:
    assert SHAPES["smollm2"].projections() == {
        "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
        "lm_head": (49152, 576)}
    llama_1b = SHAPES["1b"].projections()
    assert llama_1b["qkv"] == (3072, 2048) and llama_1b["gate_up"] == (16384, 2048)


def test_nncf_forms_are_its_int4_groups_and_int8_channels() -> None:
    rng = np.random.default_rng(0)
    int4 = FormWeight.random(8, 128, nncf_form("int4", 64), rng)
    assert int4.form.name == "u4g64" and int4.codes.shape == (8, 2, 64)
    assert int4.zero is not None and int4.zero.shape == int4.scale.shape == (8, 2, 1)
    assert int4.nbytes == 8 * 128 // 2 + 16 // 2 + 16 * 2  # u4 codes and zeros, f16 scales
    int8 = FormWeight.random(8, 128, nncf_form("int8", 64), rng)
    assert int8.form.name == "u8" and int8.codes.shape == (8, 128)
    assert int8.nbytes == 8 * 128 + 8 + 8 * 2
    with pytest.raises(ValueError, match="not a multiple of the group size 64"):
        FormWeight.random(8, 96, nncf_form("int4", 64), rng)
    with pytest.raises(ValueError, match="one of int4, int8"):
        nncf_form("nf4", 64)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_matmul_models_compute_their_weights_dequantized(weights: str) -> None:
    core = shared_core()
    x = np.random.default_rng(5).standard_normal((1, 1, 128)).astype(np.float32)
    model, (a, b) = matmul_model(128, [64, 32], weights, 32, chained=False)
    got = core.compile_model(model, "CPU", EXACT)({"x": x})[0]
    want = np.concatenate([x[0] @ a.dense().T, x[0] @ b.dense().T], axis=1)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    chained, (c, d) = matmul_model(128, [128, 128], weights, 32, chained=True)
    got = core.compile_model(chained, "CPU", EXACT)({"x": x})[0]
    np.testing.assert_allclose(got[0], x[0] @ c.dense().T @ d.dense().T, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="square"):
        matmul_model(128, [64, 64], weights, 32, chained=True)


def test_static_copy_reshapes_the_named_inputs_only() -> None:
    model, _ = matmul_model(64, [16], "int8", 32, chained=False)
    static = static_copy(model, {"x": [1, 1, 64], "absent": [1]})
    assert static.input("x").get_partial_shape() == ov.PartialShape([1, 1, 64])
    assert model.input("x").get_partial_shape().is_dynamic  # the original is left as it was


def test_plugin_properties_are_the_runners_with_the_int4_group() -> None:
    props = plugin_properties(1, 64, profile=True)
    assert props["INFERENCE_NUM_THREADS"] == 1 and props["PERF_COUNT"] is True
    assert props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == 64
    default = plugin_properties(0, None)
    assert "INFERENCE_NUM_THREADS" not in default and "PERF_COUNT" not in default
    assert "DYNAMIC_QUANTIZATION_GROUP_SIZE" not in default


def test_alternated_calls_each_in_turn() -> None:
    calls: list[str] = []
    us = alternated_us({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                       iters=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then rotating
    assert set(us) == {"a", "b"} and all(v >= 0 for v in us.values())


def test_summaries() -> None:
    assert per_node_us(chain_us=500.0, one_us=190.0, depth=32) == 10.0
    assert top_nodes({"FC/brgemm": 900.0, "SDPA/x": 300.0, "RMS/jit": 30.0}, steps=3,
                     top=2) == {"FC/brgemm": 300.0, "SDPA/x": 100.0}
    out = round_ratios([200.0, 210.0, 190.0], [250.0, 200.0, 200.0])
    assert out == {"zctl_tok_s": 200.0, "llama_cpp_tok_s": 200.0, "ratio": 0.95,
                   "ratio_range": [0.8, 1.05]}
    with pytest.raises(ValueError, match="same, non-zero"):
        round_ratios([1.0], [])


def test_stage_feeds_step_one_token_over_a_growing_past() -> None:
    feeds = stage_feeds({"input_ids", "attention_mask", "beam_idx", "logits_idx"}, 64, 16, 3)
    assert [f["attention_mask"].shape for f in feeds] == [(1, 1, 1, 1), (1, 1, 1, 2),
                                                         (1, 1, 1, 3)]
    assert feeds[2]["input_ids"].shape == (1, 1) and feeds[0]["rope_cos"].shape == (1, 1, 16)
    assert np.allclose(feeds[0]["rope_cos"], 1.0)  # position 0
    middle = stage_feeds({"hidden_states", "attention_mask"}, 64, 16, 1)[0]
    assert middle["hidden_states"].shape == (1, 1, 64)
    assert "beam_idx" not in middle and "input_ids" not in middle


def test_bad_options_are_refused() -> None:
    assert parse_cases(" fc,runner ") == ["fc", "runner"] and "stage" in CASES
    for bad in ("", "fc,gemm"):
        with pytest.raises(ValueError, match="--case takes some of"):
            parse_cases(bad)
    for kwargs, match in [({"case": "gemm"}, "--case"), ({"shape": "70b"}, "--shape"),
                          ({"weights": "nf4"}, "--weights"), ({"depth": 1}, "--depth"),
                          ({"threads": "1,-1"}, "--threads"),
                          ({"export": Path("/nonexistent")}, "no manifest.json"),
                          ({"against": Path("/nonexistent")}, "--against"),
                          ({"llama_bench": Path("/bin/true")}, "go together"),
                          ({"runner_sides": "paged,npu"}, "--runner-sides"),
                          ({"forms": "u8,u8"}, "--forms"), ({"forms": "u8,q8_0"}, "weight form"),
                          ({"case": "forms", "forms": "u8,i8g128"}, "does not divide"),
                          ({"projection": "lm_head,ffn"}, "--projection"),
                          ({"dq_group": -1}, "--dq-group")]:
        with pytest.raises(typer.BadParameter, match=match):
            main(**kwargs)


def test_runner_sides_are_named_once_each() -> None:
    assert parse_sides(" paged , paged-static") == ["paged", "paged-static"]
    for bad in ("", "paged,paged", "static"):
        with pytest.raises(ValueError, match="--runner-sides takes some of"):
            parse_sides(bad)


def test_int4_shapes_divide_into_their_groups() -> None:
    for shape in SHAPES.values():
        assert isinstance(shape, ModelShape)
        assert all(k % shape.group == 0 for _, k in shape.projections().values())


def test_stage_case_profiles_a_stage_dynamic_and_static(tiny_exports) -> None:
    export = tiny_exports.get([(0, 4)], "int4")
    out = stage_case(export, 1, 8, True, shared_core())
    assert out["layers"] == 4 and out["threads"] == 1
    assert out["dynamic_ms"] > 0 and out["static_ms"] > 0
    assert out["max_abs_output_diff"] < 1e-3  # the same kernels on other shapes
    for side in ("dynamic", "static"):
        assert any(name.startswith("FullyConnected") for name in out["node_us"][side])


def test_runner_case_pairs_thread_settings_and_alternates_llama_bench(
        tiny_exports, tmp_path: Path) -> None:
    export = tiny_exports.get([(0, 4)], "int4")
    bench = tmp_path / "llama-bench"
    bench.write_text("#!/bin/sh\necho '[{\"avg_ts\": 50.0}]'\n")
    bench.chmod(0o755)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    out = runner_case(export, [1, 0], tokens=4, rounds=2, llama=(bench, gguf),
                      against=tiny_exports.get([(0, 4)], "int8"))
    assert list(out["step_ms"]) == ["threads_1", "threads_default", "against"]
    assert all(len(v) == 2 and min(v) > 0 for v in out["step_ms"].values())
    assert out["over_first"]["threads_1"] == 1.0
    llama = out["llama_cpp"]
    assert llama["threads"] == 1 and llama["llama_cpp_tok_s"] == 50.0
    assert llama["zctl_tok_s"] > 0
    assert llama["ratio_range"][0] <= llama["ratio"] <= llama["ratio_range"][1]


def test_runner_case_steps_paged_sides_with_and_without_the_one_token_graph(tiny_exports
                                                                           ) -> None:
    export = tiny_exports.get([(0, 4)], "int4")
    out = runner_case(export, [0], tokens=4, rounds=1, llama=None,
                      sides=["paged", "paged-static"])
    assert list(out["step_ms"]) == ["paged_threads_default", "paged-static_threads_default"]
    assert out["over_first"]["paged_threads_default"] == 1.0
    assert set(out["load"]) == set(out["step_ms"])
    assert all(load["load_s"] > 0 for load in out["load"].values())


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_layer_case_times_a_layer_against_its_matmuls(weights: str) -> None:
    shape = ModelShape(LayerShape(64, 128, 2, 1, 32, 256), 32)
    out = layer_case(shape, weights, 1, iters=5, core=shared_core())
    assert {"layer_us", "qkv_us", "o_us", "gate_up_us", "down_us"} <= set(out)
    assert "lm_head_us" not in out  # a layer holds no head
    assert out["matmuls_us"] == pytest.approx(sum(
        out[f"{p}_us"] for p in ("qkv", "o", "gate_up", "down")), abs=0.3)
    assert out["beyond_matmuls_us"] == pytest.approx(out["layer_us"] - out["matmuls_us"],
                                                     abs=0.3)
    nodes = out["node_us"]["layer"]
    assert any(name.startswith("FullyConnected") for name in nodes), nodes
    assert all(value >= 0 for value in nodes.values())


def test_forms_are_two_or_more_each_once() -> None:
    assert [f.name for f in parse_forms("u8, i8g32")] == ["u8", "i8g32"]
    for bad in ("u8", "u8,i8,u8"):
        with pytest.raises(ValueError, match="two or more distinct"):
            parse_forms(bad)


def test_forms_case_alternates_every_form_on_the_projections_named() -> None:
    shape = ModelShape(LayerShape(64, 128, 2, 1, 32, 256), 32)
    rows = forms_case(shape, parse_forms("u8,i8g32,u4g32"), 1, iters=3, rounds=2,
                      core=shared_core(), projections=["down", "lm_head"])
    assert [(r["projection"], r["form"]) for r in rows] == [
        (p, f) for p in ("down", "lm_head") for f in ("u8", "i8g32", "u4g32")]
    first = rows[0]
    assert first["speed_over_first"] == 1.0 and first["speed_range"] == [1.0, 1.0]
    assert [r["weight_precision"] for r in rows[:3]] == ["u8", "i8", "u4"]
    assert all(r["us"] > 0 and r["node"].startswith("FullyConnected") for r in rows)
    assert rows[1]["weight_mb"] == round((64 * 128 + 64 * 4 * 2) / 2**20, 2)
