"""Rewinds every stage runtime takes the same way, written once over what each runtime
keeps its own way (``groups``, ``mask_tail``, ``mask_rows_tail``, ``kept_tokens``,
``masked_slots``): a step's rewind (a stream's one count, a row group's one per row), a
cancel's truncation to a length, and whether a compaction is due. The stateful and static
runners' streams rewind by mask over a slot table (``keep[i]`` False for a masked slot):
``kept_tokens`` and ``mask_tail`` are theirs too.

A runtime takes them as its methods (``truncate = rewind.truncate`` in its class body).
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
    def masked_slots(self, stream_id: int) -> int: ...


class SlotTable(Protocol):
    """A stream's slot table: ``keep[i]`` is False for a masked slot."""

    keep: np.ndarray

    @property
    def logical(self) -> int:
        """The kept slots: the stream's logical length."""


class SlotTables(Protocol):
    """A runtime whose streams keep slot tables."""

    def stream(self, stream_id: int) -> SlotTable: ...


def mask_step_tail(runtime: RewindPrimitives, stream_id: int, mask_tail: int | np.ndarray
                   ) -> bool:
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


def truncate(runtime: RewindPrimitives, stream_id: int, length: int) -> bool:
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


def compaction_due(runtime: RewindPrimitives, stream_id: int, threshold: int | None) -> bool:
    """Whether the stream (or row group) has more than ``threshold`` masked slots (None:
    never compact)."""
    return threshold is not None and runtime.masked_slots(stream_id) > threshold


def kept_tokens(runtime: SlotTables, stream_id: int) -> int:
    """The stream's logical length: the slots still part of its sequence."""
    return runtime.stream(stream_id).logical


def mask_tail(runtime: SlotTables, stream_id: int, count: int) -> None:
    """Mask-based rewind: drop the stream's last ``count`` *kept* slots from attention
    (StageError if it keeps fewer)."""
    table = runtime.stream(stream_id)
    try:
        table.keep = drop_kept_tail(table.keep, count)
    except ValueError as exc:
        raise StageError(str(exc)) from None
