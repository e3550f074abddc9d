"""A stage worker's prefix entries: the PREFIX frames it applies, in order with the steps
(one pipe), and passes on (dataplane.runtime.kv.prefix_entries for what an entry is).

A LOAD this stage cannot apply refuses the stream's steps of that epoch with the reason
(an ERROR reply naming the stage), so a stream never steps on KV it does not have; a SAVE
it cannot apply leaves no entry of that id, so a later LOAD of it fails the same way.
"""

from __future__ import annotations

import numpy as np

from dataplane.runtime.base import StageRuntime
from dataplane.wire.frames import FrameError, HiddenStateFrame
from dataplane.wire.prefix_ops import PrefixCommand, PrefixOp, prefix_command
from dataplane.wire.transport import BufferGuard
from dataplane.worker.state import _StreamState


class WorkerPrefixes:
    """StageWorker's handling of PREFIX frames (a mixin)."""

    runner: StageRuntime
    stage: int
    last: bool
    _streams: dict[int, _StreamState]
    _guard: BufferGuard

    def _count(self, name: str, n: int = 1) -> None: ...
    def _problem(self, key: str, message: str) -> None: ...
    def _send(self, header: HiddenStateFrame, body: np.ndarray | None) -> None: ...
    def _admitted(self, header: HiddenStateFrame) -> tuple[_StreamState | None, str] | None: ...

    def _on_prefix(self, header: HiddenStateFrame, payload: np.ndarray | None) -> None:
        """Save, load or drop a prefix entry (dataplane.runtime.kv.prefix_entries) and pass the frame on."""
        try:
            command = prefix_command(header, payload)
        except FrameError as exc:
            self._count("malformed")
            self._problem("malformed", f"stage {self.stage} dropped a malformed frame: {exc}")
            self._unknown_prefix_op(header, exc)
            return
        if command.op == PrefixOp.DROP:
            self.runner.drop_prefix(command.entry_id)
            self._count("prefix_drops")
        elif command.op == PrefixOp.DROP_ALL:
            self.runner.drop_all_prefixes()
            self._count("prefix_drops")
        else:
            admitted = self._admitted(header)
            if admitted is None:
                return
            state, verdict = admitted
            if command.op == PrefixOp.LOAD:
                self._load_prefix(header, command, state, verdict)
            else:
                self._save_prefix(command, state if verdict == "current" else None)
        if not self.last:
            header.source_stage = self.stage
            self._send(header, payload)

    def _load_prefix(self, header: HiddenStateFrame, command: PrefixCommand,
                     state: _StreamState | None, verdict: str) -> None:
        """Load an entry into the stream; on failure its steps of this epoch are refused."""
        sid = header.stream_id
        self._guard.release(sid)  # its request may be replaced
        if state is None or verdict == "new":  # it missed the stream's RESET
            self.runner.reset_stream(sid)
            state = self._streams[sid] = _StreamState(header.epoch)
            self._count("implicit_resets")
        try:
            self.runner.load_prefix(sid, command.entry_id, command.length, command.take)
        except Exception as exc:  # nothing changed; the stream's next step is refused
            self._count("prefix_failures")
            state.broken = (f"loading prefix entry {command.entry_id} ({command.length} tokens) "
                            f"into stream {sid} failed: {exc}")
            self._problem("prefix", f"stage {self.stage}: {state.broken}")
        else:
            self._count("prefix_loads")

    def _save_prefix(self, command: PrefixCommand, state: _StreamState | None) -> None:
        """Save a stream's prefix as an entry; on failure no entry of that id is left, so a
        later load of it fails rather than loading something else."""
        sid = command.stream_id
        try:
            if state is None or state.broken:
                raise RuntimeError(state.broken if state is not None else
                                   "this stage never saw the stream's epoch")
            if command.take:
                self._guard.release(sid)
            self.runner.save_prefix(sid, command.entry_id, command.length, command.take)
        except Exception as exc:
            self.runner.drop_prefix(command.entry_id)
            self._count("prefix_failures")
            self._problem("prefix", f"stage {self.stage}: saving stream {sid} as prefix entry "
                                    f"{command.entry_id} failed: {exc}")
            return
        self._count("prefix_saves")
        if command.take:  # the stream is closed here: its later frames of the epoch are stale
            state.closed = True

    def _unknown_prefix_op(self, header: HiddenStateFrame, exc: Exception) -> None:
        """A PREFIX frame that could not be read: drop every entry (a SAVE it carried may
        have replaced one) and refuse the named stream's steps of this epoch (a LOAD it
        carried may have given it its KV)."""
        self.runner.drop_all_prefixes()
        state = self._streams.get(header.stream_id)
        if state is not None and state.epoch == header.epoch and not state.closed:
            state.broken = state.broken or f"a PREFIX frame for it was malformed: {exc}"
