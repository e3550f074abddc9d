"""gpt-oss's mixture of experts, in the form OpenVINO's CPU plugin runs sparsely.

gpt-oss routes each row by a linear router *with a bias*, takes its top-k router logits
and a softmax over those k values (Qwen3-MoE's takes the softmax first, over every
expert). Each expert is a *clamped* SwiGLU with biases: gate_up = x W_gu + b_gu (Hugging
Face stores W_gu [experts, hidden, 2 * intermediate] with gate and up *interleaved*:
gate the even columns, up the odd ones), gate = min(gate, limit), up = clamp(up, -limit,
limit), out = ((up + 1) * gate * sigmoid(alpha * gate)) W_down + b_down.

The block is traced in the "tiled" form OpenVINO 2026.4's
ConvertTiledMoeBlockTo2GatherMatmuls recognises (written for this model): the rows tiled once per expert, ONE
batched MatMul against the experts' stacked gate-and-up weights [experts, 2 * intermediate,
hidden] (transpose_b) plus a constant bias, two Slices of it (the up half: Clamp, Add 1;
the gate half: Minimum, Swish with beta alpha), their product, the down MatMul plus its
constant bias, then a routing tensor zero but at each row's chosen experts and a sum over
the experts. The plugin rewrites it into two GatherMatmul nodes (each with its bias) fed
by the top-k indices, so a step computes and reads only the experts its rows chose; the
stacked weights stay ordinary MatMul constants that NNCF compresses.

The gate and up rows stay interleaved, sliced with step 2 as Hugging Face does. Reordered
into two contiguous halves (gate rows first) the pattern did not match on 2026.4.1 (no
GatherMatmul: every expert computed); we think the plugin merges two contiguous Slices of
one tensor into a split before the MoE pass runs. x * sigmoid(alpha * x) is already
Swish(x, alpha) in the converted graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from exporter.moe_block import tile_rows, weigh_experts
from exporter.stored_weights import StoredLinear, computed


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: its sigmoid gain ``alpha`` and clamp ``limit``."""

    alpha: float
    limit: float


class GptOssMoeBlock(nn.Module):
    """Router weight [experts, hidden] and bias [experts]; gate_up [experts, hidden,
    2 * intermediate] (interleaved) and its bias [experts, 2 * intermediate]; down
    [experts, intermediate, hidden] and its bias [experts, hidden]: as Hugging Face's
    GptOssMLP holds them."""

    def __init__(self, router: torch.Tensor, router_bias: torch.Tensor, gate_up: torch.Tensor,
                 gate_up_bias: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor,
                 active: int, activation: ClampedSwiGLU) -> None:
        super().__init__()
        experts, hidden, rows = gate_up.shape
        intermediate = rows // 2
        wanted = {"router": (router, (experts, hidden)), "router bias": (router_bias, (experts,)),
                  "gate_up bias": (gate_up_bias, (experts, rows)),
                  "down": (down, (experts, intermediate, hidden)),
                  "down bias": (down_bias, (experts, hidden))}
        wrong = [f"{name} {tuple(t.shape)} (expected {shape})"
                 for name, (t, shape) in wanted.items() if tuple(t.shape) != shape]
        if wrong or rows % 2:
            raise ValueError(f"expert weights of unmatched shapes: gate_up {tuple(gate_up.shape)}, "
                             + ", ".join(wrong))
        self.experts, self.active, self.activation = experts, active, activation
        self.intermediate = intermediate
        # a module of its own, so its MatMul is named (compress.py keeps it out of INT4)
        self.router = StoredLinear(router, router_bias)
        # [experts, 2 * intermediate, hidden]: gate and up rows interleaved, as stored; the
        # weights in their stored type (exporter.stored_weights), the biases float32
        self.gate_up = nn.Parameter(gate_up.transpose(1, 2).contiguous(), requires_grad=False)
        self.gate_up_bias = nn.Parameter(gate_up_bias.float().unsqueeze(1).contiguous(),
                                         requires_grad=False)
        self.down = nn.Parameter(down.transpose(1, 2).contiguous(), requires_grad=False)
        self.down_bias = nn.Parameter(down_bias.float().unsqueeze(1).contiguous(),
                                      requires_grad=False)

    def route(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k weights and expert indices [rows, k], as Hugging Face's router:
        the top-k logits, then a softmax over those k."""
        top, chosen = torch.topk(self.router(rows), self.active, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiled, routing = tile_rows(x, self.experts, self.route)
        dtype = tiled.dtype
        gate_up = (torch.matmul(tiled, computed(self.gate_up, dtype).transpose(1, 2))
                   + self.gate_up_bias)
        limit, alpha = self.activation.limit, self.activation.alpha
        up = gate_up[..., 1::2].clamp(-limit, limit) + 1
        gate = torch.clamp(gate_up[..., ::2], max=limit)
        glu = gate * torch.sigmoid(gate * alpha)
        out = (torch.matmul(up * glu, computed(self.down, dtype).transpose(1, 2))
               + self.down_bias)
        return weigh_experts(out, routing)
