"""Minimal reproductions of where a one-token decode step spends its time in OpenVINO's CPU
plugin, each against a yardstick measured in the same run.

Cases (compiled with the stage runner's properties, dataplane.runtime.config, the INT4
group size included; stepped with start_async()+wait(); the median of --iters inferences
after a warm-up; every timing alternates its sides call by call, so a shared machine's
drift hits both alike):

  fc      one MatMul at M=1 with compressed weights in the exporter's layout (NNCF's:
          u4 groups with u4 zero points and f16 scales, or u8 per output channel), for
          every projection shape of the model, as a dynamic-shape graph ([?,?,K], as a
          stage is compiled) and reshaped static ([1,1,K]); against numpy's f32 GEMV of the
          same shape (``numpy_f32``: a BLAS call on 4-8x the weight bytes, timed apart from
          the plugin's: BLAS threads spin after each call).
  forms   one MatMul at M=1 of every projection shape, the dynamic graph, in each of --forms
          (tools.decode.weight_forms: u8 is INT8 today, u4gN INT4, i8g32 a Q8_0-like form,
          i4g32 a Q4_0-like one, ...), all alternated call by call in --rounds rounds of
          --iters calls; each form compiled as the runner compiles such weights (dynamic
          quantization in the form's group, when it has one); per form the node that runs
          the weights (its implementation and weight precision: kept compressed, or
          decompressed at compile) and the resident memory its compile added, and per
          round its speed over the first form's (above 1: faster).
  chain   --depth square MatMuls in a row (the next one's input is the last one's output)
          against one MatMul holding all their rows (the same weight bytes, one node):
          what a MatMul node costs beyond its weights.
  layer   one decoder layer of --shape (a synthetic stage of one layer: the exporter's
          graph, random weights in the exporter's layout) stepping one token at a time over
          a past of up to 64, against its four MatMuls alone at M=1 (fc's graphs),
          alternated call by call: what a layer costs beyond its MatMuls, and its time
          per node type.
  stage   an export's stage graph (--export, default SmolLM2-135M INT4, 1 stage) decoding
          one token at a time, dynamic against the same graph reshaped static (batch 1,
          one token; the KV length stays dynamic): the same kernels (the outputs are
          compared), only the shapes differ. With --profile, each side's time per node type.
  runner  the stage runner itself (dataplane.head.local_chain on --export) decoding greedy
          tokens at each --threads setting and each of --runner-sides (stateful: KV as
          state; paged: KV in blocks, the dynamic graph only; paged-static: paged, single-
          token steps on the one-token graph, dataplane.runtime.one_token), stepped token
          by token in turns (tools.harness.greedy.paired_step_ms), each side's load time and
          resident memory growth noted; with --llama-bench BIN --gguf FILE, whole
          runs of ``llama-bench -p 0 -n --tokens`` alternated with whole runs of the
          runner at the first --threads setting, compared round by round; with --against
          DIR, another export (other weights) stepped in the same turns.

fc, chain, layer and stage run at each --threads setting (default 1 and the plugin's default, 0).

    python -m tools.decode.kernel_repro [--case fc,forms,chain,layer,stage,runner]
        [--shape smollm2|1b] [--weights int4|int8] [--forms u8,i8g32,...] [--projection NAMES]
        [--export DIR] [--profile] [--llama-bench BIN --gguf FILE]
        [--against DIR] [--runner-sides stateful,paged,paged-static] [--json]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import openvino as ov
import typer
from openvino import opset13 as ops
from rich.console import Console
from rich.table import Table

from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.ov_core import shared_core
from dataplane.runtime.synthetic import LayerShape, synthetic_model
from tools.decode.weight_forms import FormWeight, WeightForm
from tools.harness.options import Json, fail, parse_numbers
from tools.harness.order import rotated
from tools.harness.report import err, print_result, run_record
from tools.harness.stats import paired_ratio, rounded

CASES = ("fc", "forms", "chain", "layer", "stage", "runner")
WEIGHTS = ("int4", "int8")
# the runner case's sides: (paged attention, RuntimeSpec.decode_graph)
RUNNER_SIDES = {"stateful": (False, "dynamic"), "paged": (True, "dynamic"),
                "paged-static": (True, "static")}


@dataclass(frozen=True)
class ModelShape:
    """A decoder's layer geometry (the synthetic stage's) and the exporter's INT4 group
    size for it: the shapes of its MatMuls at M=1."""

    layer: LayerShape
    group: int

    @property
    def hidden(self) -> int:
        return self.layer.hidden

    def projections(self) -> dict[str, tuple[int, int]]:
        """name -> (N, K): the fused QKV, the attention output, the fused gate/up, the down
        projection and the LM head."""
        s = self.layer
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        return {"qkv": (q + 2 * kv, s.hidden), "o": (s.hidden, q),
                "gate_up": (2 * s.intermediate, s.hidden),
                "down": (s.hidden, s.intermediate), "lm_head": (s.vocab, s.hidden)}


SHAPES = {
    "smollm2": ModelShape(LayerShape(576, 1536, 9, 3, 64, 49152), 64),
    "1b": ModelShape(LayerShape(2048, 8192, 32, 8, 64, 128256), 128),
}


def nncf_form(weights: str, group: int) -> WeightForm:
    """The form NNCF leaves ``weights`` in: INT4 asymmetric in groups of ``group`` inputs
    (u4 codes and zero points, f16 scales), INT8 asymmetric per output channel."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights: one of {', '.join(WEIGHTS)}, got {weights!r}")
    return WeightForm.parse(f"u4g{group}" if weights == "int4" else "u8")


def matmul_model(k: int, rows: Sequence[int], weights: str, group: int, chained: bool,
                 seed: int = 0) -> tuple[ov.Model, list[FormWeight]]:
    """MatMuls of one [?, ?, K] input, ``rows`` outputs each, and their weights;
    ``chained``: each MatMul reads the previous one's output (square MatMuls: every row
    count K), else all read the input (their outputs concatenated)."""
    if chained and any(n != k for n in rows):
        raise ValueError(f"a chain's MatMuls are square: every row count {k}, got {list(rows)}")
    rng, form = np.random.default_rng(seed), nncf_form(weights, group)
    x = ops.parameter([-1, -1, k], np.float32, name="x")
    h, outs, used = x.output(0), [], []
    for n in rows:
        weight = FormWeight.random(n, k, form, rng)
        used.append(weight)
        y = ops.matmul(h, weight.node(), False, True).output(0)
        outs.append(y)
        if chained:
            h = y
    result = outs[-1] if chained or len(outs) == 1 else ops.concat(outs, 2).output(0)
    return ov.Model([result], [x], "matmuls"), used


def static_copy(model: ov.Model, shapes: Mapping[str, list[int]]) -> ov.Model:
    """A clone of ``model`` with the inputs named in ``shapes`` reshaped (-1: dynamic)."""
    clone = model.clone()
    clone.reshape({p: ov.PartialShape(shapes[p.get_any_name()]) for p in clone.inputs
                   if p.get_any_name() in shapes})
    return clone


def plugin_properties(threads: int, int4_group: int | None,
                      profile: bool = False) -> dict[str, Any]:
    """The stage runner's compile properties with ``threads`` (0: the plugin's default),
    ``int4_group`` (the INT4 group size of the weights compiled, None for INT8) and, when
    ``profile``, per-node counters."""
    props = RuntimeSpec(num_threads=threads or None).properties(int4_group)
    if profile:
        props["PERF_COUNT"] = True
    return props


Call = Callable[[], None]


def alternated_us(calls: Mapping[str, Call], iters: int, warmup: int = 20) -> dict[str, float]:
    """Median µs per call of each of ``calls``, called in turn (the order rotating)."""
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(iters):
        for name in rotated(names, i):
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def infer_call(compiled: ov.CompiledModel, feed: Mapping[str, np.ndarray]) -> Call:
    """One inference of ``compiled`` on ``feed`` (bound once)."""
    request = compiled.create_infer_request()
    for name, value in feed.items():
        request.set_tensor(name, ov.Tensor(value))

    def call() -> None:
        request.start_async()
        request.wait()
    return call


def int4_group_of(shape: ModelShape, weights: str) -> int | None:
    """The INT4 group the runner compiles ``weights`` of ``shape`` with (None: INT8)."""
    return shape.group if weights == "int4" else None


def fc_case(shape: ModelShape, weights: str, threads: int, iters: int,
            core: ov.Core) -> list[dict[str, Any]]:
    """Each projection at M=1: dynamic and static OpenVINO against numpy's f32 GEMV."""
    rows = []
    props = plugin_properties(threads, int4_group_of(shape, weights))
    for name, (n, k) in shape.projections().items():
        model, (weight,) = matmul_model(k, [n], weights, shape.group, chained=False)
        x = np.random.default_rng(1).standard_normal((1, 1, k)).astype(np.float32)
        dense = np.random.default_rng(2).standard_normal((n, k)).astype(np.float32)
        out = np.empty(n, np.float32)
        calls = {
            "dynamic": infer_call(core.compile_model(model, "CPU", props), {"x": x}),
            "static": infer_call(core.compile_model(static_copy(model, {"x": [1, 1, k]}), "CPU",
                                                    props), {"x": x}),
        }
        us = alternated_us(calls, iters)
        # Timed on its own: BLAS threads spin after a call and would take the plugin's cores.
        us |= alternated_us({"numpy_f32": lambda dense=dense, x=x, out=out: np.matmul(
            dense, x[0, 0], out=out)}, iters)
        time.sleep(0.1)
        rows.append({"projection": name, "n": n, "k": k, "threads": threads or "default",
                     "weight_mb": round(weight.nbytes / 2**20, 2),
                     **{f"{key}_us": round(value, 1) for key, value in us.items()},
                     "dynamic_gb_s": round(weight.nbytes / us["dynamic"] / 1e3, 1),
                     "dynamic_over_static": round(us["dynamic"] / us["static"], 3),
                     "dynamic_over_numpy_f32": round(us["dynamic"] / us["numpy_f32"], 3)})
    return rows


def form_model(k: int, weight: FormWeight) -> ov.Model:
    """One MatMul of a [?, ?, K] input by ``weight`` (its decompression subgraph)."""
    x = ops.parameter([-1, -1, k], np.float32, name="x")
    return ov.Model([ops.matmul(x, weight.node(), False, True)], [x], "form")


def weights_node(compiled: ov.CompiledModel) -> dict[str, str]:
    """The compiled graph's MatMul node: its type, implementation and weight precision
    (a low-bit precision: the weights stay compressed in the kernel; f32/bf16/f16: they
    were decompressed at compile)."""
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        kind = info["layerType"].astype(str)
        if kind.startswith(("FullyConnected", "MatMul")):
            return {"node": kind, "impl": info["primitiveType"].astype(str),
                    "weight_precision": info["runtimePrecision"].astype(str)}
    raise ValueError("no FullyConnected or MatMul node in the compiled graph")


def parse_forms(text: str) -> list[WeightForm]:
    """``--forms``' comma-separated weight forms, two or more, each once; ValueError else."""
    forms = [WeightForm.parse(name) for name in text.split(",") if name.strip()]
    if len(forms) < 2 or len({f.name for f in forms}) < len(forms):
        raise ValueError(f"--forms takes two or more distinct weight forms, got {text!r}")
    return forms


def forms_case(shape: ModelShape, forms: Sequence[WeightForm], threads: int, iters: int,
               rounds: int, core: ov.Core, projections: Sequence[str] | None = None,
               dq_group: int | None = None) -> list[dict[str, Any]]:
    """Each projection (or those named) at M=1 in every form, alternated call by call in
    ``rounds`` rounds: per form the median µs, GB/s, the node that ran, the memory its
    compile added and the round-by-round speed over the first form's. Each form compiled
    with dynamic quantization in its group (the plugin's default without one), or in
    ``dq_group`` for all (0: off)."""
    import psutil

    process = psutil.Process()
    rows = []
    for name, (n, k) in shape.projections().items():
        if projections is not None and name not in projections:
            continue
        x = np.random.default_rng(1).standard_normal((1, 1, k)).astype(np.float32)
        calls, compiled, grown = {}, {}, {}
        for index, form in enumerate(forms):
            weight = FormWeight.random(n, k, form, np.random.default_rng(10 + index))
            before = process.memory_info().rss
            props = plugin_properties(threads, form.group)
            if dq_group is not None:
                props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = dq_group
            compiled[form.name] = core.compile_model(form_model(k, weight), "CPU", props)
            grown[form.name] = round((process.memory_info().rss - before) / 2**20, 1)
            calls[form.name] = infer_call(compiled[form.name], {"x": x})
            del weight
        per_round = [alternated_us(calls, iters) for _ in range(rounds)]
        # the implementation is chosen at the first inference: read it after the timing
        info = {form.name: {**weights_node(compiled[form.name]),
                            "weight_mb": round(form.nbytes(n, k) / 2**20, 2),
                            "compile_rss_mb": grown[form.name]} for form in forms}
        first = forms[0].name
        for form in forms:
            us = statistics.median(r[form.name] for r in per_round)
            speed = [r[first] / r[form.name] for r in per_round]
            rows.append({"projection": name, "n": n, "k": k, "threads": threads or "default",
                         "form": form.name, "dq_group": dq_group, **info[form.name],
                         "us": round(us, 1),
                         "gb_s": round(form.nbytes(n, k) / us / 1e3, 1),
                         "speed_over_first": round(statistics.median(speed), 3),
                         "speed_range": [round(min(speed), 3), round(max(speed), 3)]})
        del calls, compiled
        time.sleep(0.1)
    return rows


def per_node_us(chain_us: float, one_us: float, depth: int) -> float:
    """What each MatMul node of a chain of ``depth`` costs beyond one MatMul of all their
    rows (the same weight bytes)."""
    return (chain_us - one_us) / (depth - 1)


def chain_case(shape: ModelShape, weights: str, threads: int, depth: int, iters: int,
               core: ov.Core) -> dict[str, Any]:
    """``depth`` square MatMuls in a row against one MatMul of all their rows."""
    k = shape.hidden
    props = plugin_properties(threads, int4_group_of(shape, weights))
    x = np.random.default_rng(1).standard_normal((1, 1, k)).astype(np.float32)
    chained, _ = matmul_model(k, [k] * depth, weights, shape.group, chained=True)
    one, _ = matmul_model(k, [k * depth], weights, shape.group, chained=False)
    calls = {
        "chain_dynamic": infer_call(core.compile_model(chained, "CPU", props), {"x": x}),
        "chain_static": infer_call(core.compile_model(
            static_copy(chained, {"x": [1, 1, k]}), "CPU", props), {"x": x}),
        "one_dynamic": infer_call(core.compile_model(one, "CPU", props), {"x": x}),
    }
    us = alternated_us(calls, iters)
    return {"k": k, "depth": depth, "threads": threads or "default",
            **{f"{key}_us": round(value, 1) for key, value in us.items()},
            "node_us_dynamic": round(per_node_us(us["chain_dynamic"], us["one_dynamic"], depth), 2),
            "node_us_static": round(per_node_us(us["chain_static"], us["one_dynamic"], depth), 2)}


def stage_feeds(input_names: set[str], hidden: int, head_dim: int, steps: int
                ) -> list[dict[str, np.ndarray]]:
    """One-token decode inputs of a stage graph for positions 0..steps-1: a token id (or a
    hidden state), an all-visible mask over the KV so far, RoPE rows, beam 0, logits of it."""
    inv_freq = 1.0 / (10000 ** (np.arange(0, head_dim, 2) / head_dim))
    rng = np.random.default_rng(3)
    feeds = []
    for pos in range(steps):
        angles = np.concatenate([pos * inv_freq] * 2)[None, None].astype(np.float32)
        feed = {"attention_mask": np.zeros((1, 1, 1, pos + 1), np.float32),
                "rope_cos": np.cos(angles), "rope_sin": np.sin(angles)}
        if "beam_idx" in input_names:
            feed["beam_idx"] = np.zeros(1, np.int32)
        if "logits_idx" in input_names:
            feed["logits_idx"] = np.zeros(1, np.int64)
        if "input_ids" in input_names:
            feed["input_ids"] = np.array([[pos % 1000 + 5]], np.int64)
        else:
            feed["hidden_states"] = rng.standard_normal((1, 1, hidden)).astype(np.float32)
        feeds.append(feed)
    return feeds


def add_node_times(request: ov.InferRequest, into: dict[str, float]) -> None:
    """Add the last inference's executed nodes' µs into ``into`` by "type/implementation"."""
    for info in request.profiling_info:
        if info.status == ov.ProfilingInfo.Status.EXECUTED:
            into[f"{info.node_type}/{info.exec_type}"] += info.real_time.total_seconds() * 1e6


def top_nodes(totals: Mapping[str, float], steps: int, top: int = 12) -> dict[str, float]:
    """The ``top`` node kinds by time, as µs per step (``totals`` summed over ``steps``)."""
    ranked = sorted(totals.items(), key=lambda item: -item[1])[:top]
    return {name: round(total / steps, 1) for name, total in ranked}


def stage_case(export_dir: Path, threads: int, steps: int, profile: bool,
               core: ov.Core) -> dict[str, Any]:
    """A stage graph decoding ``steps`` tokens one at a time, dynamic against static
    shapes, alternated token by token; the outputs compared."""
    from dataplane.runtime.startup import int4_group
    from zctl.manifest import load_manifest

    manifest = load_manifest(export_dir, verify_files=False)
    spec, model_spec = manifest.stages[0], manifest.model
    model = core.read_model(export_dir / spec.xml)
    one_token = {"input_ids": [1, 1], "hidden_states": [1, 1, model_spec.hidden_size],
                 "attention_mask": [1, 1, 1, -1], "rope_cos": [1, 1, model_spec.head_dim],
                 "rope_sin": [1, 1, model_spec.head_dim], "beam_idx": [1], "logits_idx": [1]}
    props = plugin_properties(threads, int4_group(manifest), profile)
    compiled = {"dynamic": core.compile_model(model, "CPU", props),
                "static": core.compile_model(static_copy(model, one_token), "CPU", props)}
    requests = {key: c.create_infer_request() for key, c in compiled.items()}
    feeds = stage_feeds({p.get_any_name() for p in model.inputs}, model_spec.hidden_size,
                        model_spec.head_dim, steps)
    times: dict[str, list[float]] = {key: [] for key in requests}
    nodes: dict[str, dict[str, float]] = {key: defaultdict(float) for key in requests}
    max_diff = 0.0
    warm = min(16, steps // 4)
    for pos, feed in enumerate(feeds):
        outputs = {}
        for key in (list(requests) if pos % 2 else list(requests)[::-1]):
            request = requests[key]
            for name, value in feed.items():
                request.set_tensor(name, ov.Tensor(value))
            start = time.perf_counter()
            request.start_async()
            request.wait()
            if pos >= warm:
                times[key].append(time.perf_counter() - start)
                if profile:
                    add_node_times(request, nodes[key])
            outputs[key] = request.get_output_tensor(0).data.copy()
        max_diff = max(max_diff, float(np.abs(outputs["dynamic"] - outputs["static"]).max()))
    ms = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    result: dict[str, Any] = {
        "export": str(export_dir), "layers": spec.num_layers, "threads": threads or "default",
        "steps": steps, **{f"{key}_ms": round(value, 3) for key, value in ms.items()},
        "dynamic_over_static": round(ms["dynamic"] / ms["static"], 3),
        "max_abs_output_diff": max_diff}
    if profile:
        result["node_us"] = {key: top_nodes(per, steps - warm) for key, per in nodes.items()}
    return result


LAYER_PAST = 64  # the layer case's past grows to this many tokens, then starts again


def layer_call(compiled: ov.CompiledModel, shape: LayerShape) -> tuple[Call, ov.InferRequest]:
    """One-token steps of a one-layer stateful graph (a synthetic decoder layer): each call
    the next position over the KV its earlier calls left, back to an empty past every
    LAYER_PAST tokens."""
    request = compiled.create_infer_request()
    feeds = stage_feeds({p.get_any_name() for p in compiled.inputs}, shape.hidden,
                        shape.head_dim, LAYER_PAST)
    position = [0]

    def call() -> None:
        if position[0] == LAYER_PAST:
            request.reset_state()
            position[0] = 0
        for name, value in feeds[position[0]].items():
            request.set_tensor(name, ov.Tensor(value))
        request.start_async()
        request.wait()
        position[0] += 1
    return call, request


def layer_case(shape: ModelShape, weights: str, threads: int, iters: int,
               core: ov.Core) -> dict[str, Any]:
    """One decoder layer of ``shape`` (dataplane.runtime.synthetic: the exporter's graph,
    random weights compressed as an export's) stepping one token at a time, against its
    four MatMuls alone at M=1 (fc's graphs, the same weight layout), alternated call by
    call: what the layer costs beyond its MatMuls (norms, RoPE, attention, the state, the
    inference call), and the layer's time per node type (the plugin's counters)."""
    group = int4_group_of(shape, weights)
    graph = synthetic_model(shape.layer, 1, False, weights, shape.group if group else None)
    layer, request = layer_call(core.compile_model(graph, "CPU",
                                                   plugin_properties(threads, group, True)),
                                shape.layer)
    calls: dict[str, Call] = {"layer": layer}
    props = plugin_properties(threads, group)
    for name, (n, k) in shape.projections().items():
        if name == "lm_head":
            continue
        model, _ = matmul_model(k, [n], weights, shape.group, chained=False)
        x = np.random.default_rng(1).standard_normal((1, 1, k)).astype(np.float32)
        calls[name] = infer_call(core.compile_model(model, "CPU", props), {"x": x})
    us = alternated_us(calls, iters)
    nodes: dict[str, float] = defaultdict(float)
    for _ in range(LAYER_PAST // 2):  # the counters of steps over a past of up to 32
        layer()
        add_node_times(request, nodes)
    matmuls = sum(value for name, value in us.items() if name != "layer")
    return {"threads": threads or "default", "weights": weights,
            **{f"{name}_us": round(value, 1) for name, value in us.items()},
            "matmuls_us": round(matmuls, 1),
            "beyond_matmuls_us": round(us["layer"] - matmuls, 1),
            "layer_over_matmuls": round(us["layer"] / matmuls, 3),
            "node_us": {"layer": top_nodes(nodes, LAYER_PAST // 2)}}


def llama_bench_tok_s(binary: Path, gguf: Path, tokens: int, threads: int) -> float:
    """llama-bench's decode tok/s for ``tokens`` new tokens (no prompt: ``-p 0``), one
    repetition at ``threads`` threads."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", "0", "-n", str(tokens),
                          "-t", str(threads), "-r", "1", "-o", "json"],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    return float(json.loads(out)[0]["avg_ts"])


def round_ratios(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, Any]:
    """Round-by-round tok/s ratios (ours over theirs): the median, its range, the medians."""
    if not ours or len(ours) != len(theirs) or min(theirs) <= 0:
        raise ValueError("round_ratios needs the same, non-zero number of rounds a side")
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return {"zctl_tok_s": round(statistics.median(ours), 2),
            "llama_cpp_tok_s": round(statistics.median(theirs), 2),
            "ratio": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)]}


def side_spec(side: str, threads: int) -> RuntimeSpec:
    """The runtime spec of a runner side (RUNNER_SIDES) at ``threads`` (0: the default)."""
    paged, graph = RUNNER_SIDES[side]
    spec = type(f"RuntimeSpec_{graph}", (RuntimeSpec,), {"decode_graph": graph})
    return spec(num_threads=threads or None, paged_attention=paged)


def parse_sides(text: str) -> list[str]:
    """``--runner-sides``' comma-separated names, each one of RUNNER_SIDES; ValueError else."""
    sides = [s.strip() for s in text.split(",") if s.strip()]
    if not sides or any(s not in RUNNER_SIDES for s in sides) or len(set(sides)) < len(sides):
        raise ValueError(f"--runner-sides takes some of {', '.join(RUNNER_SIDES)}, got {text!r}")
    return sides


def loaded_chain(export_dir: Path, spec: RuntimeSpec, into: dict[str, Any], key: str) -> Any:
    """LocalChain.load of ``export_dir`` with ``spec``; its load time (s) and the process's
    resident memory growth over it (MB) noted in ``into[key]``."""
    import psutil

    from dataplane.head.local_chain import LocalChain

    process = psutil.Process()
    before, start = process.memory_info().rss, time.perf_counter()
    chain = LocalChain.load(str(export_dir), spec)
    into[key] = {"load_s": round(time.perf_counter() - start, 2),
                 "rss_mb": round((process.memory_info().rss - before) / 2**20, 1)}
    return chain


def runner_case(export_dir: Path, thread_settings: Sequence[int], tokens: int, rounds: int,
                llama: tuple[Path, Path] | None, against: Path | None = None,
                sides: Sequence[str] = ("stateful",)) -> dict[str, Any]:
    """The stage runner at each thread setting and side (RUNNER_SIDES; and ``against``,
    another export, at the first of each), token by token in turns, ``rounds`` times
    (step-time ratios: the first chain's over each); with ``llama`` (llama-bench, GGUF),
    whole runs of each alternated, the first chain's."""
    from tools.harness.greedy import greedy_step, paired_step_ms, start_stream

    loads: dict[str, Any] = {}
    chains = {}
    for side in sides:
        for t in thread_settings:
            key = f"threads_{t or 'default'}" if len(sides) == 1 else f"{side}_threads_{t or 'default'}"
            chains[key] = loaded_chain(export_dir, side_spec(side, t), loads, key)
    if against is not None:
        chains["against"] = loaded_chain(against, side_spec(sides[0], thread_settings[0]),
                                         loads, "against")
    prompt = [1, *range(300, 340)]
    step_ms: dict[str, list[float]] = {key: [] for key in chains}
    for _ in range(rounds):
        for key, ms in paired_step_ms(chains, prompt, tokens).items():
            step_ms[key].append(ms)
    first = next(iter(chains))
    result: dict[str, Any] = {
        "export": str(export_dir), "against": str(against) if against else None,
        "tokens": tokens, "rounds": rounds, "load": loads,
        "step_ms": {key: [round(v, 3) for v in values] for key, values in step_ms.items()},
        "over_first": {key: rounded(paired_ratio(step_ms[first], values))
                       for key, values in step_ms.items()}}
    if llama is not None:
        binary, gguf = llama
        threads = thread_settings[0] or len(os.sched_getaffinity(0))
        ours, theirs = [], []
        for index in range(rounds):
            for side in (("zctl", "llama") if index % 2 == 0 else ("llama", "zctl")):
                if side == "llama":
                    theirs.append(llama_bench_tok_s(binary, gguf, tokens, threads))
                    continue
                state = start_stream(chains[first], 8, prompt)
                start = time.perf_counter()
                for _ in range(tokens):
                    state = greedy_step(chains[first], 8, *state)
                ours.append(tokens / (time.perf_counter() - start))
        result["llama_cpp"] = {"binary": str(binary), "gguf": str(gguf), "threads": threads,
                               **round_ratios(ours, theirs)}
    return result


def default_stage_export() -> Path:
    """SmolLM2-135M INT4 in one stage, from the benchmarks' export cache."""
    from tools.harness.models import model_export

    return model_export("smollm2-135m", 1, "int4")


def render(result: Mapping[str, Any], console: Console) -> None:
    """The cases as tables."""
    for key, rows in result["cases"].items():
        rows = rows if isinstance(rows, list) else [rows]
        table = Table(title=key)
        columns = [c for c in rows[0] if not isinstance(rows[0][c], dict | list)]
        for column in columns:
            table.add_column(column, justify="right")
        for row in rows:
            table.add_row(*(str(row.get(c, "")) for c in columns))
        console.print(table)
        for row in rows:
            for side, per in row.get("node_us", {}).items():
                console.print(f"{side} µs per step by node: " + ", ".join(
                    f"{name} {value}" for name, value in per.items()))
            for name in ("load", "step_ms", "over_first", "llama_cpp"):
                if name in row:
                    console.print(f"{name}: {row[name]}")


def parse_cases(text: str) -> list[str]:
    """``--case``'s comma-separated names, each one of CASES; ValueError otherwise."""
    cases = [c.strip() for c in text.split(",") if c.strip()]
    if not cases or any(c not in CASES for c in cases):
        raise ValueError(f"--case takes some of {', '.join(CASES)}, got {text!r}")
    return cases


def main(
    case: Annotated[str, typer.Option(
        help="comma-separated: fc, chain, stage, runner")] = "fc,chain,stage",
    shape: Annotated[str, typer.Option(help="projection shapes (fc, chain): smollm2 | 1b")
                     ] = "smollm2",
    weights: Annotated[str, typer.Option(help="int4 | int8 (fc and chain)")] = "int4",
    forms: Annotated[str, typer.Option(
        help="forms: comma-separated weight forms, the first the yardstick (u8: INT8 today, "
             "u4g128: INT4 on the 1B shape, i8g32, i4g32, u4g32z, ...)")] = "u8,i8,i8g32,i8g64,i8g128",
    dq_group: Annotated[int | None, typer.Option(
        help="forms: every form's dynamic quantization group (0: off); default the "
             "runner's: the form's group, the plugin's default for per-row forms")] = None,
    projection: Annotated[str, typer.Option(
        help="forms: comma-separated projections (qkv, o, gate_up, down, lm_head; "
             "empty: all)")] = "",
    threads: Annotated[str, typer.Option(
        help="INFERENCE_NUM_THREADS settings, comma-separated (0: the plugin's default)")] = "1,0",
    depth: Annotated[int, typer.Option(help="MatMuls in the chain")] = 32,
    iters: Annotated[int, typer.Option(help="timed inferences per side (fc, chain; forms: "
                                         "per round)")] = 300,
    steps: Annotated[int, typer.Option(help="decode steps per side (stage)")] = 96,
    tokens: Annotated[int, typer.Option(help="greedy tokens per round (runner)")] = 128,
    rounds: Annotated[int, typer.Option(help="rounds (runner, forms)")] = 3,
    export: Annotated[Path | None, typer.Option(
        help="the stage and runner cases' export (stage: its stage 0); default SmolLM2-135M "
             "INT4, 1 stage")] = None,
    profile: Annotated[bool, typer.Option(help="stage: time per node type (PERF_COUNT)")] = False,
    llama_bench: Annotated[Path | None, typer.Option(
        help="runner: a llama-bench binary to alternate with (needs --gguf)")] = None,
    gguf: Annotated[Path | None, typer.Option(help="runner: the GGUF llama-bench runs")] = None,
    against: Annotated[Path | None, typer.Option(
        help="runner: another export stepped in the same turns, at the first --threads")] = None,
    runner_sides: Annotated[str, typer.Option(
        help="runner: comma-separated sides: stateful (KV as state), paged (KV in blocks, "
             "the dynamic graph), paged-static (paged, one-token steps on the one-token "
             "graph)")] = "stateful",
    as_json: Json = False,
) -> None:
    try:
        cases = parse_cases(case)
        sides = parse_sides(runner_sides)
        weight_forms = parse_forms(forms)
        chosen = [p.strip() for p in projection.split(",") if p.strip()] or None
        if chosen is not None and not set(chosen) <= set(SHAPES["1b"].projections()):
            raise ValueError(f"--projection takes some of {', '.join(SHAPES['1b'].projections())}, "
                             f"got {projection!r}")
    except ValueError as exc:
        fail(str(exc))
    if shape not in SHAPES:
        fail(f"--shape takes one of {', '.join(SHAPES)}, got {shape!r}")
    if weights not in WEIGHTS:
        fail(f"--weights takes int4 or int8, got {weights!r}")
    if dq_group is not None and dq_group < 0:
        fail(f"--dq-group takes 0 (off) or a group size, got {dq_group}")
    if depth < 2 or iters < 1 or steps < 8 or tokens < 1 or rounds < 1:
        fail("--depth needs >= 2, --iters >= 1, --steps >= 8, --tokens and --rounds >= 1")
    thread_settings = parse_numbers(threads, "--threads", "thread counts", minimum=0)
    for option, path in (("--export", export), ("--against", against)):
        if path is not None and not (path / "manifest.json").is_file():
            fail(f"{option} {path}: no manifest.json there")
    if (llama_bench is None) != (gguf is None):
        fail("--llama-bench and --gguf go together")
    if llama_bench is not None and gguf is not None:
        if not llama_bench.is_file() or not gguf.is_file():
            fail(f"--llama-bench {llama_bench} and --gguf {gguf} must both be files")
    core = shared_core()
    model_shape = SHAPES[shape]
    if "forms" in cases:
        ks = {k for name, (_, k) in model_shape.projections().items()
              if chosen is None or name in chosen}
        for form in weight_forms:
            if form.group and any(k % form.group for k in ks):
                fail(f"--forms {form.name}: its group does not divide the inputs of every "
                     f"{shape} projection ({sorted(ks)})")
    out: dict[str, Any] = {}
    for name in cases:
        err.print(f"case {name} ...")
        if name == "fc":
            out[name] = [row for t in thread_settings
                         for row in fc_case(model_shape, weights, t, iters, core)]
        elif name == "forms":
            out[name] = [row for t in thread_settings for row in forms_case(
                model_shape, weight_forms, t, iters, rounds, core, chosen, dq_group)]
        elif name == "chain":
            out[name] = [chain_case(model_shape, weights, t, depth, iters, core)
                         for t in thread_settings]
        elif name == "layer":
            out[name] = [layer_case(model_shape, weights, t, iters, core)
                         for t in thread_settings]
        elif name == "stage":
            export_dir = export or default_stage_export()
            out[name] = [stage_case(export_dir, t, steps, profile, core) for t in thread_settings]
        else:
            llama = (llama_bench, gguf) if llama_bench is not None and gguf is not None else None
            out[name] = runner_case(export or default_stage_export(), thread_settings, tokens,
                                    rounds, llama, against, sides)
    result = {**run_record(), "openvino": ov.get_version(), "shape": shape, "weights": weights,
              "cases": out}
    print_result(result, as_json, render)


if __name__ == "__main__":
    typer.run(main)
