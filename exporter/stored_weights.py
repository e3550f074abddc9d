"""Weights kept in the checkpoint's own type inside a stage's torch module, computed in the
activations' type (float32).

A compressed export (INT4/INT8) of a 16-bit checkpoint keeps its weight matrices 16-bit
while the stage is traced and converted: the cast to float32 is in the graph (a Convert
after each 16-bit Constant, which NNCF's weight compression takes as part of the weight),
so the stage holds half the bytes a float32 copy would. NNCF compresses each such weight
from its float32 values, which the 16-bit ones give exactly: the compressed weights are
those of the float32 module. A float32 weight is used as it is, with no cast in the graph.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

# the stored types a compressed export keeps as they are (float32 holds each value exactly)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def computed(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype``: itself when it already is, else cast (traced as a Convert)."""
    return weight if weight.dtype == dtype else weight.to(dtype)


class StoredLinear(nn.Module):
    """``nn.Linear``'s product (weight [out, in], bias [out] or None) with the weight in its
    stored type and cast to the input's where they differ; the bias is float32 (small)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, computed(self.weight, x.dtype), self.bias)


class StoredEmbedding(nn.Module):
    """An embedding table [vocab, hidden] in its stored type, looked up in float32."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, computed(self.weight, torch.float32))
