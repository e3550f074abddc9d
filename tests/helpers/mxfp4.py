"""A plain MXFP4 quantizer, to write test checkpoints whose experts are blocks/scales
pairs (exporter.mxfp4 reads them; this writes them, independently of it)."""

from __future__ import annotations

import torch

MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., K] (K a multiple of 32) as blocks [..., K/32, 16] and scales [..., K/32]:
    each block's scale the least power of two 2**e with max|x| / 2**e <= 6, each value the
    nearest E2M1 number times it, two codes a byte, the even position in the low nibble."""
    x = rows.to(torch.float64).reshape(*rows.shape[:-1], -1, 32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    exponent = torch.ceil(torch.log2(torch.where(amax > 0, amax / 6.0, torch.ones_like(amax))))
    exponent = torch.where(amax > 0, exponent, torch.full_like(amax, -127)).clamp(-127, 127)
    scaled = x / torch.pow(2.0, exponent)
    nearest = (scaled.abs().unsqueeze(-1) - MAGNITUDES).abs().argmin(dim=-1)
    codes = (nearest | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent.squeeze(-1) + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def quantize_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair Hugging Face's gpt-oss loader reads back as ``weight`` [E, A, B] (rounded to
    MXFP4): the blocks run along A, so the pair holds weight's transpose [E, B, A]."""
    return quantize_rows(weight.transpose(1, 2).contiguous())
