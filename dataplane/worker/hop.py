"""One stage's hop, written once for the cluster head (stage 0) and the stage workers.

A hop packs its outgoing header before the stage computes (``prepare_frame``, while the
caches are warm from decoding), applies the rewind the step carries, computes the stream's
or row group's step, then seals the packed frame with the output and the timings, or
encodes it afresh when the output is not the one predicted. Sending and what a failure
means stay with the caller (the head raises, a worker answers with an ERROR frame).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dataplane.runtime.base import (
    StageError,
    StageRuntime,
    one_query_needs_paged_attention,
    ragged_needs_paged_attention,
)
from dataplane.wire.frames import (
    TOPK_DTYPE,
    HiddenStateFrame,
    PreparedFrame,
    encode_frame,
    restamp_send,
    seal_frame,
    stamp,
)


def compute_step(runner: StageRuntime, stream_id: int, x: np.ndarray, positions: np.ndarray,
                 mask_tail: int, row_rewinds: np.ndarray, answer_for: np.ndarray | None = None,
                 after_rewind: Callable[[], None] | None = None,
                 row_tokens: np.ndarray | None = None, one_query: bool = False) -> np.ndarray:
    """Apply a step's rewind on this stage (a stream's ``mask_tail``, or a row group's
    ``row_rewinds``, one per row), run ``after_rewind`` if it masked anything, then compute
    the step (``positions`` flat; a row group's rows are ``x``'s first axis, or with
    ``row_tokens`` its rows' tokens follow each other on its second: ragged rows;
    ``one_query``: each token a query of its own). A step the stage cannot compute (ragged
    rows, a one-query step on a stage without paged attention) is refused before its
    rewind."""
    ragged = row_tokens is not None and row_tokens.size > 0
    if ragged and not runner.paged_attention:
        raise ragged_needs_paged_attention()
    if one_query and not runner.one_query_supported:
        raise one_query_needs_paged_attention()
    group = runner.groups.get(stream_id)
    if group is not None and mask_tail:
        raise StageError(f"row group {stream_id} rewinds per row (row_rewinds), not by mask_tail")
    rewind = mask_tail if group is None else row_rewinds
    if runner.mask_step_tail(stream_id, rewind) and after_rewind is not None:
        after_rewind()
        group = runner.groups.get(stream_id)  # re-formed by a compaction
    if ragged:
        if group is None:
            raise StageError(f"{stream_id} is not a row group: only a row group steps ragged rows")
        return runner.step_ragged(stream_id, x, positions, row_tokens, answer_for, one_query)
    if group is not None:
        return runner.step_rows(stream_id, x, positions.reshape(x.shape[0], -1), answer_for,
                                one_query)
    return runner.step(stream_id, x, positions, answer_for, one_query)


def seal_or_encode(prepared: PreparedFrame | None, header: HiddenStateFrame,
                   body: np.ndarray | bytes, stage: int, recv_ns: int, ready_ns: int,
                   decode_ns: int, compute_ns: int, host_ns: int, done_ns: int) -> list[Any]:
    """The outgoing frame's parts: ``prepared`` sealed with ``body``, its send stamp and its
    durations (``host_ns`` so far plus the time since ``done_ns``, the perf-counter ns the
    compute ended), or, when ``body`` is not what was predicted, ``header`` stamped with
    this stage's record and encoded now. Raises FrameError if it cannot be encoded."""
    parts = None if prepared is None else seal_frame(
        prepared, body, time.time_ns(), decode_ns, compute_ns,
        host_ns + time.perf_counter_ns() - done_ns)
    if parts is not None:
        return parts
    if type(body) is bytes:  # a top-1 record: one (token, logit) row
        body = np.frombuffer(body, TOPK_DTYPE).reshape(1, 1)
    header.timings = stamp(header.timings, stage, recv_ns, ready_ns, 0, decode_ns, compute_ns, 0)
    parts = encode_frame(header, body)
    restamp_send(parts, 0, time.time_ns(), time.perf_counter_ns() - done_ns)
    return parts
