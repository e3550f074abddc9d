"""Rotary position embeddings computed on the host, fed to every stage as inputs.

The exporter records the model's inverse frequencies (whatever its rope type) and
attention scaling; these pure functions turn logical positions into cos/sin exactly
as Hugging Face does (float32 product, then cos/sin, then scaling).
"""

from __future__ import annotations

import numpy as np


def rope_tables(
    positions: np.ndarray, inv_freq: np.ndarray, attention_scaling: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Return (cos, sin), each [batch, tokens, head_dim] float32, for int positions [batch, tokens]."""
    positions = np.asarray(positions)
    if positions.ndim != 2:
        raise ValueError(f"positions must be [batch, tokens], got shape {positions.shape}")
    freqs = positions.astype(np.float32)[..., None] * inv_freq.astype(np.float32)
    emb = np.concatenate((freqs, freqs), axis=-1)
    cos = np.cos(emb)
    sin = np.sin(emb)
    if attention_scaling != 1.0:
        cos = cos * np.float32(attention_scaling)
        sin = sin * np.float32(attention_scaling)
    return cos.astype(np.float32, copy=False), sin.astype(np.float32, copy=False)


def doubled_inv_freq(inv_freq: np.ndarray) -> np.ndarray:
    """``inv_freq`` twice over (float32): the per-channel frequencies of ``rope_one``."""
    inv = np.asarray(inv_freq, dtype=np.float32)
    return np.concatenate((inv, inv))


def rope_one(position: int, inv_freq2: np.ndarray, attention_scaling: float = 1.0
             ) -> tuple[np.ndarray, np.ndarray]:
    """``rope_tables`` of one token at ``position`` ([1, 1, head_dim] each, bit-identical),
    in a few numpy calls: the decode step's hot path (see ``doubled_inv_freq``)."""
    emb = np.float32(position) * inv_freq2
    cos, sin = np.cos(emb), np.sin(emb)
    if attention_scaling != 1.0:
        cos = cos * np.float32(attention_scaling)
        sin = sin * np.float32(attention_scaling)
    return cos.reshape(1, 1, -1), sin.reshape(1, 1, -1)


def rope_one_into(position: int, inv_freq2: np.ndarray, attention_scaling: float,
                  cos: np.ndarray, sin: np.ndarray) -> None:
    """``rope_one`` written into flat float32 [head_dim] arrays ``cos`` and ``sin``
    (bit-identical values, no new arrays but the product)."""
    emb = np.float32(position) * inv_freq2
    np.cos(emb, out=cos)
    np.sin(emb, out=sin)
    if attention_scaling != 1.0:
        np.multiply(cos, np.float32(attention_scaling), out=cos)
        np.multiply(sin, np.float32(attention_scaling), out=sin)
