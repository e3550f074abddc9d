"""tools/decode/weight_forms: forms are read from their names (or refused), hold the bytes
they say, and their decompression subgraphs compute what their numpy dequantization does,
folded by the CPU plugin into a MatMul that keeps the codes' precision."""

from __future__ import annotations

import numpy as np
import pytest

from dataplane.runtime.ov_core import shared_core
from tools.decode.kernel_repro import form_model, weights_node
from tools.decode.weight_forms import (
    ZERO_NONE,
    ZERO_PER_GROUP,
    ZERO_SHARED,
    FormWeight,
    WeightForm,
)

EXACT = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}


def test_names_read_as_forms_and_back() -> None:
    assert WeightForm.parse("u8") == WeightForm(8, False, None, ZERO_PER_GROUP)
    assert WeightForm.parse(" i8g32 ") == WeightForm(8, True, 32, ZERO_NONE)
    assert WeightForm.parse("u4g32z") == WeightForm(4, False, 32, ZERO_SHARED)
    for name in ("u8", "i8", "i8g32", "u4g128", "i4g64", "u4g32z"):
        assert WeightForm.parse(name).name == name


@pytest.mark.parametrize("bad", ["", "int8", "u2", "i8z", "i8g0", "u4g", "i4g32x"])
def test_other_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="a weight form is"):
        WeightForm.parse(bad)


def test_bytes_count_codes_zero_points_and_f16_scales() -> None:
    assert WeightForm.parse("u8").nbytes(8, 128) == 8 * 128 + 8 + 8 * 2
    assert WeightForm.parse("i8g32").nbytes(8, 128) == 8 * 128 + 8 * 4 * 2  # Q8_0's 34/32
    assert WeightForm.parse("u4g64").nbytes(8, 128) == 8 * 64 + 16 // 2 + 16 * 2
    assert WeightForm.parse("i4g32").nbytes(8, 128) == 8 * 64 + 32 * 2  # Q4_0's 18/32
    with pytest.raises(ValueError, match="not a multiple of the group size 64"):
        WeightForm.parse("i8g64").nbytes(8, 96)


@pytest.mark.parametrize("name", ["u8", "i8", "i8g32", "u4g64", "i4g32", "u4g32z"])
def test_a_forms_matmul_computes_its_weight_dequantized_and_stays_compressed(
        name: str) -> None:
    form = WeightForm.parse(name)
    weight = FormWeight.random(64, 256, form, np.random.default_rng(0))
    low, high = form.code_range()
    assert weight.codes.min() >= low and weight.codes.max() <= high
    assert weight.shape == (64, 256) and weight.nbytes == form.nbytes(64, 256)
    x = np.random.default_rng(1).standard_normal((1, 1, 256)).astype(np.float32)
    compiled = shared_core().compile_model(form_model(256, weight), "CPU", EXACT)
    got = compiled({"x": x})[0][0, 0]
    np.testing.assert_allclose(got, weight.dense() @ x[0, 0], rtol=1e-4, atol=1e-4)
    node = weights_node(compiled)
    assert node["node"].startswith("FullyConnected")
    assert node["weight_precision"] == str(form.code_type.get_type_name())
