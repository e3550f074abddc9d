"""Weight formats and what a weight costs in each: shared by the exporter (which compresses
to them), placement and the planner (which size a model before it is exported).

Pure data and arithmetic, no OpenVINO. Decoder MatMuls take the chosen format; the
embedding and LM head are INT8 or better in every format (exporter/compress.py).
"""

from __future__ import annotations

from collections.abc import Sequence

WEIGHT_FORMATS = ("int4", "int8", "fp16", "fp32")
# The forms of INT8 weights an export holds (its manifest's ``int8_form``): symmetric i8 codes
# with an f16 scale per group of 128/64/32 inputs (an int8 export's MatMuls, embedding and
# head), or u8 codes with a scale and zero point per output channel (an int4 export's
# embedding and head, a static export's INT8, and every export written before the field).
INT8_GROUPS = "i8-groups"
INT8_CHANNELS = "u8-channel"
INT8_FORMS = (INT8_GROUPS, INT8_CHANNELS)
GROUP_CANDIDATES = (128, 64, 32, 16)

# Bytes per weight of embedding/head for each export format (INT4 exports keep both in INT8).
EMBED_BYTES_PER_WEIGHT = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 1.0}
# INT4 (NNCF's asymmetric groups): half a byte a weight, and per group of weights an f16
# scale and a 4-bit zero point (2.5 bytes). A middle stage of SmolLM2-135M exported in INT4
# with groups of 64 holds 1,912,347 bytes a layer for 3,538,944 weights: 0.540 a weight,
# as 0.5 + 2.5 / 64 says. INT8 adds an f16 scale per group of 128/64/32 weights (1.6-6%;
# per output channel: a scale and zero point per row), left out of these estimates.
INT4_GROUP_BYTES = 2.5
DENSE_BYTES_PER_WEIGHT = {"int8": 1.0, "fp16": 2.0, "fp32": 4.0}


def check_weight_format(weight_format: str) -> str:
    """``weight_format`` itself; ValueError naming the formats for any other."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; expected one of {WEIGHT_FORMATS}")
    return weight_format


def pick_group_size(in_dims: Sequence[int]) -> int:
    """The largest standard INT4 group size dividing every MatMul input dimension."""
    for group in GROUP_CANDIDATES:
        if all(dim % group == 0 for dim in in_dims):
            return group
    raise ValueError(f"no INT4 group size in {GROUP_CANDIDATES} divides {sorted(set(in_dims))}")


def decoder_bytes_per_weight(weight_format: str, group_size: int | None = None) -> float:
    """Bytes a decoder MatMul weight takes in ``weight_format`` (INT4: with its groups'
    scales and zero points; ``group_size`` is required for INT4)."""
    check_weight_format(weight_format)
    if weight_format == "int4":
        if not group_size or group_size < 1:
            raise ValueError("INT4 needs a group size to say its bytes per weight")
        return 0.5 + INT4_GROUP_BYTES / group_size
    return DENSE_BYTES_PER_WEIGHT[weight_format]


def decoder_layer_weights(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int,
                          head_dim: int) -> int:
    """MatMul weights of one Llama decoder layer (attention projections and gated MLP)."""
    q_o = 2 * hidden * num_heads * head_dim
    k_v = 2 * hidden * num_kv_heads * head_dim
    return q_o + k_v + 3 * hidden * intermediate
