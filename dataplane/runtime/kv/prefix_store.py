"""Prefix entries: the KV of a token prefix a stage keeps for streams that start with it.

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
``length`` kept slots. ``PrefixCache`` is StageRunner's part (a mixin).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import openvino as ov

from dataplane.runtime.base import StageError
from dataplane.runtime.kv.rows import SLOT_AXIS
from dataplane.runtime.kv.slots import RowGroup, StreamSlots, request_states


@dataclass
class PrefixEntry:
    """One prefix of ``length`` tokens: copied ``states``, or a taken stream's ``slots``."""

    length: int
    nbytes: int
    states: dict[str, np.ndarray] | None = None
    slots: StreamSlots | None = None


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


def kv_bytes_per_token(compiled: ov.CompiledModel, layers: int, kv_heads: int,
                       head_dim: int) -> int:
    """Bytes one token's KV takes in a compiled stage of ``layers`` layers (a key and a value
    each): the KEY/VALUE_CACHE_PRECISION (else KV_CACHE_PRECISION) it was
    compiled with, else the state's element type. Quantized caches also keep a scale and
    zero point per token and head (not counted)."""

    def bits(name: str) -> int | None:
        try:
            return int(compiled.get_property(name).bitwidth)
        except (RuntimeError, TypeError, AttributeError):
            return None

    kv = bits("KV_CACHE_PRECISION")
    key, value = bits("KEY_CACHE_PRECISION") or kv, bits("VALUE_CACHE_PRECISION") or kv
    if key is None or value is None:
        states = compiled.create_infer_request().query_state()
        key = value = states[0].state.element_type.bitwidth if states else 0
    return layers * kv_heads * head_dim * (key + value) // 8


class PrefixStore:
    """A stage's prefix entries by id."""

    def __init__(self) -> None:
        self.entries: dict[int, PrefixEntry] = {}

    def get(self, entry_id: int, length: int, stage: int) -> PrefixEntry:
        """The entry, if it holds at least ``length`` tokens (else StageError)."""
        entry = self.entries.get(entry_id)
        if entry is None:
            raise StageError(f"prefix entry {entry_id} does not exist on stage {stage}")
        if not 1 <= length <= entry.length:
            raise StageError(f"prefix entry {entry_id} holds {entry.length} tokens on stage "
                             f"{stage}: cannot load {length}")
        return entry

    def nbytes(self) -> int:
        """Bytes the entries hold (safe to call from another thread)."""
        for _ in range(8):
            try:
                return sum(e.nbytes for e in list(self.entries.values()))
            except RuntimeError:  # changed size while being copied
                continue
        return -1


class PrefixCache:
    """StageRunner's prefix entries (a mixin: the runner provides ``streams``, ``groups``,
    ``spec``, ``prefixes`` (a PrefixStore) and ``kv_bytes_per_token``)."""

    prefix_cache_supported: ClassVar[bool] = True
    streams: dict[int, StreamSlots]
    groups: dict[int, RowGroup]
    prefixes: PrefixStore
    kv_bytes_per_token: int
    spec: Any

    def row_of(self, stream_id: int) -> tuple[int, int] | None:
        """(group id, row) of the row group ``stream_id`` is a row of here, if any."""
        for group_id, group in self.groups.items():
            if stream_id in group.members:
                return group_id, group.members.index(stream_id)
        return None

    def save_prefix(self, stream_id: int, entry_id: int, length: int, take: bool = False) -> None:
        """Keep the first ``length`` logical KV slots of stream ``stream_id`` (alone, or a row
        of a row group) as entry ``entry_id``, replacing any entry of that id. ``take`` (a
        stream alone): the stream's request becomes the entry, no copy, and the stream is
        closed here. On error the stream is unchanged and no entry ``entry_id`` is left."""
        self.prefixes.entries.pop(entry_id, None)
        stage = self.spec.index
        slots = self.streams.get(stream_id)
        found = None if slots is not None else self.row_of(stream_id)
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
            entry = PrefixEntry(length, slots.physical * self.kv_bytes_per_token, slots=slots)
        else:
            request = slots.request if slots is not None else self.groups[found[0]].request
            row = 0 if found is None else found[1]
            states = first_kept(request_states(request), row, keep, length)
            entry = PrefixEntry(length, sum(a.nbytes for a in states.values()), states=states)
        self.prefixes.entries[entry_id] = entry

    def load_prefix(self, stream_id: int, entry_id: int, length: int, take: bool = False) -> None:
        """Make the first ``length`` tokens of entry ``entry_id`` the KV of stream
        ``stream_id`` (open, stepped alone): its next step continues at logical position
        ``length``. ``take`` removes the entry (a taken stream's request moves to the stream,
        its slots after ``length`` masked); else it stays for other streams. On error
        nothing changes."""
        stage = self.spec.index
        slots = self.streams.get(stream_id)
        if slots is None:
            found = self.row_of(stream_id)
            where = (f"is a row of row group {found[0]}" if found is not None else "is not open")
            raise StageError(f"stream {stream_id} {where} on stage {stage}: a prefix loads only "
                             "into an open stream stepped alone")
        entry = self.prefixes.get(entry_id, length, stage)
        if take and entry.slots is not None:
            moved = entry.slots
            moved.keep, moved.last, moved.prefetched = prefix_table(moved.keep, length), None, None
            self.streams[stream_id] = moved
            del self.prefixes.entries[entry_id]
            return
        if entry.states is not None:
            states = entry.states
        else:
            assert entry.slots is not None
            states = first_kept(request_states(entry.slots.request), 0, entry.slots.keep, length,
                                copy=False)
        self._set_states(slots, states, length)
        if take:
            del self.prefixes.entries[entry_id]

    def _set_states(self, slots: StreamSlots, states: dict[str, np.ndarray], length: int) -> None:
        """Set the first ``length`` slots of ``states`` as the stream's whole KV."""
        variables = slots.request.query_state()
        if {v.name for v in variables} != set(states):
            raise StageError(f"a prefix entry's states do not match stage {self.spec.index}'s")
        tensors = []
        for variable in variables:
            data = states[variable.name]
            if data.shape[SLOT_AXIS] != length:
                data = data[:, :, :length]
            # shared: no copy here, the plugin copies it in
            tensors.append(ov.Tensor(np.ascontiguousarray(data), shared_memory=True))
        try:
            for variable, tensor in zip(variables, tensors, strict=True):
                variable.state = tensor
        except RuntimeError as exc:  # half set: leave the stream empty rather than mixed
            slots.request.reset_state()
            slots.keep = np.zeros(0, dtype=bool)
            raise StageError(f"stage {self.spec.index} could not set a prefix's KV: {exc}") from None
        slots.keep, slots.last, slots.prefetched = np.ones(length, dtype=bool), None, None

    def drop_prefix(self, entry_id: int) -> None:
        """Free entry ``entry_id`` (an unknown id is no error)."""
        self.prefixes.entries.pop(entry_id, None)

    def drop_all_prefixes(self) -> None:
        self.prefixes.entries.clear()

    def prefix_bytes(self) -> int:
        """Bytes of the prefix entries held here (any thread)."""
        return self.prefixes.nbytes()
