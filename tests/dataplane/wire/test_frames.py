"""The data-plane wire protocol: round trips, every malformed case, timing derivation."""

from __future__ import annotations

import struct
from dataclasses import replace

import numpy as np
import pytest

from dataplane.wire.frames import (
    EMPTY_INDEX,
    FIXED,
    MAX_NDIM,
    MAX_TOKENS,
    TOP1,
    TOPK_DTYPE,
    FrameError,
    HiddenStateFrame,
    Kind,
    ReplyMode,
    decode_frame,
    encode_frame,
    frame_bytes,
    prepare_frame,
    restamp_send,
    seal_frame,
    stamp,
    timing_records,
)
from dataplane.wire.reply_records import top1_record, top1_records, top_k_records
from dataplane.wire.timing import TimingWindow, derive_step_timing, flatten, percentiles
from tests.helpers.worker import step

# Index of each field in FIXED's unpacked tuple.
F_MAGIC, F_VERSION, F_KIND, F_REPLY, F_DTYPE, F_TOPK, F_NDIM, F_NTIMING = range(8)
F_TOKENS, F_NIDX = 13, 14


def step_header(**changes) -> HiddenStateFrame:
    fields = dict(kind=Kind.STEP, stream_id=3, request_id=77, epoch=1 << 60, step=5,
                  positions=np.array([10, 11, 12]), logits_idx=np.array([0, 2]),
                  reply=ReplyMode.TOPK, top_k=4, mask_tail=2, source_stage=1,
                  timings=stamp(b"", 0, 100, 90, 200, 1, 50, 2))
    fields.update(changes)
    return HiddenStateFrame(**fields)


def hidden(tokens: int = 3, size: int = 8) -> np.ndarray:
    return np.arange(tokens * size, dtype=np.float32).reshape(1, tokens, size)


def patched(parts: list, **fields: int) -> list:
    """Rewrite fixed-header fields (by F_* index given as f<index>=value) of encoded parts."""
    head = bytes(parts[0])
    values = list(FIXED.unpack_from(head))
    for key, value in fields.items():
        values[int(key[1:])] = value
    return [FIXED.pack(*values) + head[FIXED.size:], parts[1]]


def test_step_round_trip_keeps_every_field_and_views_the_payload():
    header, x = step_header(), hidden()
    parts = encode_frame(header, x)
    assert len(parts) == 2 and np.shares_memory(parts[1], x)  # the payload is not copied
    got, payload = decode_frame(parts)
    assert (got.kind, got.stream_id, got.request_id, got.epoch, got.step) == (
        Kind.STEP, 3, 77, 1 << 60, 5)
    assert got.positions.tolist() == [10, 11, 12] and got.logits_idx.tolist() == [0, 2]
    assert (got.reply, got.top_k, got.mask_tail, got.source_stage) == (ReplyMode.TOPK, 4, 2, 1)
    assert got.shape == (1, 3, 8) and got.dtype == np.float32 and got.tokens == 3
    assert timing_records(got.timings)["compute_ns"].tolist() == [50]
    assert payload.dtype == np.float32 and np.array_equal(payload, x)


def test_token_ids_and_replies_round_trip():
    ids = np.array([[5, 6, 7]], dtype=np.int64)
    _, payload = decode_frame(encode_frame(step_header(), ids))
    assert payload.dtype == np.int64 and payload.tolist() == [[5, 6, 7]]
    logits = np.random.default_rng(0).standard_normal((2, 50)).astype(np.float32)
    for mode, body in ((ReplyMode.TOP1, top1_records(logits)),
                       (ReplyMode.TOPK, top_k_records(logits, 4)),
                       (ReplyMode.LOGITS, logits), (ReplyMode.LOGITS16, logits.astype(np.float16))):
        got, payload = decode_frame(encode_frame(step_header(kind=Kind.REPLY, reply=mode), body))
        assert got.reply == mode and np.array_equal(payload, body)


def test_control_and_error_frames_carry_no_payload():
    for kind in (Kind.RESET, Kind.CLOSE, Kind.COMPACT):
        got, payload = decode_frame(encode_frame(HiddenStateFrame(kind, 1, 0, 9, step=4)))
        assert (got.kind, got.stream_id, got.epoch, got.step) == (kind, 1, 9, 4)
        assert payload is None
    error = step_header(kind=Kind.ERROR, error="stage 2: bad shape ✗")
    got, payload = decode_frame(encode_frame(error))
    assert got.error == "stage 2: bad shape ✗" and payload is None


def test_parts_may_be_bytes_memoryviews_or_zmq_frames():
    import zmq

    parts = encode_frame(step_header(), hidden())
    header, payload = decode_frame([zmq.Frame(bytes(parts[0])), memoryview(parts[1])])
    assert header.step == 5 and payload.shape == (1, 3, 8)


@pytest.mark.parametrize("count", [0, 1, 3])
def test_wrong_part_count(count):
    parts = encode_frame(step_header(), hidden())
    with pytest.raises(FrameError, match="expected 2 parts"):
        decode_frame((parts * 2)[:count])


@pytest.mark.parametrize("change, message", [
    (dict(f0=b"HTTP"), "bad magic"),
    (dict(f1=9), "protocol version 9"),
    (dict(f2=42), "unknown frame kind 42"),
    (dict(f3=7), "unknown reply mode 7"),
    (dict(f4=99), "unknown payload dtype code 99"),
    (dict(f6=MAX_NDIM + 1), "absurd header"),
    (dict(f13=MAX_TOKENS + 1), "absurd header"),
    (dict(f5=5000), "absurd header"),
    (dict(f14=4), "4 logits indices for a 3-token step"),
    (dict(f13=2), "trailing bytes"),
    (dict(f7=3), "truncated header"),
])
def test_malformed_headers(change, message):
    parts = patched(encode_frame(step_header(), hidden()), **change)
    with pytest.raises(FrameError, match=message):
        decode_frame(parts)


def test_truncated_headers():
    head, body = encode_frame(step_header(), hidden())
    with pytest.raises(FrameError, match="the fixed part alone"):
        decode_frame([head[:10], body])
    with pytest.raises(FrameError, match="truncated header"):
        decode_frame([head[:-3], body])


def test_payload_must_match_dtype_times_shape():
    head, body = encode_frame(step_header(), hidden())
    for bad in (bytes(body)[:-4], bytes(body) + b"\0\0\0\0", b""):
        with pytest.raises(FrameError, match="payload is .* bytes but float32") as info:
            decode_frame([head, bad])
        assert info.value.header is not None and info.value.header.request_id == 77


def test_absurd_shapes():
    x = np.zeros((1, 3, 1), dtype=np.float32)
    head, body = encode_frame(step_header(), x)
    dims_at = FIXED.size
    for dims in ((1, 3, 0), (1, 3, 1 << 31)):
        bad = head[:dims_at] + struct.pack("<3I", *dims) + head[dims_at + 12:]
        with pytest.raises(FrameError, match="absurd payload shape"):
            decode_frame([bad, body])


def test_semantic_checks():
    cases = [
        (step_header(), hidden(tokens=2), "must be \\[1, 3"),
        (step_header(positions=np.array([1, -1, 2])), hidden(), "negative token position"),
        (step_header(logits_idx=np.array([3])), hidden(), "out of range for 3 tokens"),
        (step_header(kind=Kind.RESET), hidden(), "RESET frame carries no payload"),
        (step_header(kind=Kind.COMPACT), hidden(), "COMPACT frame carries no payload"),
        (step_header(kind=Kind.COMPACT, logits_idx=EMPTY_INDEX), None,
         "COMPACT frame carries no positions"),
        (HiddenStateFrame(Kind.COMPACT, 1, 0, 9, mask_tail=2), None, "and no mask_tail"),
        (step_header(kind=Kind.REPLY, reply=ReplyMode.TOP1),
         top_k_records(np.zeros((2, 9), np.float32), 3), "TOP1 reply must be"),
        (step_header(kind=Kind.REPLY, reply=ReplyMode.LOGITS), np.zeros((3, 9), np.float32),
         "LOGITS reply must be float32 \\[2, vocab\\]"),
        # the per-token shapes, checked on their fast path too
        (step_header(logits_idx=EMPTY_INDEX), np.zeros((2, 3, 8), np.float32),
         "must be \\[1, 3, ...\\]"),
        (step_header(kind=Kind.REPLY, reply=ReplyMode.TOP1, logits_idx=EMPTY_INDEX,
                     positions=EMPTY_INDEX, rows=2, mask_tail=0),
         top1_records(np.zeros((1, 9), np.float32)), "TOP1 reply must be .* \\[2, 1\\]"),
    ]
    for header, payload, message in cases:
        with pytest.raises(FrameError, match=message):
            decode_frame(encode_frame(header, payload))
    head, _ = encode_frame(HiddenStateFrame(Kind.RESET, 1, 0, 1))
    with pytest.raises(FrameError, match="without a dtype"):
        decode_frame([head, b"junk"])


def test_encode_refuses_what_it_cannot_describe():
    with pytest.raises(FrameError, match="cannot send a complex64"):
        encode_frame(step_header(), np.zeros((1, 3), np.complex64))
    with pytest.raises(FrameError, match="at most 4"):
        encode_frame(step_header(), np.zeros((1, 3, 1, 1, 1), np.float32))
    with pytest.raises(FrameError, match="out of range"):
        encode_frame(step_header(stream_id=-1), hidden())
    with pytest.raises(FrameError, match="whole"):
        encode_frame(step_header(timings=b"abc"), hidden())


def test_non_contiguous_payloads_are_sent_contiguous():
    x = np.arange(48, dtype=np.float32).reshape(1, 8, 6)[:, ::2, :]
    header = step_header(positions=np.arange(4), logits_idx=np.zeros(0, np.int64))
    _, payload = decode_frame(encode_frame(header, x))
    assert np.array_equal(payload, x)


def test_garbage_only_ever_raises_frame_error():
    """Random bytes and cut headers are always refused; a header with a few bytes changed
    is refused, or is a valid frame that says exactly what its bytes say: it passes the full
    semantic checks and encodes back to the very same bytes (nothing misread or ignored)."""
    from dataplane.wire.frames import check_semantics

    rng = np.random.default_rng(1)
    head, body = encode_frame(step_header(), hidden())
    outcomes = {"refused": 0, "valid": 0}
    for _ in range(3000):
        junk = bytearray(head)
        for _ in range(rng.integers(1, 4)):
            junk[rng.integers(len(junk))] = rng.integers(256)
        for parts in ([rng.bytes(int(rng.integers(0, 300))), body],
                      [bytes(junk)[: rng.integers(len(junk))], rng.bytes(8)]):
            with pytest.raises(FrameError):
                decode_frame(parts)
        parts = [bytes(junk), body]
        try:
            header, payload = decode_frame(parts)
        except FrameError as exc:
            assert str(exc), "a refusal says why"
            outcomes["refused"] += 1
            continue
        outcomes["valid"] += 1
        check_semantics(header)  # the per-token fast path let through nothing it should not
        again = encode_frame(header, payload)
        assert bytes(again[0]) == parts[0], header
        assert bytes(memoryview(again[1])) == bytes(memoryview(body))
    # both happen: most changes break the header, some only change an id, epoch or position
    assert outcomes["refused"] > 1000 and outcomes["valid"] > 500, outcomes


def test_top_k_records_are_sorted_log_probabilities_and_break_ties_like_argmax():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((3, 1000)).astype(np.float32)
    top = top_k_records(logits[None], 5)
    assert top.dtype == TOPK_DTYPE and top.shape == (3, 5)
    expect = np.argsort(-logits, axis=-1, kind="stable")[:, :5]
    assert np.array_equal(top["token"], expect)
    z = logits.astype(np.float64)
    logprobs = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    assert np.allclose(top["logit"], np.take_along_axis(logprobs, expect, axis=-1), atol=1e-5)
    tied = np.zeros((1, 10), np.float32)
    tied[0, [7, 3, 5]] = 1.0
    assert top_k_records(tied, 1)["token"].tolist() == [[3]] == [[int(tied.argmax())]]
    assert top_k_records(tied, 3)["token"].tolist() == [[3, 5, 7]]


def test_step_timing_splits_each_hop():
    # stage 0 sends at 1000; stage 1 was busy until 1500, got it at 1600, sent at 4600;
    # the coordinator was waiting from 4000, got the reply at 4800.
    timings = stamp(b"", 0, 0, 0, 1000, 0, 900_000, 50)
    timings = stamp(timings, 1, 1600, 1500, 4600, 30, 2_000, 40)
    t = derive_step_timing(timings, coord_recv_ns=4800, coord_ready_ns=4000,
                           coord_decode_ns=20, start_ns=0, end_ns=5000)
    assert t.compute_ms == (0.9, 0.002)
    first, back = t.hops
    assert (first.src, first.dst, back.src, back.dst) == (0, 1, 1, 2)
    assert first.queue_ms == pytest.approx(0.0005) and first.network_ms == pytest.approx(0.0001)
    assert first.serialise_ms == pytest.approx(0.00008)
    assert back.queue_ms == 0.0 and back.network_ms == pytest.approx(0.0002)
    assert t.total_ms == pytest.approx(0.005)
    # transit: the two gaps between send and arrival stamps, 600 + 200 ns
    assert t.transit_ms == pytest.approx(800 / 1e6)
    assert t.transit_ms == pytest.approx(sum(h.queue_ms + h.network_ms for h in t.hops))
    assert t.overhead_ms == pytest.approx((5000 - 902_000 - 800) / 1e6)
    flat = flatten(t)
    assert flat["hop0-1.queue"] == first.queue_ms and flat["stage1.compute"] == 0.002


def test_skewed_clocks_clamp_to_zero_and_percentiles():
    timings = stamp(stamp(b"", 0, 0, 0, 1000, 0, 1, 0), 1, 500, 400, 600, 0, 1, 0)
    t = derive_step_timing(timings, 2000, 2000, 0, 0, 3000)
    assert t.hops[0].network_ms == 0.0 and t.hops[0].queue_ms == 0.0
    assert percentiles([{"a": float(i)} for i in range(101)])["a"] == {"p50": 50.0, "p95": 95.0}
    window = TimingWindow(size=3)
    for _ in range(5):
        window.add(t)
    assert len(window) == 3 and window.summary()["total"]["p50"] == pytest.approx(0.003)
    with pytest.raises(ValueError):
        derive_step_timing(b"", 0, 0, 0, 0, 0)


def test_timing_window_summary_is_incremental_and_equals_a_full_recount():
    from dataplane.wire.timing import TimingStamps

    def stamps(i: int, stages: int = 2) -> TimingStamps:
        records = b""
        for s in range(stages):
            records = stamp(records, s, 1000 * s + i, 1000 * s + i, 1000 * s + 500 + 7 * i, 3,
                            400_000 + 1000 * i * (s + 1), 5)
        return TimingStamps(records, 5000 + 11 * i, 4900, 9, 0, 6000 + 13 * i)

    window = TimingWindow(size=8)
    for i in range(5):
        window.add(stamps(i))
    assert window.summary() == percentiles([flatten(t) for t in window.samples()])
    for i in range(5, 19):  # past the window: the oldest rows leave with their samples
        window.add(stamps(i))
        if i % 4 == 0:
            assert window.summary() == percentiles([flatten(t) for t in window.samples()])
    assert window.summary() == percentiles([flatten(t) for t in window.samples()])
    assert window.summary()["stage1.compute"]["p50"] == pytest.approx(
        float(np.median([0.4 + 0.002 * i for i in range(11, 19)])))
    window.add(stamps(30, stages=3))  # another pipeline shape: only comparable rows count
    assert set(window.summary()) >= {"stage2.compute"}
    assert window.summary()["stage0.compute"]["p50"] == pytest.approx(0.43)
    window.clear()
    assert window.summary() == {} and len(window) == 0


def test_restamp_send_fills_the_last_record_in_place():
    for error in ("", "stage 1: broken ✗"):
        header = step_header(kind=Kind.ERROR if error else Kind.STEP, error=error)
        header.timings = stamp(header.timings, 1, 5, 6, 0, 7, 8, 0)
        parts = encode_frame(header, None if error else hidden())
        restamp_send(parts, len(error.encode()), send_ns=123456789, encode_ns=4321)
        got, _ = decode_frame(parts)
        records = timing_records(got.timings)
        assert records["send_ns"].tolist() == [200, 123456789]
        assert records["encode_ns"].tolist() == [2, 4321]
        assert records["compute_ns"].tolist() == [50, 8] and got.error == error
    bare = encode_frame(HiddenStateFrame(Kind.RESET, 1, 0, 1))
    with pytest.raises(FrameError, match="no timing record"):
        restamp_send(bare, 0, 1, 1)


def test_top1_record_packs_the_best_token_and_its_logit():
    logits = np.array([[[0.5, 3.0, -1.0, 3.0]]], dtype=np.float32)
    assert top1_record(logits) == TOP1.pack(1, 3.0)  # ties: the lowest id, as argmax
    assert top1_records(logits).tobytes() == top1_record(logits)
    rows = np.concatenate([logits[0], -logits[0]])
    assert top1_records(rows)["token"][:, 0].tolist() == [1, 2]
    assert top1_records(rows)["logit"][:, 0].tolist() == [3.0, 1.0]


def test_a_prepared_frame_equals_one_encoded_after_the_fact():
    header = step_header()
    x = hidden()
    prepared = prepare_frame(header, x.shape, x.dtype, 1, recv_ns=5, ready_ns=6)
    assert timing_records(header.timings).shape == (1,)  # the header itself is unchanged
    parts = seal_frame(prepared, x, send_ns=123, decode_ns=7, compute_ns=8, encode_ns=9)
    assert parts is not None and parts[1] is x  # the payload is not copied
    expected = step_header()
    expected.timings = stamp(expected.timings, 1, 5, 6, 123, 7, 8, 9)
    assert bytes(parts[0]) == bytes(encode_frame(expected, x)[0])
    got, payload = decode_frame([bytes(parts[0]), x.tobytes()])
    assert timing_records(got.timings)["compute_ns"].tolist() == [50, 8]
    np.testing.assert_array_equal(payload, x)


def test_a_payload_other_than_the_prepared_one_is_refused_for_encoding():
    x = hidden()
    prepared = prepare_frame(step_header(), x.shape, x.dtype, 1, 0, 0)
    for other in (x.astype(np.float16), x[:, :2], np.asfortranarray(np.ones((1, 3, 8, 2)))[..., 0],
                  x.tobytes()[:-4]):
        assert seal_frame(prepared, other, 1, 2, 3, 4) is None
    raw = seal_frame(prepared, x.tobytes(), 1, 2, 3, 4)  # raw bytes of the right size do
    assert raw is not None and raw[1] == x.tobytes()
    with pytest.raises(FrameError, match="error text"):
        prepare_frame(step_header(kind=Kind.ERROR, error="broken"), (), x.dtype, 1, 0, 0)
    with pytest.raises(FrameError, match="cannot send"):
        prepare_frame(step_header(), x.shape, np.dtype(np.uint16), 1, 0, 0)


def test_row_group_frames_round_trip_and_are_checked():
    rows = step_header(rows=2, positions=np.array([10, 11, 40, 41]), logits_idx=EMPTY_INDEX,
                       mask_tail=0)
    x = np.arange(2 * 2 * 8, dtype=np.float32).reshape(2, 2, 8)
    got, payload = decode_frame(encode_frame(rows, x))
    assert got.rows == 2 and got.tokens == 2 and got.answer_rows == 2
    assert not got.row_rewinds.size
    rows.row_rewinds = np.array([0, 3])
    assert decode_frame(encode_frame(rows, x))[0].row_rewinds.tolist() == [0, 3]
    rows.row_rewinds = EMPTY_INDEX
    assert got.positions.tolist() == [10, 11, 40, 41] and payload.shape == (2, 2, 8)
    reply = step_header(kind=Kind.REPLY, rows=3, reply=ReplyMode.TOP1, logits_idx=EMPTY_INDEX,
                        positions=np.zeros(3, np.int64), mask_tail=0)
    got, payload = decode_frame(encode_frame(reply, top_k_records(np.eye(3, 9, dtype=np.float32),
                                                                  1)))
    assert got.answer_rows == 3 and payload["token"][:, 0].tolist() == [0, 1, 2]
    members = np.array([4, 9], dtype=np.int64)
    group = HiddenStateFrame(Kind.GROUP, 1 << 30, 0, 3)
    got, payload = decode_frame(encode_frame(group, members))
    assert got.kind == Kind.GROUP and payload.tolist() == [4, 9]
    got, payload = decode_frame(encode_frame(group))  # no members: disband
    assert payload is None
    cases = [
        (rows, x[:1], "must be \\[2, 2"),
        (step_header(rows=2, positions=np.arange(3), logits_idx=EMPTY_INDEX, mask_tail=0),
         x, "do not split into 2 equal rows"),
        (step_header(rows=2, positions=np.arange(4), logits_idx=EMPTY_INDEX), x,
         "rewinds per row"),
        (step_header(rows=2, positions=np.arange(4), logits_idx=EMPTY_INDEX, mask_tail=0,
                     row_rewinds=np.array([1, -1])), x, "negative row rewind"),
        (step_header(rows=2, positions=np.arange(4), logits_idx=EMPTY_INDEX, mask_tail=0,
                     row_rewinds=np.array([1])), x, "1 row rewinds for 2 rows"),
        (reply, top1_records(np.zeros((2, 9), np.float32)), "TOP1 reply must be"),
        (replace(reply, reply=ReplyMode.LOGITS16), np.zeros((3, 9), np.float32),
         r"LOGITS16 reply must be float16 \[3, vocab\], got float32"),
        (replace(reply, reply=ReplyMode.LOGITS), np.zeros((3, 9), np.float16),
         r"LOGITS reply must be float32 \[3, vocab\], got float16"),
        (group, members.astype(np.float32), "only its member stream ids"),
        (HiddenStateFrame(Kind.GROUP, 1, 0, 3, positions=np.arange(2)), members,
         "only its member"),
    ]
    for header, payload, message in cases:
        with pytest.raises(FrameError, match=message):
            decode_frame(encode_frame(header, payload))
    head, body = encode_frame(rows, x)
    with pytest.raises(FrameError, match="rows"):
        decode_frame(patched([head, body], f17=0))


def test_ragged_row_frames_round_trip_and_are_checked():
    """A ragged row group's step: rows of different token counts laid one after the other."""
    ragged = step_header(rows=2, positions=np.array([30, 12, 13, 14]), logits_idx=EMPTY_INDEX,
                         mask_tail=0, row_tokens=np.array([1, 3]))
    x = hidden(4)
    got, payload = decode_frame(encode_frame(ragged, x))
    assert got.ragged and got.row_tokens.tolist() == [1, 3] and got.rows == 2
    assert got.tokens == 4 and got.answer_rows == 2 and payload.shape == (1, 4, 8)
    ragged.logits_idx = np.array([0, 1, 2, 3])
    ragged.row_rewinds = np.array([0, 2])
    got, _ = decode_frame(encode_frame(ragged, x))
    assert got.answer_rows == 4 and got.row_rewinds.tolist() == [0, 2]
    assert got.logits_idx.tolist() == [0, 1, 2, 3]
    reply = step_header(kind=Kind.REPLY, rows=2, reply=ReplyMode.TOP1, positions=np.arange(4),
                        logits_idx=np.array([0, 1, 3]), mask_tail=0, row_tokens=np.array([1, 3]))
    got, _ = decode_frame(encode_frame(reply, top1_records(np.eye(3, 9, dtype=np.float32))))
    assert got.answer_rows == 3
    base = dict(rows=2, positions=np.arange(4), logits_idx=EMPTY_INDEX, mask_tail=0)
    cases = [
        (step_header(**base, row_tokens=np.array([1, 2])), x, "add up to the step's 4"),
        (step_header(**base, row_tokens=np.array([0, 4])), x, "not positive counts"),
        (step_header(**base, row_tokens=np.array([4])), x, "1 row token counts for 2 rows"),
        (step_header(**base, row_tokens=np.array([1, 3])), hidden(4).reshape(2, 2, 8),
         "ragged step's payload must be \\[1, 4"),
        (step_header(**{**base, "logits_idx": np.array([4])}, row_tokens=np.array([1, 3])), x,
         "out of range for 4 tokens"),
        (HiddenStateFrame(Kind.RESET, 1, 0, 3, positions=np.arange(2), rows=2,
                          row_tokens=np.array([1, 1])), None, "has no ragged rows"),
    ]
    for header, body, message in cases:
        with pytest.raises(FrameError, match=message):
            decode_frame(encode_frame(header, body))


def test_fed_tokens_go_only_on_one_row_steps() -> None:
    header, payload = decode_frame(step(0, np.zeros((1, 2, 4), np.float32), [0, 1]))
    header.fed, header.guessed = np.array([5, 6], np.int64), True
    got, _ = decode_frame(encode_frame(header, np.array(payload)))
    assert got.fed.tolist() == [5, 6] and got.guessed
    header.fed = np.array([5], np.int64)  # one per position, or none
    with pytest.raises(FrameError, match="fed tokens"):
        decode_frame(encode_frame(header, np.array(payload)))
    reset = HiddenStateFrame(Kind.RESET, 0, 0, 1, guessed=True)
    with pytest.raises(FrameError, match="fed tokens"):
        decode_frame(encode_frame(reset))


def test_the_one_query_flag_survives_a_round_trip_on_steps() -> None:
    header = step_header(one_query=True)
    got, _ = decode_frame(encode_frame(header, hidden()))
    assert got.one_query and not got.guessed
    assert not decode_frame(encode_frame(step_header(), hidden()))[0].one_query
    rows = step_header(positions=np.arange(6), rows=2, row_tokens=np.array([2, 4]),
                       mask_tail=0, logits_idx=np.array([1, 5]), one_query=True)
    got, _ = decode_frame(encode_frame(rows, hidden(6)))  # a ragged row group's step
    assert got.one_query and got.row_tokens.tolist() == [2, 4]
    error = step_header(kind=Kind.ERROR, error="stage 1: no", one_query=True)
    assert decode_frame(encode_frame(error))[0].one_query  # a refused step's header


@pytest.mark.parametrize("flags, message", [
    (8, "unknown flags 0x8"), (0x83, "unknown flags 0x80"),
])
def test_an_unknown_flag_is_refused_by_name(flags, message) -> None:
    parts = patched(encode_frame(step_header(one_query=True), hidden()), f21=flags)
    with pytest.raises(FrameError, match=message):
        decode_frame(parts)


def test_a_reset_says_whether_its_sequence_turns_long_throughout() -> None:
    """LONG_ROPE rides on a RESET (the stream's new sequence turns with LongRoPE's long set
    throughout) and survives the round trip; no other frame begins a sequence."""
    got, _ = decode_frame(encode_frame(HiddenStateFrame(Kind.RESET, 4, 0, 9, long_rope=True)))
    assert got.kind == Kind.RESET and got.long_rope and got.epoch == 9
    assert not decode_frame(encode_frame(HiddenStateFrame(Kind.RESET, 4, 0, 9)))[0].long_rope
    for header, body in [(step_header(long_rope=True), hidden()),
                         (HiddenStateFrame(Kind.CLOSE, 4, 0, 9, long_rope=True), None)]:
        with pytest.raises(FrameError, match="begins no sequence: only a RESET"):
            decode_frame(encode_frame(header, body))


@pytest.mark.parametrize("kind", [Kind.REPLY, Kind.RESET, Kind.COMPACT])
def test_only_a_step_is_one_query(kind) -> None:
    header = HiddenStateFrame(kind, 1, 0, 3, one_query=True)
    body = np.zeros((1, 1), TOPK_DTYPE) if kind == Kind.REPLY else None
    with pytest.raises(FrameError, match=f"a {kind.name} frame .* cannot be a one-query step"):
        decode_frame(encode_frame(header, body))


def test_frame_bytes_count_every_parts_buffer():
    assert frame_bytes([b"abc", np.zeros((2, 4), np.float32), b""]) == 3 + 32
