"""exporter.mxfp4: a blocks/scales pair reads as Hugging Face's gpt-oss loader reads it,
bit for bit, extreme exponents included; malformed pairs are refused."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from exporter.mxfp4 import (
    Mxfp4Error,
    check_pairs_declared,
    check_quant_method,
    dequantize_experts,
    dequantize_rows,
    e2m1_values,
    e8m0_scales,
    experts_shape,
    paired_tensor,
    quant_method,
    quantize_experts,
    quantize_rows,
    stacked_experts,
    stored_pairs,
)

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _random_pair(experts: int = 3, rows: int = 8, groups: int = 4, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (experts, rows, groups), dtype=torch.uint8, generator=g)
    # every exponent somewhere, the extremes in rows of their own: 2**-127 (subnormal in
    # float32), 2**127, and 255 (E8M0's NaN, read as 2**128)
    every = min(256, scales.numel())
    scales.view(-1)[:every] = torch.arange(every, dtype=torch.uint8)
    scales[1, 2, :] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bit_identical_to_transformers(dtype: torch.dtype) -> None:
    blocks, scales = _random_pair(experts=3, rows=32, groups=4)
    ours = dequantize_experts(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == theirs.shape == (3, 4 * 32, 32)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours.view(BITS[dtype]), theirs.view(BITS[dtype]))
    if dtype != torch.float16:  # the extremes are really there: overflow and subnormals
        assert torch.isinf(ours).any() and (ours[ours != 0].abs() < 2.0**-126).any()


def test_every_code_and_the_extreme_scales() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_values(codes).tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6,
                                           -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(e2m1_values(codes))[8]  # code 8 is -0.0
    scales = e8m0_scales(torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8))
    assert scales.tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0, 2.0**127, 2.0**128]


def test_nibble_order_and_row_layout() -> None:
    # one row of one block: byte 0x21 holds code 1 (0.5) first, then code 2 (1.0)
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x21
    row = dequantize_rows(blocks, torch.full((1, 1), 128, dtype=torch.uint8))
    assert row.shape == (1, 32)
    assert row[0, :3].tolist() == [1.0, 2.0, 0.0]  # scale 2**1


def test_a_quantized_tensor_reads_back_close() -> None:
    weight = torch.randn(2, 64, 96, generator=torch.Generator().manual_seed(1))
    blocks, scales = quantize_experts(weight)
    assert blocks.shape == (2, 96, 2, 16) and scales.shape == (2, 96, 2)
    back = dequantize_experts(blocks, scales)
    assert back.shape == weight.shape
    assert torch.equal(back, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    # rounded to E2M1 within each block of 32 (along dim 1): at most one scale unit away,
    # and a block's scale is under a third of its largest magnitude
    blockwise = lambda t: t.transpose(1, 2).reshape(2, 96, 2, 32)  # noqa: E731
    error = blockwise(back - weight).abs().amax(-1) / blockwise(weight).abs().amax(-1)
    assert 0 < error.max() <= 1 / 3
    assert torch.equal(dequantize_experts(*quantize_experts(back)), back)  # MXFP4 values stay


def test_malformed_pairs_are_refused() -> None:
    blocks, scales = _random_pair()
    with pytest.raises(Mxfp4Error, match="uint8"):
        dequantize_rows(blocks.to(torch.int16), scales)
    with pytest.raises(Mxfp4Error, match="need scales of shape"):
        dequantize_rows(blocks, scales[..., :3])
    with pytest.raises(Mxfp4Error, match="no whole blocks"):
        quantize_rows(torch.zeros(2, 48))
    with pytest.raises(Mxfp4Error, match="experts, rows, blocks"):
        dequantize_experts(blocks[0], scales[0])
    assert experts_shape((3, 8, 4, 16), (3, 8, 4), "x") == (3, 128, 8)
    with pytest.raises(Mxfp4Error, match=r"x_blocks has shape \[3, 8, 4, 8\]"):
        experts_shape((3, 8, 4, 8), (3, 8, 4), "x")
    with pytest.raises(Mxfp4Error, match=r"x_scales has shape \[3, 8\]"):
        experts_shape((3, 8, 4, 16), (3, 8), "x")


def test_names_and_quant_methods() -> None:
    assert paired_tensor("a.experts.down_proj_blocks") == "a.experts.down_proj"
    assert paired_tensor("a.experts.down_proj_scales") == "a.experts.down_proj"
    assert paired_tensor("a.experts.down_proj") is None
    assert quant_method(None) is None
    assert quant_method({"quant_method": "mxfp4"}) == "mxfp4"
    assert quant_method({}) == "?"
    with pytest.raises(Mxfp4Error, match="not an object"):
        quant_method("mxfp4")


def test_which_pairs_and_configs_are_read() -> None:
    experts = "model.layers.3.mlp.experts"
    names = [f"{experts}.down_proj_blocks", f"{experts}.down_proj_scales", "lm_head.weight"]
    assert stored_pairs(names) == [f"{experts}.down_proj"]
    with pytest.raises(Mxfp4Error, match="has no model.layers.3.mlp.experts.down_proj_scales"):
        stored_pairs(names[:1])
    with pytest.raises(Mxfp4Error, match="lm_head.weight is stored in MXFP4"):
        stored_pairs(["lm_head.weight_blocks", "lm_head.weight_scales"])
    check_quant_method(None)
    check_quant_method("mxfp4")
    with pytest.raises(Mxfp4Error, match="quantized with 'awq'"):
        check_quant_method("awq")
    check_pairs_declared(None, [])
    check_pairs_declared("mxfp4", [f"{experts}.down_proj"])
    with pytest.raises(Mxfp4Error, match="no quantization_config of quant_method 'mxfp4'"):
        check_pairs_declared(None, [f"{experts}.down_proj"])


def test_a_pair_must_read_as_the_config_says() -> None:
    blocks, scales = ((4, 64, 2, 16), "U8"), ((4, 64, 2), "U8")
    assert stacked_experts("x", blocks, scales, (4, 64, 64)) == 4
    assert stacked_experts("x", blocks, scales, (8, 64, 64)) == 4  # the count is checked apart
    with pytest.raises(Mxfp4Error, match=r"reads as \[4, 64, 64\].*makes it \[4, 64, 32\]"):
        stacked_experts("x", blocks, scales, (4, 64, 32))
    with pytest.raises(Mxfp4Error, match="makes no mixture of experts"):
        stacked_experts("x", blocks, scales, (0, 0, 64))
    with pytest.raises(Mxfp4Error, match="are F32 and U8, not U8"):
        stacked_experts("x", (blocks[0], "F32"), scales, (4, 64, 64))
