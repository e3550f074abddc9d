"""MXFP4 weights on OpenVINO's CPU plugin: kept as they are, exact, and how fast against
the same weights requantized to NNCF INT4.

Two graphs, each built twice from one MXFP4 tensor (random Gaussian weights rounded to
MXFP4 by exporter.mxfp4, blocks of 32 along the input dimension, as gpt-oss stores its
experts): once with the weights as ``f4e2m1`` codes times ``f8e8m0`` block scales
(Constant -> Convert -> Multiply by Convert(scales) -> Reshape, the decompression subgraph
the plugin folds into its kernels), once with the same values dequantized to f32 and then
compressed as zctl's INT4 export compresses a decoder weight (exporter.compress: NNCF
INT4 asymmetric, the group size fitted to the shape).

  fc      one MatMul [1, K] x [N, K]^T (a projection; the plugin's FullyConnected).
  moe     one sparse mixture-of-experts layer in exporter.moe_block's tiled form (the
          plugin's GatherMatmul: only the routed experts computed), experts stacked
          [E, out, in], one token routed to --active of --experts.

Three sides against the graph with the dequantized weights as f32 constants: ``mxfp4``
(f4e2m1 codes, f8e8m0 scales), ``int8_exact`` (the same values losslessly as i8 codes,
twice each E2M1 number, times f16 power-of-two scales per 32: exporter.exact_experts'
form, which ``zctl export --exact-experts`` writes and the plugin decompresses in its
kernels too) and ``int4`` (NNCF's requantization). For each: the node that runs the
weights in the compiled graph and their precision there (f4e2m1 kept, or folded to f32);
whether its output is bit-identical to the f32 weights' and its relative RMS distance from
it (the exact ones differ by the order of the sums only; INT4's distance is what
requantizing costs); its largest difference from a float64 reference; and the median time
of a one-token inference, the sides alternating call by call, with the median ratio of
INT4's time to this side's (above 1: this side is faster). Compiled on CPU with
DYNAMIC_QUANTIZATION_GROUP_SIZE 0 (the activations stay in float: the weights alone are
compared) and --precision as INFERENCE_PRECISION_HINT.

    python -m tools.decode.mxfp4 [--case fc|moe|all] [--hidden 2880] [--intermediate 2880]
        [--experts 8] [--active 4] [--iters 200] [--precision f32] [--json]
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Annotated, Any

import numpy as np
import openvino as ov
import openvino.opset15 as ops
import torch
import typer

from dataplane.runtime.ov_core import shared_core
from dataplane.runtime.weight_graph import i8_group_weight
from exporter.compress import compress_stage
from exporter.exact_experts import exact_groups
from exporter.mxfp4 import (
    BLOCK_VALUES,
    dequantize_rows,
    quantize_rows,
)
from tools.harness.options import Json, Precision
from tools.harness.stats import paired_ratio, rounded
from zctl.weights import pick_group_size

WEIGHT_STD = 0.02  # about a trained projection's spread; MXFP4's scales follow it


def mxfp4_pair(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Gaussian weights [..., out, in] rounded to MXFP4 (blocks along ``in``)."""
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * WEIGHT_STD
    return quantize_rows(weight)


def mxfp4_weight(blocks: torch.Tensor, scales: torch.Tensor) -> ov.Output:
    """The weights [..., out, in] as f4e2m1 codes times f8e8m0 scales, in the graph."""
    *lead, groups, width = blocks.shape
    codes = ov.Tensor(ov.Type.f4e2m1, [*lead, groups, 2 * width])
    codes.data[:] = blocks.numpy().reshape(-1)
    exponents = ov.Tensor(ov.Type.f8e8m0, [*lead, groups, 1])
    exponents.data[:] = scales.numpy().reshape(*lead, groups, 1)
    values = ops.multiply(ops.convert(ops.constant(codes), ov.Type.f32),
                          ops.convert(ops.constant(exponents), ov.Type.f32))
    dense_shape = np.array([*lead, groups * 2 * width], dtype=np.int64)
    return ops.reshape(values, ops.constant(dense_shape), False).output(0)


def exact_int8_weight(blocks: torch.Tensor, scales: torch.Tensor) -> ov.Output:
    """The same weights losslessly as i8 codes times f16 power-of-two scales per 32, as an
    export with exact experts holds them (exporter.exact_experts): twice an E2M1 number is
    an integer from -12 to 12, its block's scale halved a power of two."""
    return i8_group_weight(*exact_groups(dequantize_rows(blocks, scales).numpy()))


Encoding = Callable[[torch.Tensor, torch.Tensor], ov.Output]


def fc_models(out: int, inp: int) -> tuple[dict[str, ov.Model], ov.Model, np.ndarray]:
    """One MatMul with the MXFP4 weights in each encoding, and with their f32 values; those
    values."""
    blocks, scales = mxfp4_pair((out, inp), seed=1)
    dense = dequantize_rows(blocks, scales).numpy()

    def model(weight: ov.Output | ov.Node) -> ov.Model:
        x = ops.parameter([-1, inp], ov.Type.f32, name="x")
        return ov.Model([ops.matmul(x, weight, False, True)], [x], "fc")

    encoded = {name: model(encode(blocks, scales)) for name, encode in ENCODINGS.items()}
    return encoded, model(ops.constant(dense)), dense


def moe_models(hidden: int, intermediate: int, experts: int, active: int
               ) -> tuple[dict[str, ov.Model], ov.Model, torch.nn.Module]:
    """exporter.moe_block's sparse layer with its experts' weights in each MXFP4 encoding,
    and with their f32 values (the router in f32 in all); the torch layer they were traced
    from."""
    from exporter.moe_block import SparseMoeBlock

    pairs = {"gate": mxfp4_pair((experts, intermediate, hidden), seed=2),
             "up": mxfp4_pair((experts, intermediate, hidden), seed=3),
             "down": mxfp4_pair((experts, hidden, intermediate), seed=4)}
    dense = {name: dequantize_rows(*pair) for name, pair in pairs.items()}
    router = torch.randn(experts, hidden, generator=torch.Generator().manual_seed(5))
    block = SparseMoeBlock(router, torch.cat((dense["gate"], dense["up"]), dim=1),
                           dense["down"], active, norm_topk_prob=True).eval()
    example = torch.randn(1, 3, hidden, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        f32_model = ov.convert_model(block, example_input=example)
    encoded = {}
    for encoding, encode in ENCODINGS.items():
        with torch.no_grad():
            model = ov.convert_model(block, example_input=example)
        replaced = 0
        for op in model.get_ordered_ops():
            name = op.get_friendly_name().removeprefix("self.")
            if op.get_type_name() == "Constant" and name in pairs:
                weight = encode(*pairs[name])
                for target in list(op.output(0).get_target_inputs()):
                    target.replace_source_output(weight)
                replaced += 1
        if replaced != len(pairs):
            raise RuntimeError(f"found {replaced} of the experts' 3 weight constants")
        encoded[encoding] = model
    return encoded, f32_model, block


ENCODINGS: dict[str, Encoding] = {"mxfp4": mxfp4_weight, "int8_exact": exact_int8_weight}


def weight_nodes(compiled: ov.CompiledModel) -> list[str]:
    """The compiled graph's nodes that multiply by weights: their kind, their runtime
    precision and their inputs' element types (``GatherMatmul f32 (f32, f4e2m1, ...)``)."""
    found = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        kind = str(info["layerType"].astype(str)) if "layerType" in info else op.get_type_name()
        if kind in ("FullyConnected", "GatherMatmul", "MatMul"):
            inputs = ", ".join(i.get_element_type().get_type_name() for i in op.inputs())
            found.append(f"{kind} {info['runtimePrecision'].astype(str)} ({inputs})")
    return found


def _median_ms(request: ov.InferRequest, x: np.ndarray, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        request.infer([x])
        times.append(1000 * (time.perf_counter() - started))
    return times


def _relative_rms(value: np.ndarray, exact: np.ndarray) -> float:
    return round(float(np.sqrt(np.mean((value - exact) ** 2) / np.mean(exact ** 2))), 7)


def measure(encoded: dict[str, ov.Model], f32_model: ov.Model, x: np.ndarray,
            reference: np.ndarray, group: int, precision: str, iters: int) -> dict[str, Any]:
    """Each side's compiled weight nodes, its output's distance from the exact one, and
    its median time with the sides alternating call by call; ratios against INT4's time."""
    # no dynamic quantization of the activations (the plugin's default for 8- and 4-bit
    # weights): what is compared is what each encoding does to the weights
    config: dict[str, Any] = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
    if precision != "default":
        config["INFERENCE_PRECISION_HINT"] = precision
    core = shared_core()
    compiled = {name: core.compile_model(model, "CPU", config) for name, model in encoded.items()}
    compiled["int4"] = core.compile_model(compress_stage(f32_model.clone(), "int4", group),
                                          "CPU", config)
    exact = np.asarray(core.compile_model(f32_model, "CPU", config)([x])[0])
    out = {name: np.asarray(model([x])[0]) for name, model in compiled.items()}
    requests = {name: model.create_infer_request() for name, model in compiled.items()}
    for request in requests.values():  # warm-up
        _median_ms(request, x, 5)
    times: dict[str, list[float]] = {name: [] for name in requests}
    for _ in range(iters):  # alternating call by call: the machine's drift hits every side
        for name, request in requests.items():
            times[name] += _median_ms(request, x, 1)
    sides = {}
    for name in compiled:
        sides[name] = {
            "nodes": weight_nodes(compiled[name]),
            "bit_identical_to_f32_weights": bool(np.array_equal(out[name], exact)),
            "relative_rms_vs_f32_weights": _relative_rms(out[name], exact),
            "max_abs_vs_float64": float(np.abs(out[name] - reference).max()),
            "median_ms": round(statistics.median(times[name]), 4),
            "int4_time_over_this": rounded(paired_ratio(times["int4"], times[name])),
        }
    return {"int4_group": group, "f32_weights_max_abs_vs_float64":
            float(np.abs(exact - reference).max()), "sides": sides}


def fc_case(hidden: int, intermediate: int, precision: str, iters: int) -> dict[str, Any]:
    out, inp = 2 * intermediate, hidden  # a gate_up projection
    encoded, f32_model, dense = fc_models(out, inp)
    x = np.random.default_rng(7).standard_normal((1, inp)).astype(np.float32)
    reference = x.astype(np.float64) @ dense.astype(np.float64).T
    return {"case": "fc", "shape": [out, inp],
            **measure(encoded, f32_model, x, reference, pick_group_size([inp]), precision,
                      iters)}


def moe_case(hidden: int, intermediate: int, experts: int, active: int, precision: str,
             iters: int) -> dict[str, Any]:
    encoded, f32_model, block = moe_models(hidden, intermediate, experts, active)
    x = np.random.default_rng(8).standard_normal((1, 1, hidden)).astype(np.float32)
    with torch.no_grad():  # the same routing, every product and sum in float64
        reference = block.double()(torch.from_numpy(x).double()).numpy()
    return {"case": "moe", "experts": experts, "active": active,
            "shape": [hidden, intermediate],
            **measure(encoded, f32_model, x, reference,
                      pick_group_size([hidden, intermediate]), precision, iters)}


def main(
    case: Annotated[str, typer.Option(help="fc | moe | all")] = "all",
    hidden: Annotated[int, typer.Option(help="hidden size (gpt-oss: 2880)")] = 2880,
    intermediate: Annotated[int, typer.Option(help="an expert's width (gpt-oss: 2880)")] = 2880,
    experts: Annotated[int, typer.Option(help="experts in the moe case")] = 8,
    active: Annotated[int, typer.Option(help="experts a token runs (gpt-oss: 4)")] = 4,
    iters: Annotated[int, typer.Option(help="timed inferences a side")] = 200,
    precision: Precision = "f32",
    as_json: Json = False,
) -> None:
    if case not in ("fc", "moe", "all"):
        raise typer.BadParameter(f"case is fc, moe or all, not {case!r}")
    for size in (hidden, intermediate):
        if size < BLOCK_VALUES or size % BLOCK_VALUES:
            raise typer.BadParameter(f"sizes are whole MXFP4 blocks of {BLOCK_VALUES}, not {size}")
    if not 1 <= active <= experts:
        raise typer.BadParameter(f"active is 1 to experts ({experts}), not {active}")
    results = []
    if case in ("fc", "all"):
        results.append(fc_case(hidden, intermediate, precision, iters))
    if case in ("moe", "all"):
        results.append(moe_case(hidden, intermediate, experts, active, precision, iters))
    report = {"openvino": ov.get_version(), "precision": precision, "results": results}
    if as_json:
        print(json.dumps(report))
        return
    print(f"OpenVINO {report['openvino']}, INFERENCE_PRECISION_HINT {precision}")
    for result in results:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    typer.run(main)
