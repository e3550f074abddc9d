"""MXFP4 checkpoint tensors (gpt-oss's experts): their encoding, names and shapes.

A tensor ``X`` stored in MXFP4 is a pair of uint8 tensors: ``X_blocks`` [..., G, 16], two
E2M1 codes a byte (the low nibble first), so a block of 32 values a row of 16 bytes; and
``X_scales`` [..., G], one E8M0 exponent a block (2 ** (byte - 127)). A value is its code's
E2M1 number times its block's scale.

Hugging Face's gpt-oss loader (transformers.integrations.mxfp4, ``convert_moe_packed_tensors``)
reads a pair [E, R, G, 16] as the rows [E, R, G * 32] and hands the model their transpose
[E, G * 32, R]: gpt-oss's ``gate_up_proj`` [E, hidden, 2 * intermediate] and ``down_proj``
[E, intermediate, hidden] are stored as blocks along their input dimension. The functions
here give the same values bit for bit, in any float dtype: each value is computed exactly (in
float64, where every E2M1 number times 2 ** -127 to 2 ** 128 is exact) and rounded once to
the dtype, as ``torch.ldexp`` does there. So scale byte 255 (E8M0's NaN) reads as 2 ** 128,
as there: 0 stays 0, 0.5 becomes 2 ** 127, larger values overflow float32 to infinity (and
bfloat16's range is float32's; float16 overflows far sooner). A checkpoint's reader refuses
non-finite weights itself. ``quantize_rows`` is the way back (round to nearest), for tests
and measurements.

The checks of a checkpoint are here too, on names and headers only: which quant_method its
config may name (none, or mxfp4), which tensors may be pairs (a layer's experts' two
projections), and that a pair is whole and of the shape the config makes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

MXFP4 = "mxfp4"  # the quant_method of such a checkpoint's quantization_config
BLOCKS, SCALES = "_blocks", "_scales"
BLOCK_BYTES = 16  # a block's 32 values, two a byte
BLOCK_VALUES = 2 * BLOCK_BYTES
SCALE_BIAS = 127
FLOAT64_BIAS, FLOAT64_MANTISSA_BITS = 1023, 52
# the 8 magnitudes of an E2M1 code's low three bits (its high bit is the sign)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# the tensors a checkpoint may store as MXFP4 pairs: a layer's stacked experts' projections
EXPERT_PROJECTION = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


class Mxfp4Error(ValueError):
    """A blocks/scales pair that is incomplete, malformed, or of another shape than expected."""


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """The float64 numbers of 4-bit E2M1 codes (uint8, 0..15; code 8 is -0.0)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    values = magnitudes[(codes & 0x7).long()]
    return torch.where((codes & 0x8).bool(), -values, values)


def e8m0_scales(scales: torch.Tensor) -> torch.Tensor:
    """The float64 powers of two 2 ** (byte - 127) of E8M0 bytes, built bit by bit: the
    byte rebiased as a float64's exponent field (every one of them a normal float64)."""
    exponent = scales.to(torch.int64) - SCALE_BIAS + FLOAT64_BIAS
    return (exponent << FLOAT64_MANTISSA_BITS).view(torch.float64)


def unpack_codes(blocks: torch.Tensor) -> torch.Tensor:
    """[..., B] bytes as [..., 2 * B] E2M1 codes, each byte's low nibble first."""
    pairs = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1)
    return pairs.reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])


def dequantize_rows(blocks: torch.Tensor, scales: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Blocks [..., G, B] and scales [..., G] as the dense rows [..., G * 2B] in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise Mxfp4Error(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise Mxfp4Error(f"MXFP4 blocks of shape {tuple(blocks.shape)} need scales of shape "
                         f"{tuple(blocks.shape[:-1])}, not {tuple(scales.shape)}")
    values = e2m1_values(unpack_codes(blocks)) * e8m0_scales(scales).unsqueeze(-1)
    return values.reshape(*scales.shape[:-1], -1).to(dtype)


def dequantize_experts(blocks: torch.Tensor, scales: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A stacked pair, blocks [E, R, G, B] and scales [E, R, G], as Hugging Face loads it:
    [E, G * 2B, R] (each expert's rows transposed), computed one expert at a time so the
    temporaries stay one expert's."""
    if blocks.dim() != 4:
        raise Mxfp4Error(f"stacked MXFP4 blocks are [experts, rows, blocks, {BLOCK_BYTES}], "
                         f"not of shape {tuple(blocks.shape)}")
    experts, rows, groups, width = blocks.shape
    out = torch.empty(experts, groups * 2 * width, rows, dtype=dtype)
    for expert in range(experts):
        out[expert] = dequantize_rows(blocks[expert], scales[expert], dtype).transpose(0, 1)
    return out


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., K] (K a multiple of 32) as blocks [..., K/32, 16] and scales [..., K/32]:
    each block's scale the least power of two 2 ** e with max|x| / 2 ** e <= 6, each value
    the nearest E2M1 number times it (a tie to the smaller magnitude), two codes a byte."""
    if rows.shape[-1] % BLOCK_VALUES:
        raise Mxfp4Error(f"rows of {rows.shape[-1]} values are no whole blocks of {BLOCK_VALUES}")
    x = rows.to(torch.float64).reshape(*rows.shape[:-1], -1, BLOCK_VALUES)
    amax = x.abs().amax(dim=-1, keepdim=True)
    exponent = torch.ceil(torch.log2(torch.where(amax > 0, amax / E2M1_MAGNITUDES[-1], 1.0)))
    exponent = torch.where(amax > 0, exponent, -SCALE_BIAS).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = x / torch.pow(2.0, exponent)
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    nearest = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    codes = (nearest | torch.where(scaled < 0, 0x8, 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent.squeeze(-1) + SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def quantize_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked pair that ``dequantize_experts`` reads back as ``weight`` [E, A, B]
    rounded to MXFP4: blocks [E, B, A/32, 16], running along A (for gpt-oss's
    [E, in, out] tensors, along their input dimension)."""
    return quantize_rows(weight.transpose(1, 2).contiguous())


def pair_names(name: str) -> tuple[str, str]:
    """The blocks and scales tensors that store tensor ``name`` in MXFP4."""
    return name + BLOCKS, name + SCALES


def paired_tensor(stored: str) -> str | None:
    """The tensor a stored ``X_blocks`` or ``X_scales`` is half of (X), else None."""
    for suffix in (BLOCKS, SCALES):
        if stored.endswith(suffix):
            return stored[: -len(suffix)]
    return None


def stored_pairs(names: Iterable[str]) -> list[str]:
    """The tensors a checkpoint of these tensor names stores as MXFP4 pairs (``X`` of
    ``X_blocks`` and ``X_scales``), sorted; Mxfp4Error for a half without its other half,
    or a pair of a tensor other than a layer's experts' ``gate_up_proj`` or ``down_proj``."""
    halves: dict[str, set[str]] = {}
    for stored in names:
        tensor = paired_tensor(stored)
        if tensor is not None:
            halves.setdefault(tensor, set()).add(stored)
    for tensor, found in sorted(halves.items()):
        if not EXPERT_PROJECTION.fullmatch(tensor):
            raise Mxfp4Error(f"tensor {tensor} is stored in MXFP4 ({sorted(found)[0]}); MXFP4 "
                             "is read for a layer's experts' gate_up_proj and down_proj only")
        missing = set(pair_names(tensor)) - found
        if missing:
            raise Mxfp4Error(f"{sorted(found)[0]} has no {missing.pop()} beside it (an MXFP4 "
                             "tensor is a pair of blocks and scales)")
    return sorted(halves)


def experts_shape(blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...],
                  name: str) -> tuple[int, int, int]:
    """The shape [E, G * 32, R] a stacked pair of these shapes loads as; Mxfp4Error when
    they are not a stacked pair's (blocks [E, R, G, 16], scales [E, R, G])."""
    if len(blocks_shape) != 4 or blocks_shape[-1] != BLOCK_BYTES:
        raise Mxfp4Error(f"{name}{BLOCKS} has shape {list(blocks_shape)}, not "
                         f"[experts, rows, blocks, {BLOCK_BYTES}]")
    if tuple(scales_shape) != tuple(blocks_shape[:-1]):
        raise Mxfp4Error(f"{name}{SCALES} has shape {list(scales_shape)}, and its blocks "
                         f"{list(blocks_shape)} need {list(blocks_shape[:-1])}")
    experts, rows, groups, _ = blocks_shape
    return experts, groups * BLOCK_VALUES, rows


Header = tuple[tuple[int, ...], str]  # a stored tensor's shape and safetensors dtype ("U8")


def stacked_experts(name: str, blocks: Header, scales: Header,
                    want: tuple[int, int, int]) -> int:
    """The experts of the stacked pair of tensor ``name`` (from its halves' headers), which
    must read as ``want`` [experts, rows, columns] but for the count of experts (a layer's
    count is checked against the config with the experts stored otherwise); Mxfp4Error
    for halves not uint8, or shapes that are no stacked pair's or not ``want``'s."""
    if blocks[1] != "U8" or scales[1] != "U8":
        raise Mxfp4Error(f"MXFP4 tensor {name}'s blocks and scales are {blocks[1]} and "
                         f"{scales[1]}, not U8")
    reads_as = experts_shape(blocks[0], scales[0], name)
    if not want[0]:
        raise Mxfp4Error(f"MXFP4 tensor {name} holds experts, and the config makes no "
                         "mixture of experts")
    if reads_as[1:] != want[1:]:
        raise Mxfp4Error(f"MXFP4 tensor {name} reads as {list(reads_as)} [experts, rows, "
                         f"columns], and the config makes it {list(want)}")
    return reads_as[0]


def check_quant_method(method: str | None) -> None:
    """Mxfp4Error unless a config naming quant_method ``method`` (None: no
    quantization_config) is one the exporter reads: no quantization, or MXFP4."""
    if method not in (None, MXFP4):
        raise Mxfp4Error(f"its weights are quantized with {method!r} (config.json's "
                         "quantization_config); the exporter reads unquantized checkpoints, "
                         f"and experts stored in MXFP4 (quant_method {MXFP4!r})")


def check_pairs_declared(method: str | None, pairs: list[str]) -> None:
    """Mxfp4Error when a checkpoint stores MXFP4 ``pairs`` and its config does not say so."""
    if pairs and method != MXFP4:
        raise Mxfp4Error(f"tensor {pairs[0]} is stored in MXFP4, and config.json has no "
                         f"quantization_config of quant_method {MXFP4!r}")


def quant_method(quantization_config: object) -> str | None:
    """The ``quant_method`` a config.json's ``quantization_config`` names (None: it has no
    such field; "?" when the field names no method)."""
    if quantization_config is None:
        return None
    if not isinstance(quantization_config, dict):
        raise Mxfp4Error(f"quantization_config is {quantization_config!r}, not an object")
    return str(quantization_config.get("quant_method", "?"))
