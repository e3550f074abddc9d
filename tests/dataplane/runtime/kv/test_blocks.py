"""The KV block tables' pure parts: what a sliding layer keeps of a sequence."""

from __future__ import annotations

import pytest

from dataplane.runtime.kv.blocks import (
    KvLayout,
    PagedSequence,
    SlidingWindow,
    blocks_for,
    window_table,
)


def test_a_sliding_layer_keeps_the_blocks_of_its_window_and_margin() -> None:
    window = SlidingWindow(window=8, margin=4, block_size=4)
    # the query at position 20 sees keys 13..20: block 3 on
    assert window.needed_from(20) == 13 // 4 == 3
    # after a rewind of 4 the query at 16 sees keys 9..16: block 2 on
    assert window.kept_from(20) == window.needed_from(16) == 2
    assert window.needed_from(5) == window.kept_from(5) == 0  # the window reaches the start
    # kept blocks for any length, and a step of 4 more tokens, stay within the bound
    for length in range(200):
        held = blocks_for(length + 4, 4) - window.kept_from(length)
        assert held <= window.blocks_bound(4)


def test_a_sliding_table_points_freed_entries_at_the_unwritten_block() -> None:
    seq = PagedSequence(KvLayout(block_size=4, layers=2, sliding=1), blocks=[10, 11, 12, 13],
                        length=16, window_blocks=[5, 6], window_first=2)
    assert window_table(seq, 4, 99) == [99, 99, 5, 6]
    assert window_table(seq, 3, 99) == [99, 99, 5]
    assert window_table(seq, 1, 99) == [99]


@pytest.mark.parametrize("args", [(0, 4, 32), (8, -1, 32), (8, 4, 0)])
def test_a_window_of_no_key_or_a_negative_margin_is_refused(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="a sliding window of at least 1 key"):
        SlidingWindow(*args)


def test_a_sequences_held_slots_leave_out_what_its_sliding_layers_freed() -> None:
    """Status counts the slots a stream holds averaged over its stage's layers."""
    layout = KvLayout(block_size=32, layers=4, sliding=3)
    seq = PagedSequence(layout, blocks=[1, 2, 3, 4], length=100, window_blocks=[7, 8],
                        window_first=2)
    assert seq.held == 100 - round(0.75 * 64) and seq.physical == 100
    # a sequence shorter than its freed entries span frees no more than it holds
    assert PagedSequence(layout, blocks=[1, 2], length=40, window_first=2).held == \
        40 - round(0.75 * 40)
    no_sliding = KvLayout(block_size=32, layers=4)
    assert PagedSequence(no_sliding, blocks=[1], length=20).held == 20


@pytest.mark.parametrize("args", [(0, 4, 0), (32, 0, 0), (32, 4, 5), (32, 4, -1)])
def test_a_layout_of_empty_blocks_no_layer_or_more_sliding_layers_than_layers_is_refused(
        args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="a KV layout needs blocks of at least 1 slot"):
        KvLayout(*args)


def test_the_sliding_margin_is_the_engines_deepest_rewind() -> None:
    """RuntimeSpec states the margin as a number (its module imports no engine): it must
    stay pipelined speculation's runs in flight of the most drafts each."""
    from dataplane.runtime.config import RuntimeSpec
    from zctl.engine.pipelined import DEPTH_MAX
    from zctl.engine.requests import MAX_DRAFT_TOKENS

    assert RuntimeSpec.sliding_margin == DEPTH_MAX * (MAX_DRAFT_TOKENS + 1)
