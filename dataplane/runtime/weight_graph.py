"""Weight forms as graph nodes, built where a graph is made rather than left by NNCF: the
exporter writes exact experts in the i8-groups form (exporter/exact_experts.py), and a
node's profile builds its synthetic layers' INT8 and exact experts in it
(dataplane.runtime.synthetic), so that both compile as an export's weights do."""

from __future__ import annotations

import numpy as np
import openvino as ov
from openvino import opset13 as ops


def i8_group_weight(codes: np.ndarray, scales: np.ndarray, name: str | None = None
                    ) -> ov.Output:
    """i8 ``codes`` [..., K/g, g] times f16 ``scales`` [..., K/g, 1] as a weight [..., K] in
    f32: Convert f16, Multiply, Reshape, Convert f32, the form of an int8 export's i8 groups
    (exporter/int8_groups.py) and of exact experts (exporter/exact_experts.py), which the
    CPU plugin runs compressed. ``name``: the codes' Constant's, and ``name/scale`` the
    scales'."""
    *lead, groups, width = codes.shape
    weight = ops.convert(ops.constant(codes, name=name), ov.Type.f16)
    scale = ops.constant(scales, name=None if name is None else f"{name}/scale")
    flat = ops.reshape(ops.multiply(weight, scale),
                       ops.constant(np.array([*lead, groups * width], np.int64)), False)
    return ops.convert(flat, ov.Type.f32).output(0)
