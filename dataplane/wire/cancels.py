"""CANCEL frames' payload (pure): cancelling a stream's newest steps.

Pipelined speculation sends steps computed on a guessed continuation; once the coordinator
knows a guess was wrong, the steps built on it are cancelled with a ``Kind.CANCEL`` frame
that travels the pipe in order with the steps. Its payload names the steps (first..last,
the stream's step numbers) and the logical length the stream keeps: every stage rewinds
the stream to that length when the frame's turn comes, whether it computed some of the
steps or skipped them. A stage that looks ahead in its pipe before computing sees a cancel
that waits behind the very steps it cancels and skips those steps instead of computing
them (early cancellation: dataplane.worker.lookahead); the later stages then never receive
them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from dataplane.wire.frames import CANCEL_FIELDS, FIXED, MAGIC, Kind

KIND_OFFSET = len(MAGIC) + 1  # the kind byte of a packed header: after the magic and version
HEADER_MIN = FIXED.size


class CancelRange(NamedTuple):
    """Steps ``first``..``last`` of a stream are cancelled (``last`` = ``first`` - 1: none
    is, only the rewind); the stream keeps its first ``keep`` logical tokens."""

    first: int
    last: int
    keep: int

    def covers(self, step: int) -> bool:
        return self.first <= step <= self.last


def cancel_payload(first: int, last: int, keep: int) -> np.ndarray:
    """A CANCEL frame's payload; ValueError for a range that names no steps consistently."""
    rng = CancelRange(int(first), int(last), int(keep))
    check_range(rng)
    return np.array(rng, dtype=np.int64)


def read_cancel(payload: np.ndarray | None) -> CancelRange:
    """A received CANCEL payload's range (the frame's shape is checked when decoded);
    ValueError if its values are inconsistent."""
    if payload is None or payload.shape != (CANCEL_FIELDS,):
        raise ValueError(f"a CANCEL payload is int64 [{CANCEL_FIELDS}]")
    rng = CancelRange(*(int(v) for v in payload))
    check_range(rng)
    return rng


def check_range(rng: CancelRange) -> None:
    if rng.first < 0 or rng.last < rng.first - 1 or rng.keep < 0:
        raise ValueError(f"a cancel of steps {rng.first}..{rng.last} keeping {rng.keep} tokens "
                         "is inconsistent (first >= 0, last >= first - 1, keep >= 0)")


def is_cancel(parts: list[Any]) -> bool:
    """Whether a received message looks like a CANCEL frame (its kind byte; the frame is
    validated in full when its turn comes)."""
    head = parts[0] if parts else b""
    return (type(head) is bytes and len(head) >= HEADER_MIN and head[:len(MAGIC)] == MAGIC
            and head[KIND_OFFSET] == Kind.CANCEL)
