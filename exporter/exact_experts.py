"""A mixture of experts' weights kept exactly: MXFP4 experts (gpt-oss's) as i8 codes times a
power-of-two scale per group of 32 inputs, a form OpenVINO's CPU plugin runs compressed.

An MXFP4 weight is an E2M1 number (0, 0.5, 1, 1.5, 2, 3, 4 or 6, signed) times its block's
power-of-two scale, in blocks of 32 inputs. Twice an E2M1 number is an integer from -12 to
12, so each block is exactly i8 codes times half its scale. The export's formats would round
such weights a second time (INT4 moves a gpt-oss expert layer's output by 16%,
docs/design.md), and the plugin's GatherMatmul, which runs the experts, does not keep
f4e2m1 weights compressed (it folds them to f32); it keeps these i8 codes, and steps a
gpt-oss-sized layer as fast as with INT4 experts or faster (0.95-1.22x, on an Intel Xeon and
an AMD EPYC), at about twice their bytes
(docs/measurements/decode.md#mxfp4-weights-on-the-cpu-plugin).

The form is found from the weights themselves, so it holds whichever way they were read (a
safetensors checkpoint's blocks and scales, a GGUF file's MXFP4 tensors): each group of 32
inputs takes the largest power of two dividing all its values as its scale, and its codes
are the values over that scale, integers by construction. A group whose largest code is
beyond i8's range, or whose scale is beyond f16's, is no such weight and is refused by
name: the form is exact or it is not written. Each weight becomes

    i8 [E, N, K/32, 32] -> Convert f16 -> Multiply by f16 scales [E, N, K/32, 1]
        -> Reshape [E, N, K] -> Convert f32

(exporter/int8_groups.py's form, with exact scales: dataplane.runtime.weight_graph's
``i8_group_weight`` builds it), which NNCF then leaves as it is.
"""

from __future__ import annotations

import numpy as np
import openvino as ov

from dataplane.runtime.weight_graph import i8_group_weight
from zctl.weights import EXACT_EXPERT_GROUP

I8_LIMIT = 127
# the powers of two an f16 scale holds exactly (its subnormals included)
F16_SCALE_EXPONENTS = (-24, 15)
_ZERO_GROUP = 1 << 20  # a lowest-bit exponent no nonzero float32 has


class InexactExpertsError(ValueError):
    """Experts whose weights are no i8 codes times a power of two per group of 32."""


def lowest_bit_exponents(values: np.ndarray) -> np.ndarray:
    """For each float32 value, the exponent of the largest power of two dividing it
    (``_ZERO_GROUP`` for a zero): the exponent of its mantissa's lowest set bit."""
    mantissas, exponents = np.frexp(values.astype(np.float32, copy=False))
    integers = np.ldexp(mantissas, 24).astype(np.int64)  # exact: 24 bits of mantissa
    lowest = integers & -integers
    out = exponents.astype(np.int64) - 24
    nonzero = lowest != 0
    out[nonzero] += np.log2(lowest[nonzero]).astype(np.int64)
    out[~nonzero] = _ZERO_GROUP
    return out


def exact_groups(weight: np.ndarray, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """``weight`` [..., K] as i8 codes [..., K/32, 32] and f16 power-of-two scales
    [..., K/32, 1] whose product is ``weight`` exactly; InexactExpertsError naming
    ``name`` where no such codes exist."""
    *lead, inputs = weight.shape
    if inputs % EXACT_EXPERT_GROUP:
        raise InexactExpertsError(f"{name}: {inputs} inputs are no whole groups of "
                                  f"{EXACT_EXPERT_GROUP} (MXFP4's blocks)")
    grouped = np.asarray(weight, dtype=np.float32).reshape(*lead, inputs // EXACT_EXPERT_GROUP,
                                                           EXACT_EXPERT_GROUP)
    if not np.isfinite(grouped).all():
        raise InexactExpertsError(f"{name} holds values that are not finite")
    exponents = lowest_bit_exponents(grouped).min(axis=-1, keepdims=True)
    exponents[exponents == _ZERO_GROUP] = 0  # an all-zero group: codes 0, any scale
    codes = np.ldexp(grouped, -exponents)  # integers: each value over a power of two dividing it
    largest = np.abs(codes).max(axis=-1, keepdims=True)
    low, high = F16_SCALE_EXPONENTS
    bad = (largest > I8_LIMIT) | (exponents < low) | (exponents > high)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0][:-1])
        raise InexactExpertsError(
            f"{name}: the group of {EXACT_EXPERT_GROUP} inputs at {list(where)} is no i8 code times "
            f"a power of two in f16's range (largest code {int(largest[where][0])}, scale "
            f"2^{int(exponents[where][0])}): exact experts keep weights that are MXFP4 values "
            "(gpt-oss's experts), and these are not; export without exact experts")
    return codes.astype(np.int8), np.ldexp(np.float16(1), exponents).astype(np.float16)


def constant_values(constant: ov.Node) -> np.ndarray:
    """A Constant's values as stored, without a copy: float32 or float16 as they are, a
    bfloat16 one as its uint16 bit patterns (``as_float32`` widens them)."""
    if constant.get_output_element_type(0) == ov.Type.bf16:
        return np.array(constant.get_tensor_view().data, copy=False).view(np.uint16)
    return np.asarray(constant.get_data())


def as_float32(values: np.ndarray) -> np.ndarray:
    """``constant_values``' values in float32: bfloat16 bit patterns (uint16) widened bit
    for bit, a float type converted."""
    if values.dtype == np.uint16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32, copy=False)


def _expert_weight(matmul: ov.Node) -> ov.Node | None:
    """The 3-D Constant a MatMul multiplies by (directly or through a Convert), else None:
    a mixture of experts' stacked [experts, out, in] weights (exporter/moe_block.py,
    exporter/gpt_oss_moe_block.py); no other MatMul of a stage has one."""
    node = matmul.input_value(1).get_node()
    if node.get_type_name() == "Convert":
        node = node.input_value(0).get_node()
    if node.get_type_name() != "Constant" or len(node.get_output_shape(0)) != 3:
        return None
    return node


def keep_experts_exact(model: ov.Model) -> int:
    """Put every stacked expert weight of ``model`` in the exact i8 form (in place); the
    number of weights done. InexactExpertsError before ``model`` is changed if any is not
    exact."""
    found = []
    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul":
            continue
        weight = _expert_weight(op)
        if weight is None:
            continue
        if not op.get_attributes()["transpose_b"]:
            raise InexactExpertsError(f"{op.get_friendly_name()}: experts' weights are "
                                      "expected as [experts, out, in] (transpose_b)")
        found.append((op, weight))
    forms = []
    for op, weight in found:
        values = constant_values(weight)
        codes = np.empty((*values.shape[:-1], values.shape[-1] // EXACT_EXPERT_GROUP, EXACT_EXPERT_GROUP),
                         np.int8)
        scales = np.empty((*codes.shape[:-1], 1), np.float16)
        for expert in range(values.shape[0]):  # one expert at a time: bounded temporaries
            codes[expert], scales[expert] = exact_groups(
                as_float32(values[expert]), f"{op.get_friendly_name()} (expert {expert})")
        forms.append((op, codes, scales))
    for op, codes, scales in forms:
        op.input(1).replace_source_output(i8_group_weight(codes, scales))
    return len(forms)
