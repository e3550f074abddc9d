"""The prefix cache's index: block-hash lookup, LRU eviction within the budget, covered
entries, live sources."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zctl.engine.prefix_index import PrefixIndex, block_hashes, common_prefix


def test_block_hashes_chain() -> None:
    a = block_hashes(list(range(40)), 16)
    b = block_hashes(list(range(32)) + [999] * 8, 16)
    assert len(a) == 2 and a == b  # a partial third block is not hashed
    c = block_hashes([7] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later hash
    assert common_prefix(np.arange(10), np.array([0, 1, 2, 9])) == 3


def test_the_longest_start_is_found_and_the_last_token_is_left_to_prefill() -> None:
    cache = PrefixIndex(10_000, block=4, min_hit=4)
    short, _ = cache.store(list(range(10)))
    long, _ = cache.store([*range(10), 50, 51, 52, 53, 54, 55])
    assert cache.entries() == [long]  # the short entry is a start of the long one: dropped
    hit = cache.lookup([*range(10), 50, 51, 99])
    assert hit is not None and hit.entry is long and hit.length == 12
    same = cache.lookup([*range(10), 50, 51, 52, 53, 54, 55])
    assert same is not None and same.length == 15  # one token is left to compute logits
    assert cache.lookup([1, 2, 3, 4, 5]) is None
    assert cache.stats.hits == 2 and cache.stats.tokens_saved == 27
    assert cache.stats.lookups == 3


def test_an_entry_serves_only_prompts_of_the_longrope_set_its_keys_turned_with() -> None:
    """Keys turned with LongRoPE's long set throughout (a prompt past the threshold) are
    no hit for a prompt of the short set, and the other way round; an entry covering one
    of the other set leaves it be; a live source keeps its set too."""
    cache = PrefixIndex(10_000, block=4, min_hit=4)
    short, _ = cache.store(list(range(12)))
    long, dropped = cache.store(list(range(20)), long_rope=True)
    assert short not in dropped and cache.entries() == [short, long]
    prompt = [*range(12), 99, 98]
    hit = cache.lookup(prompt)
    assert hit is not None and hit.entry is short and hit.length == 12
    hit = cache.lookup(prompt, long_rope=True)
    assert hit is not None and hit.entry is long and hit.length == 12
    cache.remove(short.entry_id)
    assert cache.lookup(prompt) is None  # refused: the long keys are the other set's
    cache.remove(long.entry_id)
    live = cache.track_live(7, list(range(16)), long_rope=True)
    assert cache.lookup(prompt) is None
    hit = cache.lookup(prompt, long_rope=True)
    assert hit is not None and hit.entry is live and live.live


def test_short_matches_are_not_hits() -> None:
    cache = PrefixIndex(1000, block=4, min_hit=8)
    cache.store(list(range(20)))
    assert cache.lookup([0, 1, 2, 3, 4, 5, 99, 98, 97]) is None


def test_eviction_keeps_the_budget_least_recently_used_first() -> None:
    cache = PrefixIndex(50, block=4, min_hit=4)
    a, _ = cache.store([1] * 20)
    b, _ = cache.store([2] * 20)
    assert cache.lookup([1] * 25) is not None  # a is now the most recently used
    c, dropped = cache.store([3] * 20)
    assert dropped == [b] and cache.tokens == 40 <= cache.budget_tokens
    assert {e.entry_id for e in cache.entries()} == {a.entry_id, c.entry_id}
    huge, dropped = cache.store([4] * 80)
    assert huge in dropped and cache.tokens <= cache.budget_tokens
    assert cache.stats.evictions >= 2


def test_live_sources_are_found_but_not_charged() -> None:
    cache = PrefixIndex(10, block=4, min_hit=4)
    cache.track_live(7, list(range(30)))
    hit = cache.lookup([*range(30), 1])
    assert hit is not None and hit.entry.live and hit.entry.stream_id == 7
    assert cache.tokens == 0 and cache.evict(10) == []
    cache.untrack_live(7)
    assert cache.lookup([*range(30), 1]) is None


def test_a_stored_entry_is_preferred_to_a_live_one_of_the_same_length() -> None:
    cache = PrefixIndex(1000, block=4, min_hit=4)
    cache.track_live(1, list(range(16)))
    stored, _ = cache.store(list(range(16)))
    hit = cache.lookup(list(range(17)))
    assert hit is not None and hit.entry is stored


def test_clear_returns_the_stored_entries() -> None:
    cache = PrefixIndex(1000, block=4, min_hit=4)
    cache.track_live(1, list(range(16)))
    stored, _ = cache.store([5] * 16)
    assert cache.clear() == [stored] and cache.entries() == []


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(-1)
    with pytest.raises(ValueError):
        PrefixIndex(10, block=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=40), min_size=1, max_size=12),
       st.integers(0, 120))
def test_the_budget_always_holds_and_hits_are_true_prefixes(stores, budget) -> None:
    cache = PrefixIndex(budget, block=4, min_hit=4)
    for tokens in stores:
        cache.store(tokens)
        assert cache.tokens <= budget
        probe = [*tokens, 9]
        hit = cache.lookup(probe)
        if hit is not None:
            assert hit.length <= len(probe) - 1
            assert list(hit.entry.tokens[:hit.length]) == probe[:hit.length]
