"""PREFIX frames' payload (pure): what a stage is told to do with its prefix entries, in
order with the steps. The engine keeps an index of prefixes and tells every stage to save,
load and drop entries by id; the payload is int64 [op, entry id, length, take (0/1),
stream id] (dataplane.wire.frames.Kind.PREFIX; the stages' runtimes hold the entries
themselves).
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import numpy as np

from dataplane.wire.frames import POSITION_ITEM, PREFIX_FIELDS, FrameError, HiddenStateFrame


class PrefixOp(IntEnum):
    SAVE = 1
    LOAD = 2
    DROP = 3
    DROP_ALL = 4


class PrefixCommand(NamedTuple):
    """A PREFIX frame's payload, decoded."""

    op: PrefixOp
    entry_id: int
    length: int
    take: bool
    stream_id: int  # -1 for the drops


PREFIX_OPS = {int(op): op for op in PrefixOp}


def prefix_payload(op: PrefixOp, entry_id: int = 0, length: int = 0, take: bool = False,
                   stream_id: int = -1) -> np.ndarray:
    """The int64 payload of a PREFIX frame."""
    return np.array([int(op), entry_id, length, int(take), stream_id], dtype=POSITION_ITEM)


def prefix_command(header: HiddenStateFrame, payload: np.ndarray | None) -> PrefixCommand:
    """A PREFIX frame's op; FrameError unless the payload is one (a LOAD, and a SAVE that
    takes the stream, must name in the header the stream of the payload)."""
    if payload is None or payload.shape != (PREFIX_FIELDS,) or payload.dtype != POSITION_ITEM:
        raise FrameError(f"a PREFIX frame carries int64 [{PREFIX_FIELDS}]", header)
    op, entry_id, length, take, stream_id = (int(v) for v in payload)
    if op not in PREFIX_OPS or take not in (0, 1) or length < 0:
        raise FrameError(f"bad PREFIX payload {payload.tolist()} (op, entry, length, take, "
                         "stream)", header)
    command = PrefixCommand(PREFIX_OPS[op], entry_id, length, bool(take), stream_id)
    if (command.op == PrefixOp.LOAD or command.op == PrefixOp.SAVE and command.take) \
            and stream_id != header.stream_id:
        raise FrameError(f"a PREFIX {command.op.name} names stream {header.stream_id} in its "
                         f"header and {stream_id} in its payload", header)
    return command
