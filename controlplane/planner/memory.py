"""What a stage holds in memory, for a shape in a weight format, before any export.

The figures are placement's (controlplane/placement.py): weights times the runtime
overhead of compiled-model buffers, and a KV reserve per layer for ``context`` tokens of
each stream (a sliding-window layer's for what it keeps: its window and margin). Stage 0
also holds the embedding, the last stage the LM head.
"""

from __future__ import annotations

from controlplane.placement import DEFAULT_HEADROOM, RUNTIME_OVERHEAD, LayerCost
from controlplane.planner.shape import ModelShape
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.kv.blocks import CPU_BLOCK_TOKENS, SlidingWindow
from zctl.weights import (
    EXACT_EXPERT_BYTES_PER_WEIGHT,
    check_weight_format,
    decoder_bytes_per_weight,
    default_int8_form,
    embedding_bytes_per_weight,
)

DEFAULT_CONTEXT = 4096  # tokens of KV reserved per stream, as LayerCost.from_export does
KV_BYTES_PER_VALUE = 2  # f16, as placement reserves (fast numerics keep u8: half of it)


def layer_weight_bytes(shape: ModelShape, weights: str, int8_form: str | None = None,
                       exact_experts: bool = False) -> float:
    """Bytes one decoder layer's weights take in ``weights``: INT4 in the shape's groups,
    INT8 with its scales in ``int8_form`` (by default the form an export is written with);
    with ``exact_experts`` a mixture of experts' weights in their exact i8 form instead
    (zctl.weights.EXACT_EXPERT_BYTES_PER_WEIGHT)."""
    check_weight_format(weights)
    group = shape.group_size() if weights == "int4" else None
    form = int8_form or default_int8_form(weights)
    total = sum(count * decoder_bytes_per_weight(weights, k, group, form)
                for k, count in shape.layer_weights_by_inputs().items())
    if exact_experts:
        total += sum(count * (EXACT_EXPERT_BYTES_PER_WEIGHT
                              - decoder_bytes_per_weight(weights, k, group, form))
                     for k, count in shape.expert_weights_by_inputs().items())
    return total


def embedding_bytes(shape: ModelShape, weights: str, int8_form: str | None = None) -> float:
    """Bytes of the embedding (stage 0), and as many of the LM head (the last stage): INT8
    with its scales in the int4 and int8 formats (``int8_form``, as ``layer_weight_bytes``)."""
    check_weight_format(weights)
    return shape.embedding_weights() * embedding_bytes_per_weight(weights, shape.hidden,
                                                                  int8_form)


def resident_layer_bytes(shape: ModelShape, weights: str, exact_experts: bool = False) -> int:
    """Memory one decoder layer needs once compiled: its weights and the runtime's buffers."""
    return int(layer_weight_bytes(shape, weights, exact_experts=exact_experts)
               * RUNTIME_OVERHEAD)


def stage_cost(shape: ModelShape, weights: str, layer_bytes: int | None = None,
               context: int = DEFAULT_CONTEXT, streams: int = 1,
               kv_bytes_per_value: float = KV_BYTES_PER_VALUE) -> LayerCost:
    """Placement's ``LayerCost`` for ``shape`` in ``weights``: ``layer_bytes`` (resident, as
    a node's profile measured it; default: estimated), the embedding and head with the
    runtime overhead, and KV for ``streams`` streams of ``context`` tokens."""
    if context < 1 or streams < 1:
        raise ValueError(f"context and streams must be >= 1, got {context} and {streams}")
    extra = int(embedding_bytes(shape, weights) * RUNTIME_OVERHEAD)
    tokens = shape.kv_tokens_per_layer(context, sliding_kept_tokens(shape.sliding_window))
    kv = int(shape.kv_bytes_per_token(kv_bytes_per_value) * tokens * streams)
    per_layer = layer_bytes if layer_bytes is not None else resident_layer_bytes(shape, weights)
    return LayerCost(per_layer, first_extra=extra, last_extra=extra, kv_bytes_per_layer=kv,
                     overhead=1.0)


def sliding_kept_tokens(window: int) -> int:
    """Tokens a sliding layer of ``window`` keeps of a stream on a paged stage (the
    cluster's default): its window, the deepest rewind's margin and a step's token, over
    block edges (dataplane.runtime.kv.blocks.SlidingWindow); 0 without a window."""
    if window < 1:
        return 0
    bound = SlidingWindow(window, RuntimeSpec.sliding_margin, CPU_BLOCK_TOKENS).blocks_bound(1)
    return bound * CPU_BLOCK_TOKENS


def model_bytes(shape: ModelShape, cost: LayerCost) -> int:
    """Memory the whole model needs on one node (every layer, embedding and head)."""
    return cost.stage_bytes(0, shape.num_layers, shape.num_layers)


def usable_bytes(free_memory: int, headroom: float = DEFAULT_HEADROOM) -> int:
    """What a node with ``free_memory`` bytes free gives a stage (placement's headroom)."""
    return int(free_memory * headroom)


def stage_need(cost: LayerCost, count: int, first: bool, last: bool) -> int:
    """Memory a stage of ``count`` layers needs as stage 0 (``first``), the last stage
    (``last``), both or neither (placement's ``LayerCost.stage_bytes`` of such a range)."""
    start = 0 if first else 1
    end = start + count
    return cost.stage_bytes(start, end, end if last else end + 1)


def max_layers(cost: LayerCost, usable: int, num_layers: int, first: bool, last: bool) -> int:
    """The most layers (up to ``num_layers``) a node with ``usable`` bytes holds in a role;
    0 when not even one fits."""
    low, high = 0, num_layers
    while low < high:  # the largest count that fits (the need grows with the count)
        mid = (low + high + 1) // 2
        if stage_need(cost, mid, first, last) <= usable:
            low = mid
        else:
            high = mid - 1
    return low
