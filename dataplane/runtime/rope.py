"""Rotary position embeddings computed on the host, fed to every stage as inputs.

The exporter records the model's inverse frequencies (whatever its rope type) and
attention scaling; these pure functions turn logical positions into cos/sin exactly
as Hugging Face does (float32 product, then cos/sin, then scaling). A model whose
sliding-window layers have frequencies of their own (Gemma 3) records those too: its
stages take one table of both, twice as wide (``stage_frequencies``).
"""

from __future__ import annotations

import numpy as np

from zctl.manifest import ModelSpec


def stage_frequencies(model: ModelSpec) -> np.ndarray:
    """The frequencies of a stage's rope_cos/rope_sin: the model's, followed by its
    sliding layers' own when it has them. ``rope_tables`` of these lays out cos(f, f) =
    global, local, global, local quarters, from which each layer takes its table
    (exporter.stage_module.split_rope); a model of one table gets it as before."""
    return np.asarray(model.rope_inv_freq + model.rope_local_inv_freq, dtype=np.float32)


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


class RopeRows:
    """``rope_tables`` rows by position, computed a block of positions at a time: a decode
    step copies its row (two slice copies) instead of computing cos and sin, which costs
    several times more right after an inference, when the host's caches are cold.

    The rows are rope_tables' own values. At most ``max_blocks`` blocks are kept (the
    oldest goes first): streams decode at a few positions at a time.
    """

    BLOCK = 256

    def __init__(self, inv_freq: np.ndarray, attention_scaling: float = 1.0,
                 max_blocks: int = 16) -> None:
        self.inv_freq = np.asarray(inv_freq, dtype=np.float32)
        self.attention_scaling = attention_scaling
        self.max_blocks = max_blocks
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        start = index * self.BLOCK
        positions = np.arange(start, start + self.BLOCK, dtype=np.int64)[None]
        cos, sin = rope_tables(positions, self.inv_freq, self.attention_scaling)
        while len(self._blocks) >= self.max_blocks:  # the oldest block goes first
            del self._blocks[next(iter(self._blocks))]
        block = self._blocks[index] = (cos[0], sin[0])
        return block

    def into(self, position: int, cos: np.ndarray, sin: np.ndarray) -> None:
        """Write the [head_dim] cos and sin rows of ``position`` into ``cos`` and ``sin``."""
        if position < 0:
            raise ValueError(f"positions must be >= 0, got {position}")
        index, row = divmod(position, self.BLOCK)
        block = self._blocks.get(index) or self._block(index)
        cos[:] = block[0][row]
        sin[:] = block[1][row]

    def one(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """The [1, 1, head_dim] cos and sin of one token at ``position`` (new arrays)."""
        head_dim = 2 * self.inv_freq.shape[0]
        cos = np.empty((1, 1, head_dim), dtype=np.float32)
        sin = np.empty((1, 1, head_dim), dtype=np.float32)
        self.into(position, cos.reshape(-1), sin.reshape(-1))
        return cos, sin
