"""Rewinds every stage runtime takes the same way, over its own ``mask_tail``,
``mask_rows_tail`` and ``kept_tokens``: a step's rewind (a stream's one count, a row group's
one per row), a cancel's truncation to a length, and the mask-based rewind of a slot table
(the stateful and static runners' streams: ``keep[i]`` False for a masked slot).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from dataplane.runtime.base import StageError
from dataplane.runtime.kv.masks import drop_kept_tail


class RewindPrimitives(Protocol):
    """What a runtime rewinds a stream or a row group with."""

    @property
    def groups(self) -> Mapping[int, object]:
        """The row groups, by id."""

    def mask_tail(self, stream_id: int, count: int) -> None: ...
    def mask_rows_tail(self, group_id: int, counts: np.ndarray) -> None: ...
    def kept_tokens(self, stream_id: int) -> int: ...


class SlotTable(Protocol):
    """A stream's slot table: ``keep[i]`` is False for a masked slot."""

    keep: np.ndarray


def apply_step_rewind(runtime: RewindPrimitives, stream_id: int, mask_tail: int | np.ndarray) -> bool:
    """The rewind a step carries, on this stage: a row group's rows by their own counts, a
    stream by one count. True when it masked anything."""
    if stream_id in runtime.groups:
        counts = np.asarray(mask_tail, dtype=np.int64).reshape(-1)
        if not counts.any():
            return False
        runtime.mask_rows_tail(stream_id, counts)
        return True
    if not mask_tail:
        return False
    runtime.mask_tail(stream_id, int(mask_tail))
    return True


def truncate_stream(runtime: RewindPrimitives, stream_id: int, length: int) -> bool:
    """Rewind the stream to its first ``length`` logical tokens (a cancel: whatever this stage
    computed past them goes; a stage that skipped those steps holds ``length`` already). True
    when it masked anything; StageError if it holds fewer."""
    count = runtime.kept_tokens(stream_id) - int(length)
    if count < 0:
        raise StageError(f"cannot rewind stream {stream_id} to {length} tokens: it holds "
                         f"{runtime.kept_tokens(stream_id)}")
    if not count:
        return False
    runtime.mask_tail(stream_id, count)
    return True


def mask_kept_tail(table: SlotTable, count: int) -> None:
    """Mask-based rewind of a slot table: drop its last ``count`` *kept* slots from
    attention (StageError if it keeps fewer)."""
    try:
        table.keep = drop_kept_tail(table.keep, count)
    except ValueError as exc:
        raise StageError(str(exc)) from None
