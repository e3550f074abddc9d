"""Prefix entries of a stateful stage: the KV of a token prefix it keeps for streams that
start with it.

The engine keeps an index of prefixes and tells every stage, in order with the steps, to
save, load and drop entries by id (PREFIX frames; dataplane.wire.prefix_ops). An entry holds the first
``length`` logical KV slots of a stream, in one of two forms:

- copied (``states``): dense copies of the stream's kept slots, [1, kv_heads, length,
  head_dim] by state name, in the state's element type. Loading one is a single
  ``state.state = tensor`` per state (the plugin copies it in); a stream or a row group's
  row can be the source.
- taken (``slots``): a finishing stream's own request and slot table, no copy; kept slots
  after the prefix are masked. Loading it with ``take`` hands the request to the new stream.

Kept slots in physical order are in logical order (rewinds mask the last ones, steps
append, merges keep the order), so the first ``length`` logical tokens are the first
``length`` kept slots. On a stage whose sliding layers' states are trimmed
(dataplane.runtime.kv.sliding_states), an entry's sliding states may lack the keys of its
first tokens: loading it is refused unless the query after the tokens loaded sees none of
them (a chat's next turn, loading a whole entry, finds its window there).
``PrefixEntries`` holds a ``StageRunner``'s entries and saves and loads them; a paged
stage keeps its prefixes as shared blocks instead (dataplane.runtime.kv.blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov

from dataplane.runtime.base import StageError
from dataplane.runtime.kv.rows import SLOT_AXIS, find_row
from dataplane.runtime.kv.sliding_states import SlidingStates, prefix_states
from dataplane.runtime.kv.slots import RowGroup, StreamSlots, request_states


@dataclass
class PrefixEntry:
    """One prefix of ``length`` tokens: copied ``states``, or a taken stream's ``slots``."""

    length: int
    nbytes: int
    states: dict[str, np.ndarray] | None = None
    slots: StreamSlots | None = None
    sliding_gone: int = 0  # its first tokens whose keys its sliding states lack


def first_kept(states: dict[str, np.ndarray], row: int, keep: np.ndarray, length: int,
               copy: bool = True) -> dict[str, np.ndarray]:
    """The first ``length`` kept slots [1, heads, length, dim] of row ``row`` of ``states``
    ([rows, heads, slots, dim] by name), whose slot table is ``keep``: copies, or with
    ``copy=False`` views where a slice will do (to be used at once)."""
    if keep[:length].all():  # no masked slot among them: one slice
        views = {name: data[row:row + 1, :, :length] for name, data in states.items()}
        return {name: view.copy() for name, view in views.items()} if copy else views
    slots = np.flatnonzero(keep)[:length]
    return {name: np.ascontiguousarray(data[row:row + 1][:, :, slots])
            for name, data in states.items()}


def prefix_table(keep: np.ndarray, length: int) -> np.ndarray:
    """``keep`` with every kept slot after the first ``length`` masked (a new table)."""
    table = np.zeros_like(keep)
    table[np.flatnonzero(keep)[:length]] = True
    return table


class PrefixEntries:
    """A stateful stage's prefix entries by id: saved from its streams (or a row group's
    rows), loaded into its streams, dropped. Owned by the ``StageRunner``, which gives it its
    stream and row-group tables (a taken entry leaves the one and goes back to it) and what
    one token's KV costs there."""

    def __init__(self, streams: dict[int, StreamSlots], groups: dict[int, RowGroup], stage: int,
                 kv_bytes_per_token: int, sliding: SlidingStates | None = None) -> None:
        self.entries: dict[int, PrefixEntry] = {}
        self.streams, self.groups = streams, groups
        self.stage, self.kv_bytes_per_token = stage, kv_bytes_per_token
        self.sliding = sliding  # the stage's trimmed sliding states (None: none)

    def get(self, entry_id: int, length: int) -> PrefixEntry:
        """The entry, if it holds at least ``length`` tokens (else StageError)."""
        entry = self.entries.get(entry_id)
        if entry is None:
            raise StageError(f"prefix entry {entry_id} does not exist on stage {self.stage}")
        if not 1 <= length <= entry.length:
            raise StageError(f"prefix entry {entry_id} holds {entry.length} tokens on stage "
                             f"{self.stage}: cannot load {length}")
        return entry

    def nbytes(self) -> int:
        """Bytes the entries hold (safe to call from another thread)."""
        for _ in range(8):
            try:
                return sum(e.nbytes for e in list(self.entries.values()))
            except RuntimeError:  # changed size while being copied
                continue
        return -1

    def save(self, stream_id: int, entry_id: int, length: int, take: bool = False) -> None:
        """Keep the first ``length`` logical KV slots of stream ``stream_id`` (alone, or a row
        of a row group) as entry ``entry_id``, replacing any entry of that id. ``take`` (a
        stream alone): the stream's request becomes the entry, no copy, and the stream is
        closed here. On error the stream is unchanged and no entry ``entry_id`` is left."""
        self.entries.pop(entry_id, None)
        stage = self.stage
        slots = self.streams.get(stream_id)
        found = None if slots is not None else find_row(self.groups, stream_id)
        if slots is None and found is None:
            raise StageError(f"stream {stream_id} is not open on stage {stage}: no prefix to save")
        if found is not None and take:
            raise StageError(f"stream {stream_id} is a row of row group {found[0]} on stage "
                             f"{stage}: only a stream stepped alone can be taken as a prefix")
        keep = slots.keep if slots is not None else self.groups[found[0]].keep[found[1]]
        held = int(keep.sum())
        if not 1 <= length <= held:
            raise StageError(f"stream {stream_id} holds {held} tokens on stage {stage}: cannot "
                             f"save a prefix of {length}")
        if take:
            assert slots is not None
            del self.streams[stream_id]
            slots.keep, slots.last, slots.prefetched = prefix_table(keep, length), None, None
            # its request's slots, less those its trimmed sliding states no longer hold
            entry = PrefixEntry(length, slots.held * self.kv_bytes_per_token, slots=slots,
                                sliding_gone=min(slots.sliding_gone, length))
        else:
            group = self.groups[found[0]] if found is not None else None
            request = slots.request if slots is not None else group.request
            row = 0 if found is None else found[1]
            gone = 0
            if self.sliding is None:
                states = first_kept(request_states(request), row, keep, length)
            else:
                start, gone = self._sliding_of(slots, group, row)
                states, gone = prefix_states(request_states(request), row, keep, length,
                                             self.sliding, start, gone)
            entry = PrefixEntry(length, sum(a.nbytes for a in states.values()), states=states,
                                sliding_gone=gone)
        self.entries[entry_id] = entry

    @staticmethod
    def _sliding_of(slots: StreamSlots | None, group: RowGroup | None, row: int
                    ) -> tuple[int, int]:
        """(sliding start, tokens whose keys are gone) of a stream, or of a group's row."""
        if slots is not None:
            return slots.sliding_start, slots.sliding_gone
        assert group is not None
        gone = group.sliding_gone[row] if group.sliding_gone is not None else 0
        return group.sliding_start, int(gone)

    def load(self, stream_id: int, entry_id: int, length: int, take: bool = False) -> None:
        """Make the first ``length`` tokens of entry ``entry_id`` the KV of stream
        ``stream_id`` (open, stepped alone): its next step continues at logical position
        ``length``. ``take`` removes the entry (a taken stream's request moves to the stream,
        its slots after ``length`` masked); else it stays for other streams. On error
        nothing changes."""
        stage = self.stage
        slots = self.streams.get(stream_id)
        if slots is None:
            found = find_row(self.groups, stream_id)
            where = (f"is a row of row group {found[0]}" if found is not None else "is not open")
            raise StageError(f"stream {stream_id} {where} on stage {stage}: a prefix loads only "
                             "into an open stream stepped alone")
        entry = self.get(entry_id, length)
        if self.sliding is not None and self.sliding.refuses(length, entry.sliding_gone):
            raise StageError(
                f"prefix entry {entry_id} cannot start a stream at {length} tokens on stage "
                f"{stage}: its sliding layers kept the keys from position {entry.sliding_gone} "
                f"on, and a query there sees the last {self.sliding.window}")
        if take and entry.slots is not None:
            moved = entry.slots
            moved.keep, moved.last, moved.prefetched = prefix_table(moved.keep, length), None, None
            moved.sliding_gone = min(moved.sliding_gone, length)
            self.streams[stream_id] = moved
            del self.entries[entry_id]
            return
        gone = entry.sliding_gone
        if entry.states is not None:
            states = entry.states
        elif self.sliding is None:
            assert entry.slots is not None
            states = first_kept(request_states(entry.slots.request), 0, entry.slots.keep, length,
                                copy=False)
        else:
            assert entry.slots is not None
            states, gone = prefix_states(request_states(entry.slots.request), 0,
                                         entry.slots.keep, length, self.sliding,
                                         entry.slots.sliding_start, entry.slots.sliding_gone)
        self._set_states(slots, states, length, gone)
        if take:
            del self.entries[entry_id]

    def _set_states(self, slots: StreamSlots, states: dict[str, np.ndarray], length: int,
                    gone: int = 0) -> None:
        """Set the first ``length`` slots of ``states`` as the stream's whole KV (sliding
        states: from the first token they hold, ``gone``)."""
        variables = slots.request.query_state()
        if {v.name for v in variables} != set(states):
            raise StageError(f"a prefix entry's states do not match stage {self.stage}'s")
        tensors = []
        for variable in variables:
            data = states[variable.name]
            held = length
            if self.sliding is not None and self.sliding.is_sliding(variable.name):
                held = length - gone
            if data.shape[SLOT_AXIS] != held:
                data = data[:, :, :held]
            # shared: no copy here, the plugin copies it in
            tensors.append(ov.Tensor(np.ascontiguousarray(data), shared_memory=True))
        try:
            for variable, tensor in zip(variables, tensors, strict=True):
                variable.state = tensor
        except RuntimeError as exc:  # half set: leave the stream empty rather than mixed
            slots.request.reset_state()
            slots.keep = np.zeros(0, dtype=bool)
            slots.sliding_start = slots.sliding_gone = 0
            raise StageError(f"stage {self.stage} could not set a prefix's KV: {exc}") from None
        slots.keep, slots.last, slots.prefetched = np.ones(length, dtype=bool), None, None
        slots.sliding_start = slots.sliding_gone = gone

    def drop(self, entry_id: int) -> None:
        """Free entry ``entry_id`` (an unknown id is no error)."""
        self.entries.pop(entry_id, None)

    def drop_all(self) -> None:
        self.entries.clear()
