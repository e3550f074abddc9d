"""Prefix entries on stage runners and LocalChain: a stream that loads a saved prefix and
prefills only the rest computes what a stream that prefilled everything computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.base import StageError
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.kv.prefix_entries import first_kept, prefix_table
from dataplane.runtime.kv.slots import request_states
from dataplane.wire.frames import FrameError, HiddenStateFrame, Kind, decode_frame, encode_frame
from dataplane.wire.prefix_ops import PrefixOp, prefix_command, prefix_payload
from tests.helpers.prefixes import EXACT, MORE, P, Q, assert_same_continuation, logits, run_on, scratch
from zctl.engine.executor import InlineExecutor, PrefixCacheUnsupported


@pytest.fixture
def chain(dp_export2: Path) -> LocalChain:
    return LocalChain.load(str(dp_export2), EXACT)


# -- the pure parts -----------------------------------------------------------------------

def test_first_kept_slots_and_prefix_tables() -> None:
    rng = np.random.default_rng(0)
    states = {n: rng.standard_normal((2, 2, 6, 3)).astype(np.float32) for n in ("k", "v")}
    keep = np.array([True, False, True, True, False, True])
    got = first_kept(states, 1, keep, 3)
    for name, data in states.items():
        assert got[name].flags.c_contiguous and got[name].shape == (1, 2, 3, 3)
        np.testing.assert_array_equal(got[name][0], data[1][:, [0, 2, 3]])
        assert not np.shares_memory(got[name], data)
    whole = first_kept(states, 0, np.ones(6, bool), 4)  # no masked slot: one slice, a copy
    np.testing.assert_array_equal(whole["k"][0], states["k"][0][:, :4])
    assert not np.shares_memory(whole["k"], states["k"])
    assert np.shares_memory(first_kept(states, 0, np.ones(6, bool), 4, copy=False)["k"],
                            states["k"])  # views, for a load that uses them at once
    assert prefix_table(keep, 2).tolist() == [True, False, True, False, False, False]
    assert prefix_table(keep, 9).tolist() == keep.tolist()


def test_prefix_frames_round_trip_and_bad_ones_are_malformed() -> None:
    header = HiddenStateFrame(Kind.PREFIX, 5, 0, 77)
    got, payload = decode_frame(encode_frame(header, prefix_payload(PrefixOp.LOAD, 3, 9, True, 5)))
    command = prefix_command(got, payload)
    assert (got.kind, got.epoch) == (Kind.PREFIX, 77)
    assert command == (PrefixOp.LOAD, 3, 9, True, 5)
    for bad, why in ((np.zeros(5, np.float32), "only int64"), (np.zeros(4, np.int64), "only int64"),
                     (None, "only int64")):
        with pytest.raises(FrameError, match=why):
            decode_frame(encode_frame(header, bad))
    for values, why in (([9, 1, 1, 0, 5], "bad PREFIX payload"), ([1, 1, 1, 2, 5], "bad PREFIX"),
                        ([2, 1, -1, 0, 5], "bad PREFIX"), ([2, 1, 1, 0, 6], "names stream 5")):
        with pytest.raises(FrameError, match=why):
            prefix_command(header, np.array(values, np.int64))
    prefix_command(header, np.array([1, 1, 1, 0, 6], np.int64))  # a copy may save any row


# -- runners and LocalChain ---------------------------------------------------------------

@pytest.mark.parametrize("length", [len(P), 6])
@pytest.mark.parametrize("save_take, load_take", [(False, False), (False, True), (True, False),
                                                  (True, True)])
def test_a_loaded_prefix_continues_like_a_full_prefill(chain: LocalChain, save_take: bool,
                                                       load_take: bool, length: int) -> None:
    want = scratch(chain, 9, P + MORE, len(P) - length + len(MORE))
    chain.open(1)
    chain.reset(1)
    logits(chain, 1, P, 0)
    logits(chain, 1, [5, 6], len(P))  # the source runs on past the prefix
    source = [r.streams[1].keep.copy() for r in chain.runners]
    chain.save_prefix(1, 7, len(P), take=save_take)
    assert all((1 in r.streams) != save_take for r in chain.runners)
    assert all(b > 0 for b in chain.prefix_bytes().values())
    chain.open(2)
    chain.reset(2)
    chain.load_prefix(2, 7, length, take=load_take)
    slots = chain.runners[1].streams[2]
    assert slots.logical == length and slots.physical == (len(source[1]) if save_take and load_take
                                                          else length)
    got = run_on(chain, 2, P[length:] + MORE, length)
    assert_same_continuation(got, want)
    chain.open(3)
    chain.reset(3)
    if load_take:
        assert chain.prefix_bytes() == {0: 0, 1: 0}
        with pytest.raises(StageError, match="prefix entry 7 does not exist on stage 0"):
            chain.load_prefix(3, 7, length)
    else:  # the entry stays as it was: another stream loading it computes the same, exactly
        chain.load_prefix(3, 7, length)
        np.testing.assert_array_equal(run_on(chain, 3, P[length:] + MORE, length), got)


@pytest.mark.parametrize("take", [False, True])
def test_a_source_with_masked_slots_gives_its_kept_tokens(chain: LocalChain, take: bool) -> None:
    length = len(P) - 2
    want = scratch(chain, 9, P + MORE, len(P) - length + len(MORE))
    chain.open(1)
    chain.reset(1)
    logits(chain, 1, P[:5], 0)
    logits(chain, 1, [300, 301, 302], 5)  # a rejected draft: masked, in the middle once P goes on
    chain.rewind(1, 3)
    logits(chain, 1, P[5:], 5)
    runner = chain.runners[0]
    assert runner.masked_slots(1) == 3
    kept = {i: request_states(r.streams[1].request) for i, r in enumerate(chain.runners)}
    keep = runner.streams[1].keep.copy()
    chain.save_prefix(1, 4, len(P), take=take)
    chain.open(2)
    chain.reset(2)
    chain.load_prefix(2, 4, length, take=take)
    if not take:  # copied: exactly the first kept slots, and nothing else
        for i, r in enumerate(chain.runners):
            loaded = request_states(r.streams[2].request)
            for name, data in loaded.items():
                np.testing.assert_array_equal(data, kept[i][name][:, :, np.flatnonzero(keep)[:length]])
    else:  # the request itself, with the slots after the prefix masked (no copy)
        assert runner.streams[2].physical == len(keep) and runner.streams[2].logical == length
    assert_same_continuation(run_on(chain, 2, P[length:] + MORE, length), want)


def test_a_row_of_a_row_group_as_the_source(chain: LocalChain) -> None:
    gid = 1 << 30
    for sid, prompt in ((1, P), (2, Q)):
        chain.open(sid)
        chain.reset(sid)
        logits(chain, sid, prompt, 0)
    chain.regroup(gid, [1, 2])
    last = {1: 5, 2: 6}
    rows = {1: [], 2: []}
    for i in range(2):  # two steps as rows of one inference
        reply = chain.step(gid, np.array([last[1], last[2]]),
                           np.array([len(P) + i, len(Q) + i]))
        for sid, token in zip((1, 2), reply.tokens.tolist(), strict=True):
            rows[sid].append(last[sid])
            last[sid] = token
    source = Q + rows[2]
    want = scratch(chain, 9, source + MORE, len(MORE))
    with pytest.raises(StageError, match="row of row group"):
        chain.save_prefix(2, 5, len(source), take=True)
    chain.save_prefix(2, 5, len(source))
    assert chain.runners[1].groups[gid].members == [1, 2]  # the row stays in its group
    chain.open(3)
    chain.reset(3)
    chain.load_prefix(3, 5, len(source))
    # the row's KV was computed batched, the reference's alone: equal up to float rounding
    assert_same_continuation(run_on(chain, 3, MORE, len(source)), want, {"atol": 1e-4})
    with pytest.raises(StageError, match="row of row group"):
        chain.load_prefix(2, 5, 3)
    chain.step(gid, np.array([last[1], last[2]]), np.array([len(P) + 2, len(Q) + 2]))


def test_bytes_per_token_and_drops(chain: LocalChain, dp_export2: Path) -> None:
    runner = chain.runners[0]
    model = runner.manifest.model
    per_layer = model.num_kv_heads * model.head_dim
    assert runner.kv_bytes_per_token == runner.spec.num_layers * per_layer * 2 * 4  # f32 KV
    u8 = LocalChain.load(str(dp_export2), RuntimeSpec(precision="f32")).runners[0]
    assert u8.compiled.get_property("KV_CACHE_PRECISION").bitwidth == 8  # the CPU default here
    assert u8.kv_bytes_per_token == runner.spec.num_layers * per_layer * 2
    chain.open(1)
    chain.reset(1)
    logits(chain, 1, P, 0)
    chain.save_prefix(1, 1, 4)
    chain.save_prefix(1, 2, len(P))
    assert chain.prefix_bytes() == {i: (4 + len(P)) * r.kv_bytes_per_token
                                    for i, r in enumerate(chain.runners)}
    chain.save_prefix(1, 2, 3)  # an id saved again is replaced
    chain.drop_prefix(1)
    chain.drop_prefix(12345)  # unknown: no error
    assert chain.prefix_bytes() == {i: 3 * r.kv_bytes_per_token for i, r in enumerate(chain.runners)}
    chain.save_prefix(1, 3, len(P), take=True)  # the request: its physical slots
    assert chain.prefix_bytes()[0] == (3 + len(P)) * runner.kv_bytes_per_token
    chain.drop_all_prefixes()
    assert chain.prefix_bytes() == {0: 0, 1: 0} and not runner.prefixes.entries


def test_bad_saves_and_loads_are_refused_and_change_nothing(chain: LocalChain) -> None:
    chain.open(1)
    chain.reset(1)
    logits(chain, 1, P[:5], 0)
    chain.save_prefix(1, 1, 5)
    chain.open(2)
    chain.reset(2)
    logits(chain, 2, [4, 4], 0)
    before = [r.streams[2].keep.copy() for r in chain.runners]
    for args, why in (((2, 99, 3), "prefix entry 99 does not exist on stage 0"),
                      ((2, 1, 6), "entry 1 holds 5 tokens on stage 0: cannot load 6"),
                      ((2, 1, 0), "cannot load 0"),
                      ((8, 1, 3), "stream 8 is not open on stage 0")):
        with pytest.raises(StageError, match=why):
            chain.load_prefix(*args)
    assert [r.streams[2].keep.tolist() for r in chain.runners] == [b.tolist() for b in before]
    logits(chain, 2, [5], 2)  # the stream steps on as it was
    for args, why in (((8, 1, 3), "stream 8 is not open on stage 0: no prefix to save"),
                      ((1, 1, 6), "stream 1 holds 5 tokens on stage 0: cannot save a prefix of 6")):
        with pytest.raises(StageError, match=why):
            chain.save_prefix(*args)
    assert chain.prefix_bytes() == {0: 0, 1: 0}  # a failed save leaves no entry of its id
    with pytest.raises(StageError, match="does not exist"):
        chain.load_prefix(2, 1, 3)
    # a later stage refusing (its entry is gone): the stream is left empty on every stage
    chain.save_prefix(1, 2, 5)
    chain.runners[1].drop_prefix(2)
    with pytest.raises(StageError, match="prefix entry 2 does not exist on stage 1"):
        chain.load_prefix(2, 2, 5)
    assert all(r.streams[2].physical == 0 for r in chain.runners)


class NoCache(InlineExecutor):
    num_stages = 1


def test_executors_without_a_prefix_cache_refuse(tiny_exports) -> None:  # noqa: ANN001
    from dataplane.head.cluster_head import ClusterHead

    export = tiny_exports.get([(0, 2), (2, 4)], static=(48, 4))
    static = LocalChain.load(str(export), EXACT)
    head = ClusterHead(static.runners[0], "tcp://127.0.0.1:1", "tcp://127.0.0.1:*")
    for ex in (static, NoCache(), head):
        assert not ex.prefix_cache_supported
        for call in (ex.save_prefix, ex.load_prefix):
            with pytest.raises(PrefixCacheUnsupported, match="no prefix cache"):
                call(0, 1, 3)
        ex.drop_prefix(1)  # nothing is held: nothing to drop, no error
        ex.drop_all_prefixes()
    assert static.prefix_bytes() == {0: 0, 1: 0} and NoCache().prefix_bytes() == {}
    assert head.prefix_bytes() == {0: 0}
    head.close()
    static.open(0)
    with pytest.raises(StageError, match="static \\(NPU\\) export keeps no prefix cache"):
        static.runners[0].load_prefix(0, 1, 3)
