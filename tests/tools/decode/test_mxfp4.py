"""tools.decode.mxfp4 on tiny shapes: what OpenVINO's CPU plugin does with MXFP4 weights.
A MatMul keeps f4e2m1 codes and f8e8m0 scales (FullyConnected decompresses them, exactly);
the MoE layer's GatherMatmul does not take them (it gets the weights folded to f32), while
the same values as i8 codes with group scales stay compressed and exact; NNCF's INT4
requantization is far from them. When an OpenVINO update makes GatherMatmul keep f4e2m1,
the moe assertion fails: that is when keeping gpt-oss's experts in MXFP4 becomes possible
(docs/design.md, Mixture of experts)."""

from __future__ import annotations

import numpy as np
import pytest

from tools.decode.mxfp4 import fc_case, moe_case

EXACT = 1e-5  # relative RMS distance of an exact form from the f32 weights (sums' order only)


@pytest.fixture(scope="module")
def fc() -> dict:
    return fc_case(128, 64, "f32", iters=2)


@pytest.fixture(scope="module")
def moe() -> dict:
    return moe_case(128, 64, experts=4, active=2, precision="f32", iters=2)


def test_a_matmul_keeps_mxfp4_and_is_exact(fc: dict) -> None:
    mxfp4 = fc["sides"]["mxfp4"]
    assert mxfp4["nodes"] == ["FullyConnected f4e2m1 (f32, f4e2m1, dynamic, f32, dynamic)"]
    assert mxfp4["relative_rms_vs_f32_weights"] < EXACT
    assert fc["sides"]["int4"]["nodes"][0].startswith("FullyConnected u4")


def test_gathermatmul_folds_mxfp4_to_f32_and_keeps_exact_int8(moe: dict) -> None:
    sides = moe["sides"]
    experts = [node for node in sides["mxfp4"]["nodes"] if node.startswith("GatherMatmul")]
    assert len(experts) == 3 and all(n.startswith("GatherMatmul f32 (f32, f32,") for n in experts)
    assert sides["mxfp4"]["bit_identical_to_f32_weights"]  # folded: the f32 graph itself
    int8 = [node for node in sides["int8_exact"]["nodes"] if node.startswith("GatherMatmul")]
    assert len(int8) == 3 and all("(f32, i8, i32" in node for node in int8)
    assert sides["int8_exact"]["relative_rms_vs_f32_weights"] < EXACT


def test_int4_requantization_costs_what_the_exact_forms_do_not(fc: dict, moe: dict) -> None:
    for case in (fc, moe):
        exact = [side["relative_rms_vs_f32_weights"] for name, side in case["sides"].items()
                 if name != "int4"]
        int4 = case["sides"]["int4"]["relative_rms_vs_f32_weights"]
        assert max(exact) < EXACT
        assert np.isfinite(int4) and 0.01 < int4 < 0.5
