"""The cluster head's prefix entries: stage 0 applies each op here at once, then a PREFIX
frame carries it down the chain, in order with the steps (one pipe; see
dataplane.runtime.kv.prefix_entries for what an entry is, dataplane.wire.frames.Kind.PREFIX for the frame).

Drops that cannot be sent (the chain is broken) are kept and sent before the next save
or load, which are refused until they are: a stage never sees a SAVE or LOAD of an entry
ahead of an older drop of it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from dataplane.head.figures import StepFigures, frame_bytes
from dataplane.head.types import DataPlaneError
from dataplane.runtime.base import StageError, StageRuntime
from dataplane.wire.frames import HiddenStateFrame, Kind, encode_frame
from dataplane.wire.prefix_ops import PrefixOp, prefix_payload
from dataplane.wire.transport import BufferGuard, TransportError
from zctl.engine.executor import PrefixCacheUnsupported

log = logging.getLogger("zctl.dataplane.cluster")


class HeadPrefixes:
    """ClusterHead's part of the Executor's prefix cache (a mixin)."""

    stage0: StageRuntime
    next_addr: str
    figures: StepFigures
    _streams: dict[int, Any]
    _guard: BufferGuard
    _unsent_drops: frozenset[int] = frozenset()  # entries dropped here, not yet down the chain
    _unsent_drop_all: bool = False

    def _send(self, parts: list[Any]) -> Any: ...

    def _send_control(self, stream_id: int, kind: Kind, payload: np.ndarray | None = None
                      ) -> None: ...

    @property
    def prefix_cache_supported(self) -> bool:
        """Whether the stages keep prefix entries (not a static export's)."""
        return self.stage0.prefix_cache_supported

    def save_prefix(self, stream_id: int, entry_id: int, length: int, *,
                    take: bool = False) -> None:
        """Keep the stream's first ``length`` logical KV slots (a stream alone, or a row of a
        row group) as entry ``entry_id`` on every stage; ``take`` (a stream alone) makes its
        KV the entry and closes it. Stage 0 refusing raises its StageError (and no stage
        keeps an entry of that id); a later stage refusing logs it there, and loads of the
        entry then fail at that stage."""
        self._require_prefix_cache()
        found = None if stream_id in self.stage0.streams else self.stage0.row_of(stream_id)
        owner = stream_id if found is None else found[0]
        self._check_prefix_stream(stream_id, owner)
        if take:
            self._guard.release(stream_id)  # its last output may still be on the wire
        try:
            self.stage0.save_prefix(stream_id, entry_id, length, take)
        except StageError:
            self._unsent_drops |= {entry_id}  # the stages after keep no old entry of the id
            self._flush_prefix_drops(strict=False)
            raise
        try:
            self._send_control(owner, Kind.PREFIX,
                               prefix_payload(PrefixOp.SAVE, entry_id, length, take, stream_id))
        except DataPlaneError:
            self.stage0.drop_prefix(entry_id)
            raise
        finally:
            if take:  # closed on stage 0 either way
                del self._streams[stream_id]
                self._guard.forget(stream_id)

    def load_prefix(self, stream_id: int, entry_id: int, length: int, *,
                    take: bool = False) -> None:
        """Give an open stream stepped alone entry ``entry_id``'s first ``length`` slots on
        every stage; its next step continues at position ``length``. Stage 0 refusing raises
        its StageError and changes nothing; a later stage refusing fails the stream's next
        step there with an ERROR naming the stage and why."""
        self._require_prefix_cache()
        found = None if stream_id in self._streams else self.stage0.row_of(stream_id)
        if found is not None:
            raise DataPlaneError(f"stream {stream_id} is a row of row group {found[0]}: a "
                                 "prefix loads only into a stream stepped alone")
        self._check_prefix_stream(stream_id, stream_id)
        self._guard.release(stream_id)  # its request may be replaced
        self.stage0.load_prefix(stream_id, entry_id, length, take)
        self._streams[stream_id].rewind = 0  # a rewind of the KV just replaced
        self._send_control(stream_id, Kind.PREFIX,
                           prefix_payload(PrefixOp.LOAD, entry_id, length, take, stream_id))

    def _require_prefix_cache(self) -> None:
        if not self.prefix_cache_supported:
            raise PrefixCacheUnsupported("a static (NPU) export keeps no prefix cache: prefix "
                                         "entries need the stateful export")

    def _check_prefix_stream(self, stream_id: int, owner: int) -> None:
        """Refuse a save or load now unless the stream (or the row group ``owner`` it is a
        row of) is open and sound and no drop is left unsent."""
        stream = self._streams.get(owner)
        if stream is None:
            raise DataPlaneError(f"stream {stream_id} is not open")
        if stream.broken:
            raise DataPlaneError(f"stream {owner} must be reset: {stream.broken}")
        self._flush_prefix_drops(strict=True)

    def drop_prefix(self, entry_id: int) -> None:
        """Free entry ``entry_id`` on every stage (an unknown id is no error; when the chain
        does not take the frame, it is sent before the next save or load)."""
        self.stage0.drop_prefix(entry_id)
        if self.prefix_cache_supported:
            self._unsent_drops |= {entry_id}
            self._flush_prefix_drops(strict=False)

    def drop_all_prefixes(self) -> None:
        """Free every entry on every stage; never raises (a broken chain gets it later)."""
        self.stage0.drop_all_prefixes()
        if self.prefix_cache_supported:
            self._unsent_drops, self._unsent_drop_all = frozenset(), True
            self._flush_prefix_drops(strict=False)

    def prefix_bytes(self) -> dict[int, int]:
        """Bytes of prefix entries held by the stages run here: stage 0's."""
        return {0: self.stage0.prefix_bytes()}

    def _flush_prefix_drops(self, strict: bool) -> None:
        """Send the drops not sent yet (a DROP_ALL first); ``strict``: raise DataPlaneError
        if any is left."""
        if self._unsent_drop_all and self._send_drop(PrefixOp.DROP_ALL, 0):
            self._unsent_drop_all = False
        for entry_id in sorted(self._unsent_drops) if not self._unsent_drop_all else ():
            if not self._send_drop(PrefixOp.DROP, entry_id):
                break
            self._unsent_drops -= {entry_id}
        if strict and (self._unsent_drop_all or self._unsent_drops):
            raise DataPlaneError(f"stage 1 at {self.next_addr} is not taking frames: prefix "
                                 "drops are still to be sent")

    def _send_drop(self, op: PrefixOp, entry_id: int) -> bool:
        if self.stage0.spec.last:
            return True  # the head runs every stage: nothing to tell
        parts = encode_frame(HiddenStateFrame(Kind.PREFIX, 0, 0, 0),
                             prefix_payload(op, entry_id))
        try:
            self._send(parts)
        except TransportError as exc:
            log.warning("prefix %s not sent to stage 1 at %s (sent later): %s", op.name,
                        self.next_addr, exc)
            return False
        self.figures.sent_bytes += frame_bytes(parts)
        return True
