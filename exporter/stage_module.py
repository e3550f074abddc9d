"""A traceable torch module for one stage of a Llama-family decoder.

Attention is written out by hand so ``torch.jit.trace`` sees no data-dependent
control flow: RoPE cos/sin and the additive attention mask come in as inputs, the
past KV comes in as explicit tensors and the present KV goes out (the graph is made
stateful afterwards), and attention stays a single ``scaled_dot_product_attention``
call so OpenVINO's SDPA fusions apply.

A model with attention sinks (gpt-oss) has a learned logit per head that joins each
query's softmax denominator and is dropped after: its attention is written out as Hugging
Face's eager form (scores, the sinks concatenated as one more column, softmax, that column
sliced off), which OpenVINO's PyTorch frontend fuses into one SDPA taking the sinks as its
sixth input, the form the CPU plugin's stateful SDPA and the PagedAttention pass take.

A model whose sliding-window layers turn with RoPE frequencies of their own (Gemma 3)
takes one table twice as wide: the host computes it from the global layers' frequencies
followed by the sliding layers' (dataplane.runtime.rope.stage_frequencies), and each
layer takes its half. Its sliding layers mask the keys older than the window, in the
graph, from the stage's mask (see ``window_mask``), and take the mask's last columns, as
many as their KV holds: a stateful stage may trim a sliding layer's state to its window
from the front (dataplane.runtime.kv.sliding_states), one mask serving every layer. A
model with
partial RoPE (``rotary_dim``) takes tables that wide and turns only that many of each
head's first dimensions (``apply_rope``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from dataplane.runtime.kv.masks import MASK_MIN
from exporter.gpt_oss_moe_block import ClampedSwiGLU, GptOssMoeBlock
from exporter.moe_block import SparseMoeBlock
from exporter.stored_weights import StoredEmbedding, StoredLinear

Activation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class DecoderShape:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3)
    norm_plus_one: bool = False  # every RMSNorm scales by (1 + weight) (Gemma)
    # norms on the attention's and the MLP's outputs too, and the MLP's own before it, as
    # pre_feedforward_layernorm (Gemma 3; Llama's post_attention_layernorm is its pre-MLP)
    sandwich_norms: bool = False
    activation: Activation = "silu"  # the gated MLP's: SwiGLU, or GeGLU (Gemma)
    embed_scale: float = 1.0  # the embedding multiplied by it, in the weights' dtype
    attention_scale: float | None = None  # None: head_dim ** -0.5
    sliding_window: int = 0  # a sliding layer's query sees this many latest keys (itself too)
    sliding_layers: tuple[int, ...] = ()  # the layers (global indices) whose window slides
    local_rope: bool = False  # sliding layers turn with frequencies of their own
    # a mixture of experts (Qwen3-MoE) in sparse_layers (global indices): each token runs
    # active_experts of experts SwiGLU MLPs expert_intermediate wide (exporter.moe_block)
    experts: int = 0
    active_experts: int = 0
    expert_intermediate: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to one
    sparse_layers: tuple[int, ...] = ()
    # gpt-oss's experts (exporter.gpt_oss_moe_block): a biased router, softmax over the top-k
    # logits, biased clamped-SwiGLU experts; None: Qwen3-MoE's (exporter.moe_block)
    clamped_swiglu: ClampedSwiGLU | None = None
    attention_sinks: bool = False  # a learned logit per head in each softmax (gpt-oss)
    # partial RoPE (Phi-4-mini's partial_rotary_factor): RoPE turns the first rotary_dim
    # dimensions of each query and key head, the rest pass through; 0: the whole head
    rotary_dim: int = 0

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    @property
    def rotated(self) -> int:
        """How many dimensions of each head RoPE turns."""
        return self.rotary_dim or self.head_dim

    @property
    def rope_width(self) -> int:
        """The width of the rope_cos/rope_sin inputs: one table, or two side by side."""
        return self.rotated * (2 if self.local_rope else 1)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> StoredLinear:
    return StoredLinear(weight, bias)


def _norm(weight: torch.Tensor, shape: DecoderShape) -> RMSNorm:
    """An RMSNorm of ``weight`` in float32, Gemma's ``1 + weight`` (summed once here, in
    float32 as Hugging Face sums it at every call) where the family says so."""
    weight = weight.float()
    return RMSNorm(1.0 + weight if shape.norm_plus_one else weight, shape.rms_norm_eps)


def split_rope(table: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global and the local [.., head_dim] tables of a two-table RoPE input.

    The host's table is cat(f, f) of frequencies f = (global, local), so its quarters are
    global, local, global, local: each layer's table is two of them."""
    half = head_dim // 2
    global_ = torch.cat((table[..., :half], table[..., head_dim:head_dim + half]), dim=-1)
    local = torch.cat((table[..., half:head_dim], table[..., head_dim + half:]), dim=-1)
    return global_, local


def window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """The additive mask [B, 1, T, S] of a sliding layer: each query's seen keys (the
    entries at 0) but its ``window`` latest, masked. A query sees its context in slot order
    (the runners append a sequence's slots in position order and mask what a rewind drops),
    so its latest seen keys are its ``window`` latest positions, itself included, as
    Hugging Face's sliding window has them."""
    seen = (mask == 0).to(mask.dtype)
    later = seen.sum(-1, keepdim=True) - seen.cumsum(-1) + seen  # seen slots from here on
    return torch.where(later <= window, mask, torch.full_like(mask, MASK_MIN))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shape: DecoderShape
               ) -> torch.Tensor:
    """RoPE on heads x [B, heads, T, head_dim] with cos/sin [B, 1, T, rotated]: the first
    ``shape.rotated`` dimensions of each head turn, the rest pass through (partial RoPE, as
    Hugging Face's Phi-3 splits q_rot and q_pass); the whole head as before otherwise."""
    rotated = shape.rotated
    if rotated == shape.head_dim:
        return x * cos + _rotate_half(x) * sin
    turn, keep = x[..., :rotated], x[..., rotated:]
    return torch.cat((turn * cos + _rotate_half(turn) * sin, keep), dim=-1)


def _attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
               s: DecoderShape, fold_groups: bool, sinks: torch.Tensor | None = None
               ) -> torch.Tensor:
    """SDPA of q [B, heads, T, D] over key/value [B, kv_heads, S, D] -> [B, heads, T, D].

    With grouped KV heads the KV is repeated per query head (the pattern the CPU plugin
    fuses with a stateful KV cache), or, with ``fold_groups`` (the static graph, which has
    no KV state to fuse with), each KV head's query group is folded into the query length
    instead, so the KV of every context slot is never copied per head. ``sinks`` [heads]:
    each head's sink logit joins its softmax (``_attention_with_sinks``).
    """
    batch, _, tokens, _ = q.shape
    groups = s.num_heads // s.num_kv_heads
    if sinks is not None and fold_groups:
        raise ValueError("attention sinks in a static graph are not implemented")
    if groups > 1 and fold_groups:
        q = q.reshape(batch, s.num_kv_heads, groups * tokens, s.head_dim)
        attn = F.scaled_dot_product_attention(
            q, key, value, attn_mask=mask.repeat(1, 1, groups, 1), scale=s.scale)
        return attn.reshape(batch, s.num_heads, tokens, s.head_dim)
    if groups > 1:
        slots = key.shape[2]
        key = key[:, :, None].expand(batch, s.num_kv_heads, groups, slots, s.head_dim)
        key = key.reshape(batch, s.num_heads, slots, s.head_dim)
        value = value[:, :, None].expand(batch, s.num_kv_heads, groups, slots, s.head_dim)
        value = value.reshape(batch, s.num_heads, slots, s.head_dim)
    if sinks is not None:
        return _attention_with_sinks(q, key, value, mask, s.scale, sinks)
    return F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=s.scale)


def _attention_with_sinks(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          mask: torch.Tensor, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax has one more column per head, its sink logit, dropped after
    it (the weights of a row sum to less than one). Written as Hugging Face's eager
    gpt-oss attention: the exact op sequence (MatMul, scale, mask, Concat of the broadcast
    sinks, ReduceMax, Subtract, Softmax, Slice, MatMul) that OpenVINO fuses into one SDPA
    with a sinks input."""
    scores = torch.matmul(q, key.transpose(2, 3)) * scale + mask
    column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    scores = torch.cat([scores, column], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    weights = F.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1]
    return torch.matmul(weights, value)


def _stacked_linear(get: Callable[[str], torch.Tensor | None], names: tuple[str, ...]
                    ) -> StoredLinear:
    """One Linear whose output rows are those of ``names``' projections in turn (a bias
    only when one of them has one: the others' rows get zeros)."""
    weights = [get(f"{name}.weight") for name in names]
    biases = [get(f"{name}.bias") for name in names]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.float() if b is not None else torch.zeros(w.shape[0])
                          for w, b in zip(weights, biases, strict=True)])
    return _linear(torch.cat(weights), bias)


def _moe_block(shape: DecoderShape, get: Callable[[str], torch.Tensor | None]
               ) -> SparseMoeBlock | GptOssMoeBlock:
    """A sparse layer's mixture of experts (``get``: its tensors by names under ``mlp.``)."""
    if shape.clamped_swiglu is None:
        return SparseMoeBlock(get("gate.weight"), get("experts.gate_up_proj"),
                              get("experts.down_proj"), shape.active_experts,
                              shape.norm_topk_prob)
    tensors = {name: get(name) for name in (
        "router.weight", "router.bias", "experts.gate_up_proj", "experts.gate_up_proj_bias",
        "experts.down_proj", "experts.down_proj_bias")}
    missing = [name for name, tensor in tensors.items() if tensor is None]
    if missing:
        raise ValueError(f"the mixture of experts lacks {', '.join('mlp.' + m for m in missing)}")
    return GptOssMoeBlock(*tensors.values(), shape.active_experts, shape.clamped_swiglu)


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape, get: Callable[[str], torch.Tensor | None],
                 new_kv_only: bool = False, kv_dtype: torch.dtype | None = None,
                 fuse_projections: bool = True, sliding: bool = False,
                 sparse: bool = False) -> None:
        super().__init__()
        self.shape = shape
        self.new_kv_only = new_kv_only
        self.sliding = sliding  # the layer's window slides (its mask and RoPE table)
        self.kv_dtype = kv_dtype  # the KV's type at the I/O when it is not the activations'.
        self.input_norm = _norm(get("input_layernorm.weight"), shape)
        # the attention's output norm (sandwich norms) or, Llama's way, the MLP's input norm
        self.post_norm = _norm(get("post_attention_layernorm.weight"), shape)
        self.pre_mlp_norm = self.post_mlp_norm = None
        if shape.sandwich_norms:
            self.pre_mlp_norm = _norm(get("pre_feedforward_layernorm.weight"), shape)
            self.post_mlp_norm = _norm(get("post_feedforward_layernorm.weight"), shape)
        attn, mlp = "self_attn.", "mlp."
        # Fused: Q, K and V one MatMul, gate and up another (4 MatMuls a layer, not 7).
        # Every output row keeps its own weights (and, compressed, its own scales), so the
        # results are bit for bit those of the separate projections; a one-token step runs
        # 3 fewer MatMul nodes a layer, and the plugin quantizes their input once, not 5 times
        # (docs/measurements/single-node.md).
        kv_size = shape.num_kv_heads * shape.head_dim
        self.qkv_sizes = (shape.num_heads * shape.head_dim, kv_size, kv_size)
        self.qkv_proj = self.gate_up_proj = None
        # a sparse layer's MLP: the mixture of experts, in place of the dense MLP
        self.moe = _moe_block(shape, lambda name: get(mlp + name)) if sparse else None
        self.sinks: torch.Tensor | None
        self.register_buffer("sinks", get(attn + "sinks").float() if shape.attention_sinks
                             else None)
        if fuse_projections:
            self.qkv_proj = _stacked_linear(get, tuple(attn + p for p in ("q_proj", "k_proj",
                                                                          "v_proj")))
            if not sparse:
                self.gate_up_proj = _stacked_linear(get, (mlp + "gate_proj", mlp + "up_proj"))
        else:
            self.q_proj = _linear(get(attn + "q_proj.weight"), get(attn + "q_proj.bias"))
            self.k_proj = _linear(get(attn + "k_proj.weight"), get(attn + "k_proj.bias"))
            self.v_proj = _linear(get(attn + "v_proj.weight"), get(attn + "v_proj.bias"))
            if not sparse:
                self.gate_proj = _linear(get(mlp + "gate_proj.weight"),
                                         get(mlp + "gate_proj.bias"))
                self.up_proj = _linear(get(mlp + "up_proj.weight"), get(mlp + "up_proj.bias"))
        self.q_norm = self.k_norm = None
        if shape.qk_norm:  # after the split: the fused MatMul stays one
            self.q_norm = _norm(get(attn + "q_norm.weight"), shape)
            self.k_norm = _norm(get(attn + "k_norm.weight"), shape)
        self.o_proj = _linear(get(attn + "o_proj.weight"), get(attn + "o_proj.bias"))
        if not sparse:
            self.down_proj = _linear(get(mlp + "down_proj.weight"), get(mlp + "down_proj.bias"))

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is None:
            return self.q_proj(h), self.k_proj(h), self.v_proj(h)
        q, k, v = self.qkv_proj(h).split(self.qkv_sizes, dim=-1)
        return q, k, v

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(h)
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(h), self.up_proj(h)
        else:
            gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        if self.shape.activation == "gelu_tanh":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(F.silu(gate) * up)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_key: torch.Tensor,
        past_value: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        batch, tokens = x.shape[0], x.shape[1]
        q, k, v = self._qkv(self.input_norm(x))
        q = q.reshape(batch, tokens, s.num_heads, s.head_dim)
        k = k.reshape(batch, tokens, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.reshape(batch, tokens, s.num_kv_heads, s.head_dim).transpose(1, 2)
        cos4, sin4 = cos.unsqueeze(1), sin.unsqueeze(1)
        q = apply_rope(q, cos4, sin4, s)
        k = apply_rope(k, cos4, sin4, s)
        if self.kv_dtype is not None:  # e.g. an f16 host KV: compute in the activations' type
            past_key, past_value = past_key.to(k.dtype), past_value.to(v.dtype)
        key = torch.cat((past_key, k), dim=2)
        value = torch.cat((past_value, v), dim=2)
        if self.sliding:  # its KV may hold fewer slots than the stage's mask: its last ones
            mask = mask[:, :, :, mask.shape[-1] - key.shape[2]:]
        attn = _attention(q, key, value, mask, s, fold_groups=self.new_kv_only, sinks=self.sinks)
        attn = attn.transpose(1, 2).reshape(batch, tokens, s.num_heads * s.head_dim)
        if self.pre_mlp_norm is not None and self.post_mlp_norm is not None:
            x = x + self.post_norm(self.o_proj(attn))
            x = x + self.post_mlp_norm(self._mlp(self.pre_mlp_norm(x)))
        else:
            x = x + self.o_proj(attn)
            x = x + self._mlp(self.post_norm(x))
        if self.new_kv_only:
            if self.kv_dtype is not None:
                k, v = k.to(self.kv_dtype), v.to(self.kv_dtype)
            return x, k, v
        return x, key, value


class StageModule(nn.Module):
    """Layers [layer_start, layer_end) plus the embedding (first stage) or norm + LM head (last).

    forward(x, attention_mask, rope_cos, rope_sin, [logits_idx], *past) ->
    (hidden_states | logits, *present), past/present ordered key, value per layer;
    ``new_kv_only``: present holds only the step's new slots (the static export);
    ``kv_dtype``: past and present KV in that type (the static export's f16 host KV).
    """

    def __init__(
        self,
        shape: DecoderShape,
        layer_start: int,
        layer_end: int,
        first: bool,
        last: bool,
        get: Callable[[str], torch.Tensor | None],
        new_kv_only: bool = False,
        kv_dtype: torch.dtype | None = None,
        fuse_projections: bool = True,
    ) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.shape = shape
        self.embed: StoredEmbedding | None = None
        if first:
            self.embed = StoredEmbedding(get("model.embed_tokens.weight"))
        scaled = first and shape.embed_scale != 1.0
        self.register_buffer("embed_scale", torch.tensor(shape.embed_scale) if scaled else None)
        self.layers = nn.ModuleList(
            DecoderLayer(shape, lambda name, i=i: get(f"model.layers.{i}.{name}"), new_kv_only,
                         kv_dtype, fuse_projections, sliding=i in shape.sliding_layers,
                         sparse=i in shape.sparse_layers)
            for i in range(layer_start, layer_end)
        )
        if last:
            self.norm = _norm(get("model.norm.weight"), shape)
            self.lm_head = _linear(get("lm_head.weight"), None)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.last:
            logits_idx, past = rest[0], rest[1:]
        else:
            logits_idx, past = None, rest
        hidden = x
        if self.embed is not None:
            hidden = self.embed(x)
            if self.embed_scale is not None:  # as Hugging Face: the scale in the weights' dtype
                hidden = hidden * self.embed_scale.to(hidden.dtype)
        rotated = self.shape.rotated
        mask_local, cos_local, sin_local = mask, cos, sin  # the sliding layers'
        if self.shape.local_rope:
            (cos, cos_local), (sin, sin_local) = split_rope(cos, rotated), split_rope(sin, rotated)
        if any(layer.sliding for layer in self.layers):
            mask_local = window_mask(mask, self.shape.sliding_window)
        present: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            inputs = (mask_local, cos_local, sin_local) if layer.sliding else (mask, cos, sin)
            hidden, key, value = layer(hidden, *inputs, past[2 * i], past[2 * i + 1])
            present += [key, value]
        if self.last:
            hidden = self.norm(hidden.index_select(1, logits_idx))
            hidden = self.lm_head(hidden)
        return (hidden, *present)
