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
# The groups of an export's i8-groups weights, tried in order per MatMul (or Gather); where
# none divides its inputs K, the weight stays u8 per output channel (exporter/int8_groups.py)
INT8_GROUP_SIZES = (128, 64, 32)
SCALE_BYTES = 2  # an f16 scale (a group's, or an output channel's)
ZERO_POINT_BYTES = 1  # a u8 zero point (an output channel's, u8-channel form only)

# INT4 (NNCF's asymmetric groups): half a byte a weight, and per group of weights an f16
# scale and a 4-bit zero point (2.5 bytes). A middle stage of SmolLM2-135M exported in INT4
# with groups of 64 holds 1,912,347 bytes a layer for 3,538,944 weights: 0.540 a weight,
# as 0.5 + 2.5 / 64 says. INT8 (``int8_bytes_per_weight``): a byte a weight and an f16 scale
# per group of 128/64/32 (1.6-6%), or per output channel an f16 scale and a u8 zero point.
INT4_GROUP_BYTES = 2.5
FLOAT_BYTES_PER_WEIGHT = {"fp16": 2.0, "fp32": 4.0}
# Exact experts (exporter/exact_experts.py): a mixture of experts' MXFP4 weights as i8 codes
# with an f16 power-of-two scale per group of 32 inputs (MXFP4's block), in any format
EXACT_EXPERT_GROUP = 32
EXACT_EXPERT_BYTES_PER_WEIGHT = 1.0 + SCALE_BYTES / EXACT_EXPERT_GROUP


def check_weight_format(weight_format: str) -> str:
    """``weight_format`` itself; ValueError naming the formats for any other."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; expected one of {WEIGHT_FORMATS}")
    return weight_format


def default_int8_form(weight_format: str) -> str | None:
    """The form of the INT8 weights an export in ``weight_format`` is written with now
    (exporter/export.py ``int8_form_for``, a dynamic export): i8 groups for int8, u8 per
    channel for int4's embedding and head, None for the float formats."""
    check_weight_format(weight_format)
    if weight_format == "int8":
        return INT8_GROUPS
    return INT8_CHANNELS if weight_format == "int4" else None


def export_int8_form(weight_format: str, int8_form: str | None = None) -> str | None:
    """The form of the INT8 weights of an export in ``weight_format`` whose manifest says
    ``int8_form`` (checked; None: one written now, ``default_int8_form``)."""
    if int8_form is None:
        return default_int8_form(weight_format)
    check_weight_format(weight_format)
    return check_int8_form(int8_form)


def named_int8_form(weight_format: str, int8_form: str | None) -> str | None:
    """The INT8 form a record of ``weight_format`` stands for: ``int8_form``, or where it
    names none the format's default (None for a format not in WEIGHT_FORMATS)."""
    if int8_form is None and weight_format in WEIGHT_FORMATS:
        return default_int8_form(weight_format)
    return int8_form


def check_int8_form(int8_form: str) -> str:
    """``int8_form`` itself; ValueError naming the forms for any other."""
    if int8_form not in INT8_FORMS:
        raise ValueError(f"unknown INT8 form {int8_form!r}; expected one of {INT8_FORMS}")
    return int8_form


def int8_group(in_features: int) -> int | None:
    """The i8 group of a MatMul (or Gather) with ``in_features`` inputs: the first of
    INT8_GROUP_SIZES that divides it, None (u8 per output channel) when none does."""
    if in_features < 1:
        raise ValueError(f"a MatMul has at least one input, not {in_features}")
    return next((group for group in INT8_GROUP_SIZES if in_features % group == 0), None)


def int8_bytes_per_weight(in_features: int, int8_form: str) -> float:
    """Bytes an INT8 weight of a MatMul with ``in_features`` inputs takes in ``int8_form``:
    its code and its share of its group's scale (i8 groups), or of its output channel's
    scale and zero point (u8 per channel, also an i8-groups weight no group divides)."""
    check_int8_form(int8_form)
    group = int8_group(in_features) if int8_form == INT8_GROUPS else None
    if group is not None:
        return 1.0 + SCALE_BYTES / group
    return 1.0 + (SCALE_BYTES + ZERO_POINT_BYTES) / in_features


def pick_group_size(in_dims: Sequence[int]) -> int:
    """The largest standard INT4 group size dividing every MatMul input dimension."""
    for group in GROUP_CANDIDATES:
        if all(dim % group == 0 for dim in in_dims):
            return group
    raise ValueError(f"no INT4 group size in {GROUP_CANDIDATES} divides {sorted(set(in_dims))}")


def decoder_bytes_per_weight(weight_format: str, in_features: int, group_size: int | None = None,
                             int8_form: str | None = None) -> float:
    """Bytes a decoder MatMul weight of ``in_features`` inputs takes in ``weight_format``
    (INT4: with its groups' scales and zero points, ``group_size`` required; INT8: with its
    scales in ``int8_form``, by default the form an export is written with now)."""
    check_weight_format(weight_format)
    if weight_format == "int4":
        if not group_size or group_size < 1:
            raise ValueError("INT4 needs a group size to say its bytes per weight")
        return 0.5 + INT4_GROUP_BYTES / group_size
    if weight_format == "int8":
        return int8_bytes_per_weight(in_features, int8_form or INT8_GROUPS)
    return FLOAT_BYTES_PER_WEIGHT[weight_format]


def embedding_bytes_per_weight(weight_format: str, hidden: int,
                               int8_form: str | None = None) -> float:
    """Bytes a weight of the embedding or the LM head ([vocab, ``hidden``]) takes in an
    export in ``weight_format``: INT8 in its ``int8_form`` (by default the one written now)
    in the int4 and int8 formats, else the float format's."""
    form = int8_form or default_int8_form(weight_format)
    if form is None:
        return FLOAT_BYTES_PER_WEIGHT[weight_format]
    return int8_bytes_per_weight(hidden, form)


def decoder_layer_weights(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int,
                          head_dim: int) -> int:
    """MatMul weights of one Llama decoder layer (attention projections and gated MLP)."""
    q_o = 2 * hidden * num_heads * head_dim
    k_v = 2 * hidden * num_kv_heads * head_dim
    return q_o + k_v + 3 * hidden * intermediate
