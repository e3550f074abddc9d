"""A sparse mixture-of-experts MLP (Qwen3-MoE's) in the form OpenVINO's CPU plugin runs
sparsely.

Each row is routed by a linear router, a softmax, its top-k experts and (norm_topk_prob) the
top-k weights renormalised to sum to one; its output is the weighted sum of those experts'
SwiGLU MLPs. Written plainly (a loop over experts, index_add) the graph would have
data-dependent control flow that a trace freezes. Written as a Gather of the chosen
experts' weights, NNCF would see no MatMul weight to compress, and the CPU plugin no
pattern it knows.

So the block is traced in the "tiled" form the CPU plugin recognises
(ConvertTiledMoeBlockTo3GatherMatmuls in OpenVINO 2026.4): the rows tiled once per expert,
three batched MatMuls against the experts' stacked [experts, out, in] weights (gate, up,
down; transpose_b), a routing tensor [experts, batch, tokens, 1] that is zero but at each
row's chosen experts (a ScatterElementsUpdate of the top-k weights), the product summed
over the experts. Read literally this computes every expert; the plugin rewrites the
pattern into GatherMatmul nodes fed by the top-k indices, so a step computes (and reads the
weights of) only the experts its rows were routed to, whatever their number, and the
expert weights stay ordinary MatMul constants that NNCF compresses (INT4/INT8 per group)
and the plugin decompresses inside GatherMatmul. The same graph serves prefill: the
GatherMatmul groups a step's rows by expert itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from exporter.stored_weights import StoredLinear, computed


class SparseMoeBlock(nn.Module):
    """Router [experts, hidden], gate_up [experts, 2 * intermediate, hidden] (gate rows
    first, as Hugging Face stacks them), down [experts, hidden, intermediate]."""

    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 active: int, norm_topk_prob: bool) -> None:
        super().__init__()
        experts, rows, hidden = gate_up.shape
        if router.shape != (experts, hidden) or down.shape != (experts, hidden, rows // 2):
            raise ValueError(f"expert weights of unmatched shapes: router {tuple(router.shape)}, "
                             f"gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
        intermediate = rows // 2
        self.experts, self.active, self.norm_topk_prob = experts, active, norm_topk_prob
        # a module of its own, so its MatMul is named (compress.py keeps it out of INT4)
        self.router = StoredLinear(router, None)
        # the experts' weights in their stored type (exporter.stored_weights)
        self.gate = nn.Parameter(gate_up[:, :intermediate].contiguous(), requires_grad=False)
        self.up = nn.Parameter(gate_up[:, intermediate:].contiguous(), requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)

    def route(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k weights and expert indices [rows, k], as Hugging Face's router."""
        probs = F.softmax(self.router(rows), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.active, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(rows.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiled, routing = tile_rows(x, self.experts, self.route)
        gate = torch.matmul(tiled, computed(self.gate, tiled.dtype).transpose(1, 2))
        up = torch.matmul(tiled, computed(self.up, tiled.dtype).transpose(1, 2))
        out = torch.matmul(F.silu(gate) * up, computed(self.down, tiled.dtype).transpose(1, 2))
        return weigh_experts(out, routing)


def tile_rows(x: torch.Tensor, experts: int,
              route: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiled form's two inputs for ``x`` [batch, tokens, hidden]: its rows once per
    expert [experts, rows, hidden], and the routing [experts, batch, tokens, 1], zero but at
    each row's chosen experts (``route``: rows -> their top-k weights and experts)."""
    batch, tokens, hidden = x.shape
    rows = x.reshape(-1, hidden)
    weights, chosen = route(rows)
    # [rows, experts]: a row's weight at its chosen experts, zero elsewhere
    dense = torch.zeros(rows.shape[0], experts, dtype=rows.dtype).scatter(1, chosen, weights)
    routing = dense.transpose(0, 1).reshape(experts, batch, tokens).unsqueeze(-1)
    return rows.repeat(experts, 1).reshape(experts, -1, hidden), routing


def weigh_experts(out: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
    """Every expert's output [experts, rows, hidden] weighed by ``routing`` and summed over
    the experts: [batch, tokens, hidden]."""
    experts, batch, tokens, _ = routing.shape
    return (out.reshape(experts, batch, tokens, out.shape[-1]) * routing).sum(dim=0)
