"""StageWorker: serve one stage shard on a node, frame in from the previous hop, frame out.

A worker PULL-binds its inbound address and PUSH-connects to its next hop (the next
stage, or the coordinator's reply address when it runs the last stage). It drops
frames of stale epochs, applies resets, rewinds, compactions, row groups, prefix entries
and cancels (all in order with the steps: one pipe), steps the stage, stamps its timing
record and passes the frame on; the last stage answers with top-1, top-k or
full logits. Malformed frames are counted and logged, never fatal; a step the stage
refuses becomes an ERROR frame so the coordinator fails fast instead of hanging, and so
do the steps of a stream whose KV here is not what the coordinator thinks (a compaction,
prefix load or cancel this stage could not apply). A pipelined stream's step that a
cancel waiting in the pipe covers, or (on the last stage) a guess its own answer refutes,
is skipped: never computed, nor passed on.

Run in a thread (``start``/``stop``) or as a node's main loop (``run``, or as a process:
``python -m dataplane.worker EXPORT --stage K --bind ADDR --send-to ADDR``).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import fields, replace
from typing import Any

import numpy as np
import zmq

from dataplane.runtime.base import StageRuntime
from dataplane.runtime.kv.slots import held_slots
from dataplane.wire.cancels import read_cancel
from dataplane.wire.frames import (
    EMPTY_INDEX,
    TOPK_DTYPE,
    FrameError,
    HiddenStateFrame,
    Kind,
    PreparedFrame,
    ReplyMode,
    decode_frame,
    encode_frame,
    prepare_frame,
    stamp,
)
from dataplane.wire.pipes import open_pipes, open_push
from dataplane.wire.prefix_ops import PrefixCommand, PrefixOp, prefix_command
from dataplane.wire.reply_records import reply_payload, top1_record
from dataplane.wire.transport import (
    DEFAULT_OPTIONS,
    BufferGuard,
    PipeOptions,
    TransportError,
    bound_endpoint,
    recv_parts,
    send_parts,
)
from dataplane.worker.hop import compute_step, seal_or_encode
from dataplane.worker.lookahead import Lookahead
from dataplane.worker.state import StreamState, ThrottledLog, WorkerStats, admit

log = logging.getLogger("zctl.dataplane.worker")
__all__ = ["CONTROL_PREFIX", "StageWorker", "WorkerStats", "admit"]
_ids = itertools.count()
CONTROL_PREFIX = b"ZCTL-CMD"  # never the start of a data frame (those start with b"ZCDP")


class StageWorker:
    """Serves ``runner``'s stage: PULL-binds ``bind_addr``, PUSH-connects to ``send_to``.

    ``bind_addr`` may use a wildcard port (``tcp://127.0.0.2:*``); ``endpoint`` gives
    the address actually bound. ``send_to`` is the next stage's bind address, or the
    coordinator's reply address for the last stage. Sockets are created here (so a
    bad address fails at construction) and used only by the loop thread afterwards.
    """

    def __init__(self, runner: StageRuntime, bind_addr: str, send_to: str, *,
                 context: zmq.Context | None = None, options: PipeOptions = DEFAULT_OPTIONS,
                 samples: int = 1024) -> None:
        self.runner = runner
        self.stage = runner.spec.index
        self.last = runner.spec.last
        self.options = options
        self.send_to = send_to
        self._ctx = context or zmq.Context.instance()
        self._pull, self._push = open_pipes(self._ctx, bind_addr, send_to, options)
        self.endpoint = bound_endpoint(self._pull)
        # Commands (stop, rewire) arrive on the same PULL socket through an inproc
        # endpoint, so the loop blocks in one recv with no poller; a per-worker secret
        # keeps remote peers from forging them.
        self._ctrl_addr = f"inproc://zctl-worker-{next(_ids)}"
        self._ctrl_key = CONTROL_PREFIX + secrets.token_bytes(16)
        self._pull.bind(self._ctrl_addr)
        self._streams: dict[int, StreamState] = {}
        # frames taken off the pipe ahead of their turn, and the cancels among them: the
        # steps those cover are skipped
        self._lookahead = Lookahead(self._pull)
        self._guard = BufferGuard()
        self._stepped: int | None = None  # the stream whose step was handled last
        self._stats = WorkerStats()
        self._compute: deque[float] = deque(maxlen=samples)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._running = False
        self._throttle = ThrottledLog()
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> StageWorker:
        """Run the loop in a daemon thread; returns self."""
        if self._thread is not None:
            raise RuntimeError("this worker is already running")
        self._running = True
        self._thread = threading.Thread(target=self.run, name=f"zctl-stage{self.stage}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the loop to exit (from any thread) and wait for a started thread to end.

        A worker whose loop never ran just closes its sockets.
        """
        if not self._running:
            if not self._closed:
                self._close()
            return
        self._command(b"stop")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        """True while the loop runs (or is about to, after ``start``)."""
        return self._running and not self._closed

    def rewire(self, send_to: str, peer_key: str = "") -> None:
        """Point the outbound pipe at a new next hop (from any thread; applied by the loop);
        with CURVE, ``peer_key`` is the new hop's public key."""
        self._command(b"rewire", send_to.encode(), peer_key.encode())

    def _command(self, *parts: bytes) -> None:
        if self._closed:
            return
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self._ctrl_addr)
        sock.send_multipart([self._ctrl_key, *parts])
        sock.close()

    def run(self) -> None:
        """The worker loop: block in recv until a frame or a command arrives, handle it."""
        if self._closed:
            raise RuntimeError("this worker has been stopped")
        self._running = True
        ready_ns = time.time_ns()
        backlog = self._lookahead.backlog
        try:
            while True:
                if backlog:
                    parts, recv_ns = backlog.popleft()
                else:
                    parts = recv_parts(self._pull)
                    recv_ns = time.time_ns()
                if parts[0] == self._ctrl_key:
                    if not self._on_command(parts[1:]):
                        break
                else:
                    self.handle(parts, recv_ns, ready_ns)
                    self._prefetch_when_idle()
                ready_ns = time.time_ns()
        finally:
            self._close()

    def _on_command(self, parts: list[Any]) -> bool:
        command = [bytes(p) for p in parts]
        if command[0] == b"rewire" and len(command) == 3:
            address, key = command[1].decode(), command[2]
            try:
                options = self.options
                if options.curve is not None and key:
                    options = replace(options, curve=replace(options.curve, peer=key))
                push = open_push(self._ctx, address, options)
            except (TransportError, ValueError) as exc:
                self._problem("rewire", f"stage {self.stage}: {exc}")
                return True
            self._push.close(0)
            self._push, self.send_to, self.options = push, address, options
            log.info("stage %d now sends to %s", self.stage, address)
            return True
        return command[0] != b"stop"

    def _close(self) -> None:
        self._closed = True
        for sock in (self._pull, self._push):
            sock.close(0)

    # -- stats -----------------------------------------------------------------------
    def stats(self) -> WorkerStats:
        """A consistent snapshot of the counters and recent compute samples (any thread)."""
        with self._lock:
            snap = WorkerStats(**{f.name: getattr(self._stats, f.name) for f in fields(WorkerStats)
                                  if f.name != "compute_ms"})
            snap.compute_ms = list(self._compute)
        return snap

    def kv_slots(self) -> int:
        """KV slots the stage holds now, all streams and row groups (any thread; see
        slots.held_slots): what the node reports in its heartbeats."""
        return held_slots(self.runner)

    def prefix_bytes(self) -> int:
        """Bytes of the prefix entries the stage holds now (any thread)."""
        return self.runner.prefix_bytes()

    def _count(self, name: str, n: int = 1) -> None:
        # Only the loop thread writes counters: no lock (readers may see one step late).
        setattr(self._stats, name, getattr(self._stats, name) + n)

    def _problem(self, key: str, message: str) -> None:
        with self._lock:
            self._stats.last_problem = message
        self._throttle.warn(key, message)

    # -- frames ----------------------------------------------------------------------
    def handle(self, parts: list[Any], recv_ns: int, ready_ns: int) -> None:
        """Process one received multipart message (never raises for bad input)."""
        self._stats.frames_in += 1
        t0 = time.perf_counter_ns()
        try:
            header, payload = decode_frame(parts)
        except FrameError as exc:
            self._count("malformed")
            self._problem("malformed", f"stage {self.stage} dropped a malformed frame: {exc}")
            if exc.header is not None and exc.header.kind == Kind.STEP:
                self._send_error(exc.header, f"malformed frame: {exc}", recv_ns, ready_ns)
            elif exc.header is not None and exc.header.kind == Kind.PREFIX:
                self._unknown_prefix_op(exc.header, exc)
            return
        decode_ns = time.perf_counter_ns() - t0
        try:
            if header.kind == Kind.STEP:
                self._on_step(header, payload, recv_ns, ready_ns, decode_ns)
            elif header.kind in (Kind.RESET, Kind.CLOSE):
                self._on_control(header)
            elif header.kind == Kind.COMPACT:
                self._on_compact(header)
            elif header.kind == Kind.GROUP:
                self._on_group(header, payload)
            elif header.kind == Kind.PREFIX:
                self._on_prefix(header, payload)
            elif header.kind == Kind.CANCEL:
                self._on_cancel(header, payload)
            elif header.kind == Kind.ERROR:
                self._count("errors_forwarded")
                self._send(header, None)
            else:
                self._count("unexpected")
                self._problem("unexpected", f"stage {self.stage} got a {header.kind.name} "
                                            f"frame (stream {header.stream_id}); dropped")
        except Exception as exc:  # keep serving whatever one frame did
            log.exception("stage %d failed on a %s frame", self.stage, header.kind.name)
            self._problem("internal", f"stage {self.stage}: {exc!r}")

    def _on_control(self, header: HiddenStateFrame) -> None:
        sid = header.stream_id
        state = self._streams.get(sid)
        if admit(state.epoch if state else None, header.epoch) != "new":
            self._count("stale")
            return
        self._guard.release(sid)
        self._lookahead.marks.drop_older(sid, header.epoch)
        if header.kind == Kind.RESET:
            self.runner.reset_stream(sid, header.long_rope)
            self._streams[sid] = StreamState(header.epoch)
            self._count("resets")
        else:
            self.runner.close_stream(sid)
            self._streams[sid] = StreamState(header.epoch, closed=True)
            self._count("closes")
        if not self.last:
            header.source_stage = self.stage
            self._send(header, None)

    def _admit(self, header: HiddenStateFrame) -> tuple[StreamState | None, str] | None:
        """The frame's stream state and epoch verdict; None (counted) if the frame is stale."""
        state = self._streams.get(header.stream_id)
        verdict = admit(state.epoch if state else None, header.epoch)
        if verdict == "stale" or (state is not None and state.closed and verdict == "current"):
            self._count("stale")
            return None
        return state, verdict

    def _on_compact(self, header: HiddenStateFrame) -> None:
        """Drop the stream's masked KV slots; PUSH/PULL order puts it between its steps."""
        sid = header.stream_id
        admitted = self._admit(header)
        if admitted is None:
            return
        state, verdict = admitted
        if state is None or verdict == "new":  # it missed the epoch: its next step fails
            self._count("compact_failures")
            self._problem("compact", f"stage {self.stage} got a COMPACT for epoch "
                                     f"{header.epoch} of stream {sid}, which it never saw")
            return
        try:
            self.runner.compact(sid)
            self._count("compactions")
        except Exception as exc:  # the KV may be half compacted: refuse the epoch's steps
            self._count("compact_failures")
            state.broken = f"compaction of stream {sid} failed: {exc}"
            self._problem("compact", f"stage {self.stage}: {state.broken}")
        if not self.last:
            header.source_stage = self.stage
            self._send(header, None)

    def _on_group(self, header: HiddenStateFrame, members: np.ndarray | None) -> None:
        """Move the listed streams' KV into rows of the group (in order with the steps)."""
        gid = header.stream_id
        admitted = self._admit(header)
        if admitted is None:
            return
        state, verdict = admitted
        if state is None or verdict == "new":
            state = self._streams[gid] = StreamState(header.epoch)
        ids = [] if members is None else [int(m) for m in members]
        for sid in (gid, *ids):  # their last outputs may still be on the wire
            self._guard.release(sid)
        broken = [self._streams[sid].broken for sid in ids
                  if sid in self._streams and self._streams[sid].broken]
        if broken:  # a row whose KV is wrong here (a prefix it could not load): refuse
            state.broken = f"row group {gid} takes a broken stream: {broken[0]}"
            self._problem("group", f"stage {self.stage}: {state.broken}")
        try:
            self.runner.regroup(gid, ids)
        except Exception as exc:  # nothing changed here; the group's steps are refused
            self._count("group_failures")
            state.broken = f"row group {gid} could not take streams {ids}: {exc}"
            self._problem("group", f"stage {self.stage}: {state.broken}")
        else:
            self._count("regroups")
            for sid in ids:
                self._streams.pop(sid, None)
            if not ids:
                state.closed = True
        if not self.last:
            header.source_stage = self.stage
            self._send(header, members)

    def _on_prefix(self, header: HiddenStateFrame, payload: np.ndarray | None) -> None:
        """Save, load or drop a prefix entry (on the runner, in order with the steps) and pass
        the frame on. A LOAD this stage cannot apply refuses the stream's steps of that epoch
        with the reason (an ERROR reply naming the stage), so a stream never steps on KV it
        does not have; a SAVE it cannot apply leaves no entry of that id, so a later LOAD of
        it fails the same way."""
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
            admitted = self._admit(header)
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
                     state: StreamState | None, verdict: str) -> None:
        """Load an entry into the stream; on failure its steps of this epoch are refused."""
        sid = header.stream_id
        self._guard.release(sid)  # its request may be replaced
        if state is None or verdict == "new":  # it missed the stream's RESET
            self.runner.reset_stream(sid)
            state = self._streams[sid] = StreamState(header.epoch)
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

    def _save_prefix(self, command: PrefixCommand, state: StreamState | None) -> None:
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

    def _on_cancel(self, header: HiddenStateFrame, payload: np.ndarray | None) -> None:
        """Cancel the stream's steps first..last (those not computed here yet are skipped
        when their turn comes, or were already: see Lookahead) and rewind it to the tokens
        the cancel keeps; passed on in order, so the next stage does the same."""
        sid = header.stream_id
        admitted = self._admit(header)
        if admitted is None:
            return
        state, verdict = admitted
        try:
            rng = read_cancel(payload)
        except ValueError as exc:
            self._count("malformed")
            self._problem("cancel", f"stage {self.stage} dropped a CANCEL of stream {sid}: {exc}")
            return
        self._lookahead.marks.clear(sid, header.epoch, rng)
        if state is None or verdict == "new":  # it missed the epoch: its next step fails
            self._problem("cancel", f"stage {self.stage} got a CANCEL for epoch {header.epoch} "
                                    f"of stream {sid}, which it never saw")
        else:
            state.next_step = max(state.next_step, rng.last + 1)
            state.refuted, state.fed, state.answered = False, None, None
            state.pipelined = True
            try:
                self.runner.truncate(sid, rng.keep)
                self._count("cancels")
            except Exception as exc:  # its KV is not what the coordinator's is: refuse steps
                state.broken = f"a cancel of stream {sid} failed: {exc}"
                self._problem("cancel", f"stage {self.stage}: {state.broken}")
        if not self.last:
            header.source_stage = self.stage
            self._send(header, payload)

    def _on_step(self, header: HiddenStateFrame, payload: np.ndarray | None, recv_ns: int,
                 ready_ns: int, decode_ns: int) -> None:
        sid = header.stream_id
        admitted = self._admit(header)
        if admitted is None:
            return
        state, verdict = admitted
        if verdict == "new":  # its RESET was lost, or the coordinator never sent one
            self._guard.release(sid)
            self.runner.reset_stream(sid)
            state = self._streams[sid] = StreamState(header.epoch)
            self._count("implicit_resets")
        assert state is not None and payload is not None
        if state.broken:
            self._send_error(header, state.broken, recv_ns, ready_ns)
            return
        if header.step != state.next_step:
            self._send_error(header, f"expected step {state.next_step} of stream {sid}, got "
                                     f"step {header.step}: a frame was lost upstream",
                             recv_ns, ready_ns)
            return
        if self._is_covered(header, state) or (self.last and header.guessed
                                             and state.refutes(header.fed)):
            self._skip(state)
            return
        self._guard.release(sid)
        positions, logits_idx, rewinds = header.positions, header.logits_idx, header.row_rewinds
        fed, one_query = header.fed, header.one_query
        row_tokens = header.row_tokens  # _prepare_out clears these on a reply's header
        start = time.perf_counter_ns()
        prepared = self._prepare_out(header, payload, recv_ns, ready_ns)
        prepare_ns = time.perf_counter_ns() - start
        start += prepare_ns
        try:
            out = compute_step(self.runner, sid, payload, positions, header.mask_tail, rewinds,
                               logits_idx if self.last and logits_idx.size else None,
                               row_tokens=row_tokens, one_query=one_query)
        except Exception as exc:  # a stage failure must reach the coordinator, not kill us
            self._send_error(header, str(exc), recv_ns, ready_ns)
            return
        compute_ns = time.perf_counter_ns() - start
        if self.last:
            state.remember_answers(fed, out)
        start = time.perf_counter_ns()
        state.next_step += 1
        self._stats.steps += 1
        if not self.last:
            body = out
        elif header.reply is ReplyMode.TOP1 and out.size == out.shape[-1]:
            body = top1_record(out)  # one answer: its 8 bytes, sealed into the frame as is
        else:
            body = reply_payload(out, header.reply, header.top_k)
        # Hidden states and full logits are sent zero-copy out of the request's output
        # tensor, which the stream's next inference overwrites: guard it until sent.
        guard = sid if not self.last or header.reply == ReplyMode.LOGITS else None
        try:
            parts = seal_or_encode(prepared, header, body, self.stage, recv_ns, ready_ns,
                                   decode_ns, compute_ns, prepare_ns, start)
        except FrameError as exc:
            self._note_drop(header, exc)
        else:
            self._send_parts(header, parts, guard)
        with self._lock:
            self._compute.append(compute_ns / 1e6)
        self._stepped = sid

    def _prepare_out(self, header: HiddenStateFrame, payload: np.ndarray, recv_ns: int,
                     ready_ns: int) -> PreparedFrame | None:
        """Turn ``header`` into the outgoing one and pack it for the output this step will
        most likely produce (hidden states like the input, or a top-1 reply); None when
        that cannot be predicted (other replies are encoded once computed)."""
        header.source_stage, header.error = self.stage, ""
        if not self.last:
            shape, dtype = payload.shape, payload.dtype
        else:
            header.kind = Kind.REPLY
            header.row_rewinds = EMPTY_INDEX  # applied; a reply carries none
            header.fed, header.guessed, header.one_query = EMPTY_INDEX, False, False
            if not header.logits_idx.size:  # answering for the last token: the coordinator
                header.positions = EMPTY_INDEX  # knows its position, save the bytes
                header.row_tokens = EMPTY_INDEX
            if header.reply != ReplyMode.TOP1:
                return None
            shape, dtype = (header.answer_rows, 1), TOPK_DTYPE
        try:
            return prepare_frame(header, shape, dtype, self.stage, recv_ns, ready_ns)
        except FrameError:
            return None

    def _is_covered(self, header: HiddenStateFrame, state: StreamState) -> bool:
        """Whether a cancel waiting behind this step covers it: then it is not computed
        (nor passed on). Only a pipelined stream's steps look ahead: for the others it would
        be ~3-5 us a step for nothing."""
        if not (state.pipelined or header.fed.size):
            return False
        state.pipelined = True
        return self._lookahead.covers(header.stream_id, header.epoch, header.step)

    def _skip(self, state: StreamState) -> None:
        """Skip the step whose turn it is: its step number is used up, nothing is computed."""
        state.next_step += 1
        self._count("skipped")

    def _prefetch_when_idle(self) -> None:
        """With no frame waiting, bind the last stepped stream's likely next inputs now
        (StageRuntime.prefetch), off the path of the frame that will need them."""
        sid, self._stepped = self._stepped, None
        if sid is not None and self._lookahead.idle():
            try:
                self.runner.prefetch(sid)
            except Exception as exc:  # a guess must never take the worker down
                self._problem("prefetch", f"stage {self.stage} could not prefetch stream {sid}: "
                                          f"{exc}")

    def _send_error(self, header: HiddenStateFrame, message: str, recv_ns: int,
                    ready_ns: int) -> None:
        self._count("errors_sent")
        text = f"stage {self.stage}: {message}"
        self._problem("error", f"{text} (stream {header.stream_id}, step {header.step})")
        header.kind, header.error, header.source_stage = Kind.ERROR, text, self.stage
        header.timings = stamp(header.timings, self.stage, recv_ns, ready_ns, time.time_ns(),
                               0, 0, 0)
        self._send(header, None)

    def _send(self, header: HiddenStateFrame, body: np.ndarray | None) -> None:
        """Encode and send a frame the worker passes on or answers with."""
        try:
            parts = encode_frame(header, body)
        except FrameError as exc:
            self._note_drop(header, exc)
            return
        self._send_parts(header, parts, None)

    def _note_drop(self, header: HiddenStateFrame, exc: Exception) -> None:
        self._count("send_failures")
        self._problem("send", f"stage {self.stage} dropped a {header.kind.name} frame of "
                              f"stream {header.stream_id}: {exc}")

    def _send_parts(self, header: HiddenStateFrame, parts: list[Any],
                    guard_key: int | None) -> None:
        try:
            tracker = send_parts(self._push, parts)
        except TransportError as exc:
            self._note_drop(header, exc)
            return
        if guard_key is not None:
            self._guard.hold(guard_key, tracker)
        self._stats.frames_out += 1
