"""OpenVINO graph work for a stage: trace and name its I/O (its KV is made OpenVINO state
by dataplane.runtime.stateful_graph, which a node's profile shares).
"""

from __future__ import annotations

import openvino as ov
import torch

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
    cos = torch.randn(batch, tokens, shape.rope_width)
    sin = torch.randn(batch, tokens, shape.rope_width)
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


def stamp_rt_info(model: ov.Model, info: dict[str, str]) -> None:
    for key, value in info.items():
        model.set_rt_info(str(value), ["zctl", key])
