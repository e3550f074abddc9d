"""A stage of random weights built from a model's shape: what a node's profile times.

``synthetic_stage`` builds, with OpenVINO's opset and no torch, the graph the exporter
makes of a middle stage of ``layers`` Llama decoder layers (or a last stage, with the
final norm and the LM head): RMSNorm, the Q/K/V projections as one MatMul and the output
projection, RoPE from cos/sin inputs, the past KV concatenated and repeated per query head
into one ScaledDotProductAttention, the gated MLP (gate and up one MatMul), made stateful
as the exporter makes every stage (stateful_graph); a mixture of experts' MLP in the
tiled form exporter/moe_block.py traces (every expert stacked, a random router's top-k
routing them), which the CPU plugin runs as GatherMatmuls over the routed experts only.
Its weights are random and already
compressed as NNCF compresses an export's (exporter/compress.py): INT4 in asymmetric
groups, INT8 in the export's ``int8_form`` (zctl.weights.INT8_FORMS), f16 behind a Convert,
or f32; the LM head INT8 in the INT4 and INT8 formats. INT8 in i8 groups (an int8 export's,
by default) is i8 codes [N, K/g, g] behind Convert f16, Multiply by f16 scales
[N, K/g, 1], Reshape [N, K] and Convert f32, g the group ``zctl.weights.int8_group`` picks
as the exporter does (a weight no group divides stays per channel); INT8 per channel (an
int4 export's head, an older or static export's INT8) is u8 codes, u8 zero points and f16
scales behind Convert/Subtract/Multiply. The CPU plugin folds either into its compressed
MatMul. Exact experts (exporter/exact_experts.py) are the i8 groups' form with groups of 32,
in any format. The manifest that
goes with it describes the one stage, so a ``PagedStageRunner`` runs it as it runs a stage
of an export: the same PagedAttention pass, compile properties, bound inputs and block
tables.

Weights are drawn at random a layer at a time (no checkpoint, no export), so a profile
of a 70B model's layer shape needs the memory of the few layers it builds, not the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov
from openvino import opset13 as ops
from openvino.utils.node_factory import NodeFactory

from dataplane.runtime.stateful_graph import add_beam_idx, make_stateful
from dataplane.runtime.weight_graph import i8_group_weight
from zctl.manifest import ExportManifest, ModelSpec, StageSpec
from zctl.weights import (
    EXACT_EXPERT_GROUP,
    INT8_GROUPS,
    WEIGHT_FORMATS,
    check_int8_form,
    default_int8_form,
    int8_group,
)

EPS = 1e-5
ROPE_THETA = 10000.0
INT4_ZERO = 8  # the zero point of every INT4 group (the middle of 0..15)
INT8_ZERO = 128
SCALE = 2e-3  # every group's scale: weights of about +-0.016, activations stay finite
# A change to the graph a profile times bumps controlplane/planner/profile.py's
# GRAPH_VERSION, so that the profiles timed on the old graph are measured again.


@dataclass(frozen=True)
class LayerShape:
    """The geometry of a Llama decoder layer and of the LM head."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    # a mixture of experts (Qwen3-MoE's): every layer's MLP ``experts`` SwiGLU experts of
    # ``expert_intermediate``, each row running its top ``active_experts``; 0: a dense MLP
    experts: int = 0
    active_experts: int = 0
    expert_intermediate: int = 0


class _Weights:
    """Random weights in one format, as the exporter's compression leaves them."""

    def __init__(self, weights: str, group_size: int | None, seed: int,
                 int8_form: str | None = None, exact_experts: bool = False) -> None:
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {weights!r}; expected one of {WEIGHT_FORMATS}")
        if weights == "int4" and not group_size:
            raise ValueError("INT4 weights need a group size")
        self.weights, self.group_size = weights, group_size
        self.int8_form = (check_int8_form(int8_form) if int8_form is not None
                          else default_int8_form(weights))
        self.exact_experts = exact_experts
        self.rng = np.random.default_rng(seed)

    def _bytes(self, count: int) -> np.ndarray:
        return np.frombuffer(self.rng.bytes(count), dtype=np.uint8)

    def _scales(self, shape: list[int], name: str) -> ov.Node:
        return ops.constant(np.full(shape, SCALE, np.float16), name=f"{name}/scale")

    def _int4(self, rows: int, cols: int, name: str, lead: list[int]) -> ov.Output:
        group = self.group_size
        assert group is not None
        if cols % group:
            raise ValueError(f"{name}: {cols} inputs are not a multiple of the INT4 group {group}")
        shape = [*lead, rows, cols // group, group]
        packed = ov.Tensor(ov.Type.u4, shape)
        packed.data[:] = self._bytes(packed.get_byte_size())
        weight = ops.convert(ops.constant(packed, name=name), ov.Type.f16)
        zero = ov.Tensor(ov.Type.u4, [*lead, rows, cols // group, 1])
        zero.data[:] = INT4_ZERO * 17  # two 4-bit zero points a byte
        zero_point = ops.convert(ops.constant(zero, name=f"{name}/zero_point"), ov.Type.f16)
        scaled = ops.multiply(ops.subtract(weight, zero_point),
                              self._scales([*lead, rows, cols // group, 1], name))
        flat = ops.reshape(scaled, ops.constant(np.array([*lead, rows, cols], np.int64)), False)
        return ops.convert(flat, ov.Type.f32).output(0)

    def _int8(self, rows: int, cols: int, name: str, lead: list[int]) -> ov.Output:
        group = int8_group(cols) if self.int8_form == INT8_GROUPS else None
        if group is None:
            return self._u8_channel(rows, cols, name, lead)
        return self._i8_groups(rows, cols, name, lead, group)

    def _i8_groups(self, rows: int, cols: int, name: str, lead: list[int],
                   group: int) -> ov.Output:
        if cols % group:
            raise ValueError(f"{name}: {cols} inputs are not a multiple of the i8 group {group}")
        shape = [*lead, rows, cols // group, group]
        codes = self._bytes(int(np.prod(shape))).view(np.int8).reshape(shape)
        return i8_group_weight(codes, np.full([*shape[:-1], 1], SCALE, np.float16), name)

    def _u8_channel(self, rows: int, cols: int, name: str, lead: list[int]) -> ov.Output:
        data = self._bytes(int(np.prod([*lead, rows, cols]))).reshape(*lead, rows, cols)
        weight = ops.convert(ops.constant(data, name=name), ov.Type.f16)
        zero_point = ops.convert(ops.constant(np.full([*lead, rows, 1], INT8_ZERO, np.uint8),
                                              name=f"{name}/zero_point"), ov.Type.f16)
        scaled = ops.multiply(ops.subtract(weight, zero_point),
                              self._scales([*lead, rows, 1], name))
        return ops.convert(scaled, ov.Type.f32).output(0)

    def matrix(self, rows: int, cols: int, name: str, head: bool = False,
               experts: int = 0) -> ov.Output:
        """A [rows, cols] weight (a MatMul's transposed right side) in this format, or
        ``experts`` of them stacked [experts, rows, cols] (compressed per expert, as NNCF
        compresses an export's stacked experts; in the exact i8 form where the experts are
        exact); the LM head (``head``) in INT8 where the
        decoder layers are INT4 or INT8."""
        fmt = self.weights
        lead = [experts] if experts else []
        if experts and self.exact_experts:  # exporter/exact_experts.py's form, in any format
            return self._i8_groups(rows, cols, name, lead, EXACT_EXPERT_GROUP)
        if head and fmt == "int4":
            fmt = "int8"
        if fmt == "int4":
            return self._int4(rows, cols, name, lead)
        if fmt == "int8":
            return self._int8(rows, cols, name, lead)
        data = self.rng.standard_normal((*lead, rows, cols), np.float32) * np.float32(0.02)
        if fmt == "fp16":
            return ops.convert(ops.constant(data.astype(np.float16), name=name),
                               ov.Type.f32).output(0)
        return ops.constant(data, name=name).output(0)


def _const(values: list[int] | int) -> ov.Node:
    return ops.constant(np.array(values, np.int64))


def _rms_norm(x: ov.Output, hidden: int) -> ov.Output:
    variance = ops.reduce_mean(ops.power(x, ops.constant(np.float32(2.0))), _const([-1]), True)
    inverse = ops.divide(ops.constant(np.float32(1.0)),
                         ops.sqrt(ops.add(variance, ops.constant(np.float32(EPS)))))
    return ops.multiply(ops.constant(np.ones([1, 1, hidden], np.float32)),
                        ops.multiply(x, inverse)).output(0)


def _linear(x: ov.Output, weight: ov.Output) -> ov.Output:
    return ops.matmul(x, weight, False, True).output(0)


def _rotate(x: ov.Output, cos: ov.Output, sin: ov.Output, half: int) -> ov.Output:
    """x * cos + rotate_half(x) * sin, x [B, heads, T, D], cos/sin [B, 1, T, D]."""
    step = _const([1])
    low = ops.slice(x, _const([0]), _const([half]), step, _const([3]))
    high = ops.slice(x, _const([half]), _const([2 * half]), step, _const([3]))
    rotated = ops.concat([ops.multiply(high, ops.constant(np.float32(-1.0))), low], 3)
    return ops.add(ops.multiply(x, cos), ops.multiply(rotated, sin)).output(0)


def _heads(x: ov.Output, heads: int, head_dim: int) -> ov.Output:
    """[B, T, heads * D] -> [B, heads, T, D]."""
    split = ops.reshape(x, _const([0, 0, heads, head_dim]), True)
    return ops.transpose(split, ops.constant(np.array([0, 2, 1, 3], np.int32))).output(0)


def _repeat_kv(kv: ov.Output, shape: LayerShape) -> ov.Output:
    """[B, kv_heads, S, D] -> [B, heads, S, D], each KV head repeated for its query group."""
    groups = shape.heads // shape.kv_heads
    if groups == 1:
        return kv
    dims = ops.shape_of(kv, output_type="i64")
    target = ops.concat([ops.gather(dims, _const([0, 1]), _const(0)), _const([groups]),
                         ops.gather(dims, _const([2, 3]), _const(0))], 0)
    expanded = ops.broadcast(ops.unsqueeze(kv, _const(2)), target)
    return ops.reshape(expanded, _const([0, shape.heads, -1, shape.head_dim]), True).output(0)


def _layer(x: ov.Output, index: int, shape: LayerShape, inputs: dict[str, ov.Output],
           weights: _Weights, past: list[ov.Node], present: list[ov.Output]) -> ov.Output:
    s = shape
    name = f"self.layers.{index}"
    attn = s.heads * s.head_dim
    kv = s.kv_heads * s.head_dim
    h = _rms_norm(x, s.hidden)
    qkv = _linear(h, weights.matrix(attn + 2 * kv, s.hidden, f"{name}.qkv_proj.weight"))
    q, k, v = ops.variadic_split(qkv, _const(-1), _const([attn, kv, kv])).outputs()
    q, k, v = _heads(q, s.heads, s.head_dim), _heads(k, s.kv_heads, s.head_dim), \
        _heads(v, s.kv_heads, s.head_dim)
    cos = ops.unsqueeze(inputs["rope_cos"], _const(1)).output(0)
    sin = ops.unsqueeze(inputs["rope_sin"], _const(1)).output(0)
    half = s.head_dim // 2
    q, k = _rotate(q, cos, sin, half), _rotate(k, cos, sin, half)
    kv_shape = [-1, s.kv_heads, -1, s.head_dim]
    past_key = ops.parameter(kv_shape, ov.Type.f32, name=f"past_key_values.{index}.key")
    past_value = ops.parameter(kv_shape, ov.Type.f32, name=f"past_key_values.{index}.value")
    for param in (past_key, past_value):
        param.output(0).get_tensor().set_names({param.get_friendly_name()})
    key = ops.concat([past_key, k], 2).output(0)
    value = ops.concat([past_value, v], 2).output(0)
    past += [past_key, past_value]
    present += [key, value]
    scale = ops.constant(np.float32(s.head_dim ** -0.5))
    attention = ops.scaled_dot_product_attention(
        q, _repeat_kv(key, s), _repeat_kv(value, s), inputs["attention_mask"], scale)
    merged = ops.reshape(ops.transpose(attention, ops.constant(np.array([0, 2, 1, 3], np.int32))),
                         _const([0, 0, attn]), True)
    x = ops.add(x, _linear(merged.output(0), weights.matrix(s.hidden, attn,
                                                            f"{name}.o_proj.weight"))).output(0)
    h = _rms_norm(x, s.hidden)
    if s.experts:
        return ops.add(x, _experts(h, name, s, weights)).output(0)
    gate_up = _linear(h, weights.matrix(2 * s.intermediate, s.hidden,
                                        f"{name}.gate_up_proj.weight"))
    gate, up = ops.split(gate_up, _const(-1), 2).outputs()
    gate = ops.swish(gate)
    down = weights.matrix(s.hidden, s.intermediate, f"{name}.down_proj.weight")
    return ops.add(x, _linear(ops.multiply(gate, up).output(0), down)).output(0)


def _experts(h: ov.Output, name: str, s: LayerShape, weights: _Weights) -> ov.Output:
    """The sparse MLP in the tiled form exporter/moe_block.py traces and the CPU plugin
    rewrites into GatherMatmuls that compute the routed experts only: the rows [R, H]
    tiled once per expert [E, R, H], three batched MatMuls against the stacked experts, the
    product weighed by a routing tensor [E, B, T, 1] that is zero but at each row's top-k
    experts (softmax, top-k, renormalised, scattered) and summed over the experts."""
    experts, width = s.experts, s.expert_intermediate
    rows = ops.reshape(h, _const([-1, s.hidden]), False)
    tiled = ops.reshape(ops.tile(rows, _const([experts, 1])), _const([experts, -1, s.hidden]),
                        False)
    gate = _linear(tiled.output(0), weights.matrix(width, s.hidden, f"{name}.moe.gate",
                                                   experts=experts))
    up = _linear(tiled.output(0), weights.matrix(width, s.hidden, f"{name}.moe.up",
                                                 experts=experts))
    # Swish without a beta input (opset13.swish adds one), as the plugin's pattern has it
    swish = NodeFactory("opset4").create("Swish", [gate], {})
    out = _linear(ops.multiply(swish, up).output(0),
                  weights.matrix(s.hidden, width, f"{name}.moe.down", experts=experts))
    dims = ops.shape_of(h, output_type="i64")
    batch_tokens = ops.gather(dims, _const([0, 1]), _const(0))
    out = ops.reshape(out, ops.concat([_const([experts]), batch_tokens, _const([s.hidden])], 0),
                      False)
    # the router in INT8 where the experts are INT4, as the export keeps it (and the head)
    router = weights.matrix(experts, s.hidden, f"{name}.moe.router.weight", head=True)
    probs = ops.softmax(_linear(rows.output(0), router), -1)
    top = ops.topk(probs, ops.constant(np.int64(s.active_experts)), -1, "max", "value",
                   ov.Type.i64)
    picked = ops.divide(top.output(0), ops.reduce_sum(top.output(0), _const([-1]), True))
    zeros = ops.broadcast(ops.constant(np.float32(0.0)),
                          ops.concat([ops.gather(ops.shape_of(rows, output_type="i64"),
                                                 _const([0]), _const(0)), _const([experts])],
                                     0))
    dense = ops.scatter_elements_update(zeros, top.output(1), picked, _const(1))
    routing = ops.unsqueeze(ops.reshape(
        ops.transpose(dense, ops.constant(np.array([1, 0], np.int32))),
        ops.concat([_const([experts]), batch_tokens], 0), False), _const(-1))
    return ops.reduce_sum(ops.multiply(out, routing), _const([0]), False).output(0)


def synthetic_model(shape: LayerShape, layers: int, last: bool, weights: str,
                    group_size: int | None = None, seed: int = 0,
                    int8_form: str | None = None, exact_experts: bool = False) -> ov.Model:
    """The stateful graph of a middle stage of ``layers`` decoder layers of ``shape`` (with
    ``last``: the final norm and LM head after them), random weights in ``weights``, their
    INT8 in ``int8_form`` (None: the form an export in ``weights`` is written with now), a
    mixture of experts' in their exact i8 form with ``exact_experts``."""
    if layers < 1:
        raise ValueError(f"a synthetic stage has at least one layer, got {layers}")
    if shape.heads % shape.kv_heads or shape.head_dim % 2:
        raise ValueError(f"{shape}: heads must be a multiple of KV heads, head_dim even")
    draw = _Weights(weights, group_size, seed, int8_form, exact_experts)
    names = ["hidden_states", "attention_mask", "rope_cos", "rope_sin"]
    params = [ops.parameter([-1, -1, shape.hidden], ov.Type.f32),
              ops.parameter([-1, 1, -1, -1], ov.Type.f32),
              ops.parameter([-1, -1, shape.head_dim], ov.Type.f32),
              ops.parameter([-1, -1, shape.head_dim], ov.Type.f32)]
    if last:
        names.append("logits_idx")
        params.append(ops.parameter([-1], ov.Type.i64))
    for param, name in zip(params, names, strict=True):
        param.set_friendly_name(name)
        param.output(0).get_tensor().set_names({name})
    inputs = {name: p.output(0) for name, p in zip(names, params, strict=True)}
    past: list[ov.Node] = []
    present: list[ov.Output] = []
    x = inputs["hidden_states"]
    for index in range(layers):
        x = _layer(x, index, shape, inputs, draw, past, present)
    if last:
        picked = ops.gather(x, inputs["logits_idx"], _const(1)).output(0)
        x = _linear(_rms_norm(picked, shape.hidden),
                    draw.matrix(shape.vocab, shape.hidden, "lm_head.weight", head=True))
    outputs = [x, *present]
    out_names = ["logits" if last else "hidden_states"]
    out_names += [f"present.{i // 2}.{'key' if i % 2 == 0 else 'value'}"
                  for i in range(len(present))]
    for output, name in zip(outputs, out_names, strict=True):
        output.get_tensor().set_names({name})
    model = ov.Model([ops.result(o) for o in outputs], [*params, *past], "synthetic-stage")
    pairs = [(p.get_friendly_name(), n) for p, n in zip(past, out_names[1:], strict=True)]
    add_beam_idx(model, [p for p, _ in pairs])
    make_stateful(model, pairs, "hidden_states")
    return model


def synthetic_manifest(shape: LayerShape, layers: int, last: bool, weights: str,
                       group_size: int | None = None,
                       int8_form: str | None = None,
                       exact_experts: bool = False) -> ExportManifest:
    """The manifest of a one-stage export holding ``synthetic_model``'s stage."""
    half = shape.head_dim // 2
    inv_freq = tuple(float(ROPE_THETA ** (-i / half)) for i in range(half))
    model = ModelSpec(
        name="synthetic", architecture="llama", num_layers=layers, hidden_size=shape.hidden,
        num_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        vocab_size=shape.vocab, rope_inv_freq=inv_freq, rope_attention_scaling=1.0,
        max_position_embeddings=0, bos_token_id=None, eos_token_ids=(),
        experts=shape.experts, active_experts=shape.active_experts,
        expert_intermediate=shape.expert_intermediate)
    inputs = ("hidden_states", "attention_mask", "rope_cos", "rope_sin",
              *(("logits_idx",) if last else ()), "beam_idx")
    stage = StageSpec(
        index=0, layer_start=0, layer_end=layers, xml="", bin="", inputs=inputs,
        outputs=("logits" if last else "hidden_states",),
        state_names=tuple(f"past_key_values.{i}.{kind}" for i in range(layers)
                          for kind in ("key", "value")),
        first=False, last=last)
    return ExportManifest(model=model, stages=(stage,), weight_format=weights,
                          group_size=group_size if weights == "int4" else None,
                          activation_dtype="f32", beam_idx=True, versions={},
                          int8_form=int8_form or default_int8_form(weights),
                          exact_experts=exact_experts)
