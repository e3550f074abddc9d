"""Host-side RoPE tables (dataplane.runtime.rope) are pure functions; check them against HF."""

from __future__ import annotations

import numpy as np
import pytest

from dataplane.runtime.base import StageError
from dataplane.runtime.rope import LongSequences, RopeRows, StageRope, StageRopeRows, rope_tables


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


def _phi3_longrope(short_context: int = 16):
    """A Phi-3 config with LongRoPE (short and long factors random, not equal) over the
    first 12 of its 16-wide heads, and Hugging Face's rotary module of it."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rng = np.random.default_rng(1)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": rng.uniform(1, 2, 6).tolist(),
            "long_factor": rng.uniform(2, 8, 6).tolist(),
            "original_max_position_embeddings": short_context}
    config = AutoConfig.for_model("phi3", hidden_size=64, num_attention_heads=4,
                                  max_position_embeddings=512, rope_parameters=rope,
                                  original_max_position_embeddings=short_context,
                                  pad_token_id=None)
    return config, Phi3RotaryEmbedding(config)


def _stage_rope(config, rotary) -> StageRope:
    """The StageRope an export of ``config`` records (exporter.sources' way)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    short_context = config.rope_parameters["original_max_position_embeddings"]
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=short_context + 1)
    return StageRope(rotary.original_inv_freq.numpy(), long.numpy(), short_context,
                     rotary.attention_scaling)


def test_longrope_turns_each_token_as_hugging_faces_greedy_generation() -> None:
    """Against Hugging Face's rotary module stepped as its greedy generation steps (a
    prompt in one pass, then one token a pass): a step starting a sequence turns with the
    short set while its highest position is below original_max_position_embeddings (16),
    else every token with the long one (prompts of 16 and 17); any other step's tokens
    each as a one-token step at their position would (decode steps at 15 and 16, a
    verification step spanning 16). Rows of a row group or ragged rows: each as alone."""
    torch = pytest.importorskip("torch")
    config, rotary = _phi3_longrope(16)
    rope = _stage_rope(config, rotary)
    assert rope.width == 12 and not np.array_equal(rope.short, rope.long)

    def hugging_face(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        passes = [positions] if positions[0] == 0 else [positions[i:i + 1]
                                                         for i in range(positions.size)]
        tables = [rotary(torch.zeros(1), torch.from_numpy(p)[None]) for p in passes]
        return (torch.cat([c for c, _ in tables], dim=1).numpy(),
                torch.cat([s for _, s in tables], dim=1).numpy())

    steps = [np.arange(16), np.arange(17), np.array([15]), np.array([16]), np.arange(13, 18)]
    for positions in steps:
        want_cos, want_sin = hugging_face(positions)
        cos, sin = rope.tables(positions[None])
        np.testing.assert_allclose(cos, want_cos, rtol=0, atol=2e-6)
        np.testing.assert_allclose(sin, want_sin, rtol=0, atol=2e-6)
        other = np.array([[40] * positions.size])  # a row past the threshold beside it
        rows_cos, _ = rope.tables(np.concatenate((other, positions[None])))
        assert np.array_equal(rows_cos[1], cos[0])
        flat = np.concatenate(([0, 1], positions))[None]  # ragged after a short prompt
        ragged_cos, _ = rope.tables(flat, [2, positions.size])
        assert np.array_equal(ragged_cos[0, 2:], cos[0])
        assert np.array_equal(ragged_cos[0, :2], rope.tables(np.array([[0, 1]]))[0][0])
    # the sets differ where it matters: position 15 in a prompt of 16 and of 17 tokens
    assert not np.array_equal(rope.tables(np.arange(16)[None])[0][0, 15],
                              rope.tables(np.arange(17)[None])[0][0, 15])
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        rope.tables(np.arange(3))


def test_longrope_rows_keep_a_cache_per_set() -> None:
    """A one-token step's row (its position is its step's highest) comes from the set its
    position picks, each set's blocks cached apart."""
    pytest.importorskip("torch")
    rope = _stage_rope(*_phi3_longrope(300))
    rows = StageRopeRows(rope, max_blocks=2)
    for position in (0, 299, 300, 301, 1000, 5):
        cos, sin = rows.one(position)
        want_cos, want_sin = rope.tables(np.array([[position]]))
        assert np.array_equal(cos, want_cos) and np.array_equal(sin, want_sin)
    assert rows.long is not None
    assert set(rows.short._blocks) == {0, 1} and set(rows.long._blocks) == {1, 3}
    plain = StageRopeRows(StageRope(rope.short))  # no long set: every position short
    assert plain.long is None and np.array_equal(plain.one(1000)[0],
                                                 rope_tables(np.array([[1000]]), rope.short)[0])


def test_a_long_sequence_turns_every_token_long_in_every_piece() -> None:
    """A sequence whose prompt passed the threshold (``long_rows``) turns every token with
    the long set, in whatever pieces its prompt comes (Hugging Face's one pass over a
    prompt of 20 tokens, threshold 16), row by row, ragged too; other rows as before."""
    torch = pytest.importorskip("torch")
    config, rotary = _phi3_longrope(16)
    rope = _stage_rope(config, rotary)
    want_cos, want_sin = (t.numpy() for t in rotary(torch.zeros(1),
                                                    torch.arange(20)[None]))
    for cut in (2, 5, 8, 15):  # the first piece below the threshold, the next spanning it
        pieces = [np.arange(cut)[None], np.arange(cut, 20)[None]]
        got = [rope.tables(p, long_rows=np.array([True])) for p in pieces]
        np.testing.assert_allclose(np.concatenate([c for c, _ in got], axis=1), want_cos,
                                   rtol=0, atol=2e-6)
        np.testing.assert_allclose(np.concatenate([s for _, s in got], axis=1), want_sin,
                                   rtol=0, atol=2e-6)
        short_first = rope.tables(pieces[0])[0]  # not said to be long: short below 16
        assert not np.allclose(short_first, got[0][0], atol=1e-4)
    piece = np.arange(4, 8)
    rows = np.stack((piece, piece))  # a long row and a short one at the same positions
    rows_cos, _ = rope.tables(rows, long_rows=np.array([True, False]))
    assert np.array_equal(rows_cos[0], rope.tables(piece[None], long_rows=np.array([True]))[0][0])
    assert np.array_equal(rows_cos[1], rope.tables(piece[None])[0][0])
    flat = np.concatenate((piece, [3], piece))[None]  # ragged: long 4, short 1, long 4
    ragged_cos, _ = rope.tables(flat, [4, 1, 4], np.array([True, False, True]))
    assert np.array_equal(ragged_cos[0, :4], rows_cos[0])
    assert np.array_equal(ragged_cos[0, 5:], rows_cos[0])
    assert np.array_equal(ragged_cos[0, 4], rope.tables(np.array([[3]]))[0][0, 0])
    one = StageRopeRows(rope)  # a one-token step of a long sequence below the threshold
    assert np.array_equal(one.one(3, long_rope=True)[0],
                          rope.tables(np.array([[3]]), long_rows=np.array([True]))[0])
    assert not np.array_equal(one.one(3, long_rope=True)[0], one.one(3)[0])


def test_long_sequences_are_kept_per_stream_until_reset_or_closed() -> None:
    pytest.importorskip("torch")
    rope = _stage_rope(*_phi3_longrope(16))
    streams = LongSequences(rope, stage=2)
    assert streams.rows([1, 2]) is None  # none long: the tables' fast path
    streams.begin(1, True)
    streams.begin(2, False)
    assert 1 in streams and streams.rows([2, 1]).tolist() == [False, True]
    streams.begin(1, False)  # a new, short sequence on the stream
    assert streams.rows([1]) is None
    streams.begin(3, True)
    streams.forget(3)
    assert 3 not in streams
    one_set = LongSequences(StageRope(rope.short), stage=2)
    with pytest.raises(StageError, match="stage 2's model has one set"):
        one_set.begin(5, True)
    assert 5 not in one_set
    one_set.begin(5, False)  # a short sequence is every sequence there
