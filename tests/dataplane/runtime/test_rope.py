"""Host-side RoPE tables (dataplane.runtime.rope) are pure functions; check them against HF."""

from __future__ import annotations

import numpy as np
import pytest

from dataplane.runtime.rope import RopeRows, rope_tables


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
])
def test_rope_tables_match_transformers(rope: dict | None) -> None:
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                         **({"rope_parameters": rope} if rope else {}))
    rotary = LlamaRotaryEmbedding(config)
    positions = np.array([[0, 1, 7, 100, 300]])
    ref_cos, ref_sin = rotary(torch.zeros(1), torch.tensor(positions))
    cos, sin = rope_tables(positions, rotary.inv_freq.numpy(), rotary.attention_scaling)
    np.testing.assert_allclose(cos, ref_cos.numpy(), rtol=0, atol=2e-6)
    np.testing.assert_allclose(sin, ref_sin.numpy(), rtol=0, atol=2e-6)


def test_rope_tables_reject_wrong_rank() -> None:
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        rope_tables(np.arange(3), np.ones(2, np.float32))


@pytest.mark.parametrize("scaling", [1.0, 0.7])
def test_rope_rows_are_the_tables_rows(scaling: float) -> None:
    inv_freq = 1.0 / (500000.0 ** (np.arange(0, 64, 2, dtype=np.float32) / 64))
    rows = RopeRows(inv_freq, scaling, max_blocks=2)
    positions = [0, 1, 17, 255, 256, 4095, 131071, 18, 300]  # > 2 blocks: some recomputed
    want_cos, want_sin = rope_tables(np.array([positions]), inv_freq, scaling)
    for i, position in enumerate(positions):
        cos, sin = rows.one(position)
        one_cos, one_sin = rope_tables(np.array([[position]]), inv_freq, scaling)
        assert cos.dtype == np.float32 and cos.shape == one_cos.shape == (1, 1, 64)
        assert np.array_equal(cos, one_cos) and np.array_equal(sin, one_sin)
        assert np.array_equal(cos[0, 0], want_cos[0, i]) and np.array_equal(sin[0, 0], want_sin[0, i])
        assert len(rows._blocks) <= 2
    with pytest.raises(ValueError, match=">= 0"):
        rows.one(-1)
