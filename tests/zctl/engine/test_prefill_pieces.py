"""Canonical prefill pieces (zctl.engine.prefill_pieces): where a prompt may be cut, what a
cached prefix may give, and a session's prefill and replay planned by them."""

from __future__ import annotations

import numpy as np
import pytest

from tests.zctl.engine.test_scheduler import CountingModel, fake_greedy
from tests.zctl.engine.test_sessions import drive_with_kv_losses
from zctl.engine.prefill_pieces import ANYWHERE, CANONICAL, PieceRule
from zctl.engine.sessions import DecodeSession, PrefillProgress

BLOCKS = PieceRule(32)  # per-channel keys' rule: a u8 cache's 32-token blocks


def pieces_of(rule: PieceRule, size: int, chunk: int, start: int = 0) -> list[tuple[int, int]]:
    progress, out = PrefillProgress(np.arange(size), start), []
    while progress.left:
        out.append(progress.plan(chunk, rule, size))
    return out


def test_canonical_pieces_end_where_the_chunks_do() -> None:
    assert pieces_of(CANONICAL, 100, 40) == [(0, 40), (40, 80), (80, 100)]
    assert pieces_of(CANONICAL, 20, 8) == [(0, 8), (8, 16), (16, 20)]


def test_block_pieces_end_on_block_boundaries_but_the_last() -> None:
    assert pieces_of(BLOCKS, 100, 40) == [(0, 32), (32, 64), (64, 100)]
    assert pieces_of(BLOCKS, 100, 70) == [(0, 64), (64, 100)]
    assert pieces_of(BLOCKS, 20, 8) == [(0, 20)]  # no boundary inside: one piece
    # a chunk shorter than a block runs to the next boundary (never nothing)
    assert pieces_of(BLOCKS, 80, 10) == [(0, 32), (32, 64), (64, 80)]


def test_no_piece_is_a_lone_token_unless_the_prompt_is() -> None:
    assert pieces_of(BLOCKS, 65, 32) == [(0, 32), (32, 65)]  # not (64, 65)
    assert pieces_of(BLOCKS, 33, 64) == [(0, 33)]
    assert pieces_of(CANONICAL, 1, 8) == [(0, 1)]
    assert pieces_of(CANONICAL, 10, 1) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert pieces_of(CANONICAL, 9, 4) == [(0, 4), (4, 9)]  # not (8, 9)


def test_anywhere_cuts_where_asked() -> None:
    assert pieces_of(ANYWHERE, 10, 3) == [(0, 3), (3, 6), (6, 9), (9, 10)]


def test_a_cached_prefix_ends_anywhere_but_leaves_two_tokens() -> None:
    assert CANONICAL.usable_prefix(90, 100) == 90
    assert CANONICAL.usable_prefix(99, 100) == 98 and CANONICAL.usable_prefix(100, 100) == 98
    assert CANONICAL.usable_prefix(1, 2) == 0
    assert ANYWHERE.usable_prefix(99, 100) == 99 and ANYWHERE.usable_prefix(5, 100) == 5
    assert pieces_of(CANONICAL, 100, 4096, start=98) == [(98, 100)]


def test_a_block_rules_prefix_ends_on_a_boundary_and_leaves_two_tokens() -> None:
    assert BLOCKS.usable_prefix(90, 100) == 64
    assert BLOCKS.usable_prefix(99, 100) == 96
    assert BLOCKS.usable_prefix(64, 66) == 64 and BLOCKS.usable_prefix(64, 65) == 32
    assert BLOCKS.usable_prefix(20, 100) == 0
    assert pieces_of(BLOCKS, 100, 4096, start=64) == [(64, 100)]


def test_bad_pieces_and_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="no piece"):
        CANONICAL.cut(10, 10, 20)
    with pytest.raises(ValueError, match="no piece"):
        CANONICAL.cut(20, 30, 20)
    with pytest.raises(ValueError, match=">= 0"):
        PieceRule(-1)
    assert CANONICAL == PieceRule(1)


def test_a_replay_feeds_the_prompt_in_pieces_then_each_emitted_token_alone() -> None:
    """Where the stages compute no one-query step (tests/zctl/engine/test_one_query.py:
    where they do)."""
    model = CountingModel()
    session = DecodeSession(0, list(range(1, 41)), 8, prefill_chunk=16)
    session.pieces = BLOCKS
    drive_with_kv_losses(model, session, {4})  # the prompt, 3 decode steps, then lost
    fed = [(s[2][0], s[2][-1] + 1) for s in model.steps if s[1]]
    assert fed[:4] == [(0, 32), (32, 40), (40, 41), (41, 42)]
    assert fed[4:9] == [(0, 32), (32, 40), (40, 41), (41, 42), (42, 43)]  # the replay
    assert session.emitted == fake_greedy(list(range(1, 41)), 8)
