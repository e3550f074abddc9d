"""OpenVINO graph work for a stage: trace, name I/O, inject beam_idx, make KV stateful.

The order matters (see NOTES.md): a ``Gather(past, beam_idx)`` is put in front of
every past-KV input first, then past/present pairs become ReadValue/Assign, then each
ReadValue gets a zero initialiser whose batch dimension follows the stage's main input.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import torch
from openvino import opset13 as ops

from exporter.stage_module import DecoderShape, StageModule


def io_names(first: bool, last: bool) -> tuple[list[str], list[str]]:
    inputs = ["input_ids" if first else "hidden_states", "attention_mask", "rope_cos", "rope_sin"]
    if last:
        inputs.append("logits_idx")
    outputs = ["logits" if last else "hidden_states"]
    return inputs, outputs


def kv_names(layer_start: int, layer_end: int) -> list[tuple[str, str]]:
    """(past, present) name pairs, key then value per layer, by global layer index."""
    pairs = []
    for layer in range(layer_start, layer_end):
        for kind in ("key", "value"):
            pairs.append((f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}"))
    return pairs


def example_inputs(
    shape: DecoderShape, num_layers: int, first: bool, last: bool, tokens: int = 3, past: int = 2,
    kv_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, ...]:
    """Inputs for tracing: more than one token *and* a non-empty past, so no branch freezes."""
    batch = 1
    x = (
        torch.randint(0, shape.vocab_size, (batch, tokens), dtype=torch.int64)
        if first
        else torch.randn(batch, tokens, shape.hidden_size)
    )
    mask = torch.zeros(batch, 1, tokens, past + tokens)
    cos = torch.randn(batch, tokens, shape.head_dim)
    sin = torch.randn(batch, tokens, shape.head_dim)
    extra: tuple[torch.Tensor, ...] = (torch.arange(tokens, dtype=torch.int64),) if last else ()
    kv = tuple(
        torch.randn(batch, shape.num_kv_heads, past, shape.head_dim).to(kv_dtype)
        for _ in range(2 * num_layers)
    )
    return (x, mask, cos, sin, *extra, *kv)


def convert_stage(module: StageModule, shape: DecoderShape, layer_start: int, layer_end: int,
                  first: bool, last: bool) -> ov.Model:
    """Trace the module and give every input and output its stable name."""
    example = example_inputs(shape, layer_end - layer_start, first, last,
                             kv_dtype=module.layers[0].kv_dtype or torch.float32)
    with torch.no_grad():
        # Trace ourselves: torch's default trace check re-runs the module twice more.
        traced = torch.jit.trace(module, example, check_trace=False, strict=False)
        model = ov.convert_model(traced, example_input=example)
    inputs, outputs = io_names(first, last)
    pairs = kv_names(layer_start, layer_end)
    in_names = inputs + [past for past, _ in pairs]
    out_names = outputs + [present for _, present in pairs]
    if len(model.inputs) != len(in_names) or len(model.outputs) != len(out_names):
        raise RuntimeError(
            f"traced stage has {len(model.inputs)} inputs / {len(model.outputs)} outputs, "
            f"expected {len(in_names)} / {len(out_names)}"
        )
    for port, name in zip(model.inputs, in_names, strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, out_names, strict=True):
        port.get_tensor().set_names({name})
    return model


def add_beam_idx(model: ov.Model, past_names: list[str]) -> None:
    """Insert Gather(past, beam_idx, axis=0) before every consumer of each past-KV input."""
    beam_idx = ops.parameter([-1], ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    axis = ops.constant(np.int64(0))
    for name in past_names:
        port = model.input(name)
        consumers = list(port.get_target_inputs())
        gather = ops.gather(port, beam_idx, axis)
        for consumer in consumers:
            consumer.replace_source_output(gather.output(0))
    model.add_parameters([beam_idx])
    model.validate_nodes_and_infer_types()


def make_stateful(model: ov.Model, pairs: list[tuple[str, str]], batch_input: str) -> None:
    """Turn past/present pairs into ReadValue/Assign with zero initial values."""
    from openvino._offline_transformations import apply_make_stateful_transformation

    apply_make_stateful_transformation(model, dict(pairs))
    batch = ops.gather(
        ops.shape_of(model.input(batch_input), output_type="i64"),
        ops.constant(np.array([0], dtype=np.int64)),
        ops.constant(np.int64(0)),
    )
    for op in model.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        pshape = op.get_output_partial_shape(0)
        dims = []
        for axis_index, dim in enumerate(pshape):
            if axis_index == 0:
                dims.append(batch.output(0))
            elif axis_index == 2:
                dims.append(ops.constant(np.array([0], dtype=np.int64)).output(0))
            else:
                dims.append(ops.constant(np.array([dim.get_length()], dtype=np.int64)).output(0))
        zero = ops.constant(np.array(0, dtype=np.float32)).output(0)
        if op.get_output_element_type(0) != ov.Type.f32:
            zero = ops.convert(zero, op.get_output_element_type(0)).output(0)
        op.set_arguments([ops.broadcast(zero, ops.concat(dims, axis=0))])
    model.validate_nodes_and_infer_types()


def stamp_rt_info(model: ov.Model, info: dict[str, str]) -> None:
    for key, value in info.items():
        model.set_rt_info(str(value), ["zctl", key])
