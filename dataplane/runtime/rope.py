"""Rotary position embeddings computed on the host, fed to every stage as inputs.

The exporter records the model's inverse frequencies (whatever its rope type) and
attention scaling; these pure functions turn logical positions into cos/sin exactly
as Hugging Face does (float32 product, then cos/sin, then scaling). A model whose
sliding-window layers have frequencies of their own (Gemma 3) records those too: its
stages take one table of both, twice as wide (``stage_frequencies``). A model with partial
RoPE (Phi-4-mini) has frequencies for its rotated dimensions only, and its tables are as
narrow (the stage passes the rest of each head through).

LongRoPE (``StageRope``) has two sets of frequencies, the short factors' and the long
factors'. Hugging Face picks one per forward pass from the pass's highest position: the
long set once that position reaches original_max_position_embeddings
(``rope_short_context``), for every token of the pass; the keys already cached keep the
rotation they were made with. zctl computes every token as Hugging Face's greedy
generation does, a prompt in one pass and then one token a pass. A sequence whose prompt
is longer than the threshold turns with the long set throughout: the engine says so when
it resets the stream (``long_rope``), so every piece of a prompt cut into several (a
chunked prefill, the rest of a prefix-cache hit) turns as the one pass would; the stage
keeps that per stream (``LongSequences``). Any other sequence's tokens each turn with the
set of their own position, as the one-token steps computing them one by one would; a row
not said to be long whose step starts its sequence (first position 0: a prompt in one
step) turns with the set its highest position picks. So a verification step spanning the
threshold (speculation) turns its tokens as plain decoding does, and a rewind drops keys
whose rotation the recomputed tokens would pick again. The rows of a row group are
separate sequences: each row picks for itself, as it would stepped alone (a Hugging Face
batch would take the highest position of the whole batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dataplane.runtime.base import StageError
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
    """Return (cos, sin), each [batch, tokens, 2 x F] float32, for int positions [batch,
    tokens] and frequencies ``inv_freq`` [F], or [batch, tokens or 1, F] (each token's own)."""
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


@dataclass(frozen=True)
class StageRope:
    """What a stage's rope_cos/rope_sin are computed from: its frequencies, LongRoPE's long
    set (None: one set for every position) and the context the short set covers, and the
    attention scaling both share."""

    short: np.ndarray
    long: np.ndarray | None = None
    short_context: int = 0
    attention_scaling: float = 1.0

    @property
    def width(self) -> int:
        """The width of the rope_cos/rope_sin inputs."""
        return 2 * int(self.short.shape[0])

    def long_tokens(self, positions: np.ndarray, row_tokens: Sequence[int] | None = None,
                    long_rows: np.ndarray | None = None) -> np.ndarray:
        """Which tokens of a step turn with the long set (bool, ``positions``' shape), rows
        as ``tables`` takes them: every token of a row in ``long_rows`` (bool, one per row;
        None: none); of another row starting at position 0, all alike, from its highest
        position; of any other row, each from its own position."""
        if self.long is None:
            return np.zeros(positions.shape, dtype=bool)
        own = positions >= self.short_context
        if row_tokens is None:
            starts = positions[:, :1] == 0
            own = np.where(starts, own.any(axis=1, keepdims=True), own)
            if long_rows is not None:
                own |= np.asarray(long_rows, dtype=bool).reshape(-1, 1)
            return own
        flat, first, start = own.reshape(-1), positions.reshape(-1), 0  # views
        for row, count in enumerate(row_tokens):
            end = start + int(count)
            if end > start and long_rows is not None and long_rows[row]:
                flat[start:end] = True
            elif end > start and first[start] == 0:
                flat[start:end] = flat[start:end].any()
            start = end
        return own

    def tables(self, positions: np.ndarray, row_tokens: Sequence[int] | None = None,
               long_rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``rope_tables`` of a step, each token with its set (``long_tokens``):
        ``positions`` [rows, T], or, with ``row_tokens`` (ragged rows), [1, N] holding the
        rows' tokens one after the other (positions beyond the rows' counts, padding, each
        take their own position's set); ``long_rows`` the rows whose sequences turn long
        throughout (None: none)."""
        positions = np.asarray(positions)
        if positions.ndim != 2:
            raise ValueError(f"positions must be [batch, tokens], got shape {positions.shape}")
        if self.long is None or positions.size == 0:
            return rope_tables(positions, self.short, self.attention_scaling)
        long = self.long_tokens(positions, row_tokens, long_rows)
        if not long.any():
            return rope_tables(positions, self.short, self.attention_scaling)
        if long.all():
            return rope_tables(positions, self.long, self.attention_scaling)
        inv_freq = np.where(long[..., None], self.long, self.short)
        return rope_tables(positions, inv_freq, self.attention_scaling)


class LongSequences:
    """The streams of a stage whose sequences turn with LongRoPE's long set throughout
    (their prompts are longer than its threshold), as the engine said when it reset them;
    a stream stays so until it is reset or closed, as a row of a row group too."""

    def __init__(self, rope: StageRope, stage: int) -> None:
        self.rope, self.stage = rope, stage
        self._long: set[int] = set()

    def begin(self, stream_id: int, long_rope: bool) -> None:
        """A new sequence on ``stream_id``: long throughout or not. StageError for a long
        one on a model with one set (nothing changes)."""
        if long_rope and self.rope.long is None:
            raise StageError(f"stream {stream_id} was reset to turn with LongRoPE's long set, "
                             f"but stage {self.stage}'s model has one set of frequencies")
        if long_rope:
            self._long.add(stream_id)
        else:
            self._long.discard(stream_id)

    def forget(self, stream_id: int) -> None:
        self._long.discard(stream_id)

    def __contains__(self, stream_id: int) -> bool:
        return stream_id in self._long

    def rows(self, stream_ids: Sequence[int]) -> np.ndarray | None:
        """Which of ``stream_ids`` (a step's rows) are long, or None when none is."""
        if not self._long:
            return None
        rows = np.fromiter((sid in self._long for sid in stream_ids), dtype=bool,
                           count=len(stream_ids))
        return rows if rows.any() else None


def stage_rope(model: ModelSpec) -> StageRope:
    """The StageRope of ``model``'s stages (the long set with the sliding layers' own after
    it, as ``stage_frequencies`` lays out the short one)."""
    long = None
    if model.rope_long_inv_freq:
        long = np.asarray(model.rope_long_inv_freq + model.rope_local_inv_freq, dtype=np.float32)
    return StageRope(stage_frequencies(model), long, model.rope_short_context,
                     model.rope_attention_scaling)


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


class StageRopeRows:
    """RopeRows of each set of a StageRope, one cache a set: a one-token step's row comes
    from the set its position picks (``StageRope.long_tokens`` of one token)."""

    def __init__(self, rope: StageRope, max_blocks: int = 16) -> None:
        self.rope = rope
        self.short = RopeRows(rope.short, rope.attention_scaling, max_blocks)
        self.long = None if rope.long is None else RopeRows(rope.long, rope.attention_scaling,
                                                           max_blocks)

    def _rows(self, position: int, long_rope: bool) -> RopeRows:
        if self.long is not None and (long_rope or position >= self.rope.short_context):
            return self.long
        return self.short

    def into(self, position: int, cos: np.ndarray, sin: np.ndarray,
             long_rope: bool = False) -> None:
        """Write the cos and sin rows of ``position`` into ``cos`` and ``sin`` (``long_rope``:
        of a sequence long throughout)."""
        self._rows(position, long_rope).into(position, cos, sin)

    def one(self, position: int, long_rope: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The [1, 1, width] cos and sin of one token at ``position`` (new arrays)."""
        return self._rows(position, long_rope).one(position)
