"""ClusterHead: the coordinator's end of the data plane (an ``Executor`` over the network).

The coordinator is a node too: it runs stage 0 locally, PUSHes the hidden state to
stage 1 and receives the last stage's answer on its own bound PULL socket. Several
requests (of one or many streams) may be in flight: ``submit`` returns a request id,
``collect`` / ``collect_any`` wait for answers (its ``ReplyInbox``, dataplane.head.inbox);
``step`` is the blocking pair used by ``generate_greedy``. Each reset gives a stream a new
epoch, so frames and replies of an older epoch are dropped wherever they turn up. Every
operation on a stream (resets, row groups, rewinds, cancels, compactions, prefix entries)
is applied on stage 0 here and sent down the chain in order with the steps. Not
thread-safe: drive it from one thread (stats and timing windows may be read from others).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import zmq

from dataplane.head.errors import DataPlaneError, StageUnreachable
from dataplane.head.inbox import ClusterStats, Pending, ReplyInbox
from dataplane.head.metrics import StepMetrics
from dataplane.head.prefix_drops import PrefixDrops
from dataplane.head.replies import ClusterReply, reply_mode
from dataplane.runtime.base import StageError, StageRuntime
from dataplane.runtime.kv.slots import held_slots
from dataplane.wire.cancels import cancel_payload
from dataplane.wire.frames import (
    DTYPES,
    EMPTY_INDEX,
    HiddenStateFrame,
    Kind,
    ReplyMode,
    encode_frame,
    frame_bytes,
    prepare_frame,
)
from dataplane.wire.pipes import open_pipes, open_push
from dataplane.wire.prefix_ops import PrefixOp, prefix_payload
from dataplane.wire.timing import TimingWindow
from dataplane.wire.transport import (
    DEFAULT_OPTIONS,
    BufferGuard,
    PipeOptions,
    TransportError,
    send_parts,
)
from dataplane.worker.hop import compute_step, seal_or_encode
from zctl.engine.executor import PrefixCacheUnsupported, Step
from zctl.engine.payloads import Want

HIDDEN_DTYPE = DTYPES[1]  # float32: what stage 0 hands on
INT64 = np.dtype(np.int64)
log = logging.getLogger("zctl.dataplane.cluster")


@dataclass
class _Stream:
    epoch: int
    next_step: int = 0
    broken: str = ""  # why the stream must be reset before its next step
    rewind: int = 0  # tokens ``rewind`` dropped, applied with the next step


class ClusterHead:
    """The coordinator: runs ``stage0`` here, the other stages on the nodes down the chain
    (or every stage here, when ``stage0`` is a chain of them all: ``answers_here``).

    ``next_addr`` is stage 1's bind address; ``reply_bind_addr`` is bound here for the
    last stage's answers (a wildcard port is fine: ``reply_endpoint`` tells the address
    to give the last stage as its ``send_to``). ``timeout_s`` bounds each step's wait.
    Like LocalChain, once a rewind leaves more than ``compact_threshold`` masked slots on
    stage 0 (None: never), every stage compacts the stream: stage 0 here, the others on
    a COMPACT frame sent ahead of the step (``compactions`` counts them). It owns its
    inbox of answers (``inbox``) and the prefix drops the chain has not taken yet.
    """

    def __init__(self, stage0: StageRuntime, next_addr: str, reply_bind_addr: str, *,
                 timeout_s: float = 30.0, context: zmq.Context | None = None,
                 options: PipeOptions = DEFAULT_OPTIONS, timing_window: int = 512,
                 compact_threshold: int | None = 64) -> None:
        if not stage0.spec.first:
            raise ValueError(f"the coordinator runs stage 0, not stage {stage0.spec.index}")
        self.num_stages = len(stage0.manifest.stages)
        self.vocab_size = stage0.manifest.model.vocab_size
        self._stage0 = stage0
        self._retired = False  # replaced by a new pipeline: stage 0 is not ours any more
        self._busy = threading.Lock()  # held while a step computes on stage 0
        # held while the outbound pipe is used: the generating thread uses it, and ``close``
        # may come from the thread that re-wires the cluster (a ZeroMQ socket is one
        # thread's; the inbox holds its reply pipe the same way)
        self._io = threading.Lock()
        self._closed = False
        self.compact_threshold = compact_threshold
        self.compactions = 0
        self.options = options
        self.next_addr = next_addr
        self._ctx = context or zmq.Context.instance()
        pull, self._push = open_pipes(self._ctx, reply_bind_addr, next_addr, options)
        self._epochs = itertools.count(time.time_ns())  # unique, rising across restarts
        self._request_ids = itertools.count(1)
        self._streams: dict[int, _Stream] = {}
        self.wirings = 0  # rewires and abandons: the later stages' KV may be gone
        self._guard = BufferGuard()
        self.stats = ClusterStats()
        self.timings = TimingWindow(timing_window)
        self.metrics = StepMetrics(self.num_stages, hops=True)  # cumulative, for stats
        self.inbox = ReplyInbox(pull, self.num_stages, timeout_s, self.stats, self.timings,
                                self.metrics, next_hop=lambda: self.next_addr,
                                prefetch=lambda sid: self.stage0.prefetch(sid),
                                broken=self._mark_broken)
        self.reply_endpoint = self.inbox.reply_endpoint
        self._unsent_drops = PrefixDrops()  # prefix drops the chain has not taken yet

    @property
    def timeout_s(self) -> float:
        """How long a step may take to be answered (then it fails with StageTimeout)."""
        return self.inbox.timeout_s

    # -- lifecycle -------------------------------------------------------------------
    @property
    def stage0(self) -> StageRuntime:
        """The stages run here; DataPlaneError once ``retire`` handed them on."""
        if self._retired:
            raise DataPlaneError("this pipeline was replaced (the cluster was re-wired)")
        return self._stage0

    def retire(self) -> None:
        """Hand stage 0 on (to the pipeline that replaces this one): wait for a step that is
        computing, then refuse every use of it, so its compiled runner can be reused."""
        with self._busy:
            self._retired = True

    def close(self) -> None:
        """Close the sockets (streams on the nodes stay until their next reset/close); any
        thread, once the generating thread's use of them in hand ends. Using the pipeline
        afterwards raises DataPlaneError."""
        self.inbox.close()
        with self._io:
            self._closed = True
            self._push.close(0)

    def _check_open(self) -> None:
        if self._closed:
            raise DataPlaneError("this pipeline was replaced (the cluster was re-wired)")

    def _send(self, parts: list[Any]) -> Any:
        """Send to stage 1 (TransportError if it takes nothing); its MessageTracker."""
        with self._io:
            self._check_open()
            return send_parts(self._push, parts)

    def __enter__(self) -> ClusterHead:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def rewire(self, next_addr: str, peer_key: str = "", stage0: StageRuntime | None = None
               ) -> None:
        """Send to a new next-hop address (the control plane moved the chain); with
        ``stage0``, run those stages here from now on (a StageChain that took a lost
        node's stages; every stream's KV here starts empty).

        Requests in flight are abandoned and every stream must be reset: the stages'
        KV state does not move with the wiring.
        """
        if stage0 is not None:
            if not stage0.spec.first:
                raise ValueError(f"the coordinator runs stage 0, not stage {stage0.spec.index}")
            self._stage0 = stage0
        self.wirings += 1
        options = self.options
        if options.curve is not None and peer_key:
            options = replace(options, curve=replace(options.curve, peer=peer_key.encode()))
        with self._io:
            self._check_open()
            push = open_push(self._ctx, next_addr, options)
            self._push.close(0)
            self._push, self.next_addr, self.options = push, next_addr, options
        self.inbox.abandon("the pipeline was rewired")
        for stream in self._streams.values():
            stream.broken = stream.broken or "the pipeline was rewired"

    # -- streams (the Executor protocol) ---------------------------------------------
    @property
    def overlaps_steps(self) -> bool:
        """Stage 0 computes a step in ``submit`` and the later stages while it computes the
        next: a stream may have several steps in flight (pipelined prefill, pipelined
        speculation). Not once the head runs every stage itself (``answers_here``)."""
        return not self._stage0.spec.last

    def open(self, stream_id: int) -> None:
        self.stage0.open_stream(stream_id)
        if stream_id not in self._streams:
            self._streams[stream_id] = _Stream(epoch=next(self._epochs))

    def reset(self, stream_id: int, long_rope: bool = False) -> None:
        """Forget the stream's KV on every stage: a new epoch, and its old frames are dropped;
        ``long_rope``: its new sequence turns with LongRoPE's long set throughout."""
        if long_rope and not self.rope_short_context:  # refused before any frame goes
            raise ValueError(f"stream {stream_id} cannot turn with LongRoPE's long set: the "
                             "model has one set of frequencies")
        self.open(stream_id)
        self._new_epoch(stream_id, Kind.RESET, long_rope)
        self.stage0.reset_stream(stream_id, long_rope)

    def close_stream(self, stream_id: int) -> None:
        """Free the stream on every stage."""
        if stream_id not in self._streams:
            return
        self._new_epoch(stream_id, Kind.CLOSE)
        self.stage0.close_stream(stream_id)
        self._guard.forget(stream_id)
        del self._streams[stream_id]

    @property
    def rope_short_context(self) -> int:
        """LongRoPE's threshold (the manifest's; 0: the model has one set)."""
        return self.stage0.manifest.model.rope_short_context

    @property
    def paged_attention(self) -> bool:
        """Whether the stages keep KV in blocks (stage 0 tells: they share one runtime)."""
        return self.stage0.paged_attention

    @property
    def row_groups_supported(self) -> bool:
        """Whether the stages can batch streams as rows (not a static export's)."""
        return self.stage0.row_groups_supported

    @property
    def one_query_supported(self) -> bool:
        """Whether the stages compute one-query steps (paged attention; stage 0 tells: the
        cluster's stages share one runtime spec)."""
        return self.stage0.one_query_supported

    def regroup(self, group_id: int, members: list[int]) -> None:
        """Make ``group_id`` the row group of ``members`` on every stage (see
        ``StageRuntime.regroup``): stage 0 here, the others on a GROUP frame that reaches
        them in order with the steps. None of the group's or members' steps may be in
        flight. ``submit``/``step`` on ``group_id`` then take [rows, T] ids and positions."""
        busy = self.inbox.streams_in_flight() & {group_id, *members}
        if busy:
            raise DataPlaneError(f"cannot regroup while streams {sorted(busy)} have steps "
                                 "in flight")
        if group_id in self.stage0.streams:
            raise DataPlaneError(f"{group_id} is a stream, not a row group")
        for sid in (group_id, *members):
            self._guard.release(sid)  # a member's last output may still be on the wire
        self.stage0.regroup(group_id, list(members))
        group = self._streams.setdefault(group_id, _Stream(epoch=next(self._epochs)))
        for sid in members:
            self._streams.pop(sid, None)
            self._guard.forget(sid)
        ids = np.asarray(members, dtype=np.int64) if members else None
        self._send_control(group_id, Kind.GROUP, ids)
        if not members:
            del self._streams[group_id]
        elif group.broken:  # a failed GROUP send: the group's KV differs across stages
            raise DataPlaneError(f"row group {group_id}: {group.broken}")

    def _new_epoch(self, stream_id: int, kind: Kind, long_rope: bool = False) -> None:
        self._guard.release(stream_id)
        stream = self._streams[stream_id]
        stream.epoch, stream.next_step, stream.broken = next(self._epochs), 0, ""
        stream.rewind = 0
        self.inbox.forget_stream(stream_id)
        self._send_control(stream_id, kind, long_rope=long_rope)

    def _compact(self, stream_id: int) -> None:
        """After a rewind: past ``compact_threshold`` masked slots, compact the stream."""
        if self.stage0.compaction_due(stream_id, self.compact_threshold):
            self.compact(stream_id)

    def compact(self, stream_id: int) -> None:
        """Drop the stream's masked slots: stage 0 here, then a COMPACT frame the other
        stages apply before this stream's next step (frames keep their order). A row group
        is re-formed instead, which compacts its rows."""
        group = self.stage0.groups.get(stream_id)
        if group is not None:
            self.regroup(stream_id, list(group.members))
        else:
            self.stage0.compact(stream_id)
            self._send_control(stream_id, Kind.COMPACT)
        self.compactions += 1

    def rewind(self, stream_id: int, count: int) -> None:
        """Drop the stream's last ``count`` tokens on every stage, with its next step (the
        rewind travels in that step's frame). Row groups rewind per row with their steps."""
        stream = self._streams.get(stream_id)
        if stream is None:
            raise DataPlaneError(f"stream {stream_id} is not open")
        if stream_id in self.stage0.groups:
            raise DataPlaneError(f"row group {stream_id} rewinds per row, with its steps")
        stream.rewind += int(count)

    def cancel(self, stream_id: int, request_ids: Sequence[int], keep: int) -> None:
        """Cancel the stream's steps ``request_ids`` (its newest: every step submitted after
        the last one answered) and rewind it to its first ``keep`` logical tokens on every
        stage, in order with its steps: stage 0 here now, the others on a CANCEL frame (a
        stage that has not computed a cancelled step yet skips it). Their answers are
        dropped, arrived or not."""
        stream = self._streams.get(stream_id)
        if stream is None:
            raise DataPlaneError(f"stream {stream_id} is not open")
        if stream_id in self.stage0.groups:
            raise DataPlaneError(f"row group {stream_id}'s steps cannot be cancelled")
        steps, answered = self.inbox.cancel(stream_id, request_ids)
        try:
            self.stage0.truncate(stream_id, keep)
        except Exception as exc:
            stream.broken = stream.broken or f"stage 0 could not take a cancel ({exc})"
            raise
        stream.rewind = 0  # the cancel rewinds to an absolute length
        self.stats.cancelled += len(steps) + answered
        self._send_control(stream_id, Kind.CANCEL, cancel_payload(
            min(steps, default=stream.next_step), stream.next_step - 1, keep))
        self._compact(stream_id)  # after the CANCEL: the stages compact what it masked

    def timing_summary(self) -> dict[str, dict[str, float]]:
        """Percentiles of the recent steps' compute, queueing, serialisation and network time."""
        return self.timings.summary() if len(self.timings) else {}

    def clear_timings(self) -> None:
        self.timings.clear()

    def kv_slots(self) -> dict[int, int]:
        """KV slots held by the stages run here: stage 0's (see slots.held_slots); none
        once ``retire`` handed them on (the stats of a service asked while it is re-wired)."""
        if self._retired:
            return {}
        return {0: held_slots(self._stage0)}

    @property
    def answers_here(self) -> bool:
        """Whether the head runs the last stage too (a StageChain of every stage: the nodes
        that ran the others are gone): steps are answered here and no frame is sent."""
        return bool(self.stage0.spec.last)

    def _send_control(self, stream_id: int, kind: Kind, payload: np.ndarray | None = None,
                      long_rope: bool = False) -> None:
        if self.answers_here:
            return  # no stage runs elsewhere
        stream = self._streams[stream_id]
        header = HiddenStateFrame(kind=kind, stream_id=stream_id, request_id=0,
                                  epoch=stream.epoch, step=stream.next_step, long_rope=long_rope)
        parts = encode_frame(header, payload)
        try:
            self._send(parts)
        except TransportError as exc:
            stream.broken = f"its {kind.name} did not reach stage 1 ({exc})"
            raise StageUnreachable(f"cannot {kind.name.lower()} stream {stream_id}: stage 1 "
                                   f"at {self.next_addr} is not taking frames ({exc})"
                                   ) from None
        self.metrics.sent_bytes += frame_bytes(parts)

    # -- answers (the inbox) -----------------------------------------------------------
    @property
    def in_flight(self) -> list[int]:
        """Request ids submitted and not yet answered, oldest first."""
        return self.inbox.in_flight

    def collect(self, request_id: int, timeout_s: float | None = None) -> ClusterReply:
        """Wait for one request's answer (others arriving meanwhile are kept for later)."""
        return self.inbox.collect(request_id, timeout_s)

    def collect_any(self, timeout_s: float | None = None) -> ClusterReply | None:
        """The next answered request, in arrival order; None if none within ``timeout_s``.

        Raises the request's DataPlaneError (with its request_id) when it failed or
        outlived the pipeline's ``timeout_s``.
        """
        return self.inbox.collect_any(timeout_s)

    # -- stepping --------------------------------------------------------------------
    def step(self, stream_id: int, token_ids: np.ndarray, positions: np.ndarray,
             logits_idx: np.ndarray | None = None, want_logits: Want = False, *,
             top_k: int = 0, mask_tail: int = 0, one_query: bool = False) -> ClusterReply:
        """Run one step through every stage and wait for the answer (submit, then collect)."""
        request_id = self.submit(Step(stream_id, token_ids, positions, logits_idx, want_logits,
                                      mask_tail, one_query=one_query), top_k=top_k)
        return self.collect(request_id)

    def submit(self, step: Step, *, top_k: int = 0) -> int:
        """Run stage 0 for a step and send it on; returns the request id to collect.
        (See ``_submit``; a step computes under ``_busy``, which ``retire`` waits for.)"""
        with self._busy:
            return self._submit(step, top_k)

    def _submit(self, step: Step, top_k: int) -> int:
        """Run stage 0 for a step and send it on; returns the request id to collect.

        Its ``mask_tail`` rewinds that many kept tokens on every stage first; ``top_k`` > 1
        asks for the k best (token, log-probability) pairs, ``want_logits`` for logits (a
        payload of zctl.engine.payloads: full float32 or float16 logits, or top-k log-probability
        rows, which the reply's ``logits`` then holds as dense rows).
        On a row group (``regroup``) ids and positions are [rows, T], one row per member,
        ``mask_tail`` holds one rewind per row, and the reply answers every row (rows x
        positions), in member order. With ``row_tokens`` (paged stages) the rows are
        ragged: ids and positions hold row i's ``row_tokens[i]`` tokens after row i-1's,
        ``logits_idx`` indexes them all (None: every row's last), and the reply answers
        those positions in order. With ``guessed`` (not None; a stream's step, greedy) the
        frame carries the step's token ids so the last stage can check a guess: True, they
        were guessed on the previous step's answer (a pipelined run ahead); False, they
        were not, but a guessed step may follow this one. A ``one_query`` step is one on
        every stage (the frame's ONE_QUERY flag).
        """
        stream_id, mask_tail, row_tokens = step.stream_id, step.mask_tail, step.row_tokens
        stream = self._streams.get(stream_id)
        if stream is None:
            raise DataPlaneError(f"stream {stream_id} is not open")
        if stream.broken:
            raise DataPlaneError(f"stream {stream_id} must be reset: {stream.broken}")
        start_ns = time.time_ns()
        self.inbox.waiting_since = 0  # busy with stage 0: a reply arriving now waits in the queue
        group = self.stage0.groups.get(stream_id)
        rows = len(group.members) if group is not None else 1
        counts = EMPTY_INDEX if row_tokens is None else as_int64_vector(row_tokens)
        ids = as_int64_vector(step.token_ids).reshape(1 if counts.size else rows, -1)
        pos = as_int64_vector(step.positions)
        idx = check_logits_idx(step.logits_idx, ids.shape[1])
        row_rewinds = EMPTY_INDEX
        if group is not None:
            row_rewinds = as_int64_vector(mask_tail) if np.any(mask_tail) else EMPTY_INDEX
            mask_tail = 0
        elif stream.rewind:
            mask_tail, stream.rewind = int(mask_tail) + stream.rewind, 0
        self._guard.release(stream_id)
        rid = next(self._request_ids)
        want_logits = step.want_logits
        mode, top_k = reply_mode(want_logits, top_k)
        vocab = self.vocab_size if mode == ReplyMode.TOPK and want_logits else 0
        header = HiddenStateFrame(Kind.STEP, stream_id, rid, stream.epoch, stream.next_step, pos,
                                  idx, mode, top_k, int(mask_tail), 0, b"", "",
                                  rows=rows, row_rewinds=row_rewinds, row_tokens=counts,
                                  one_query=step.one_query)
        if step.guessed is not None and group is None and not counts.size:
            header.fed, header.guessed = ids[0], bool(step.guessed)
        t0 = time.perf_counter_ns()
        prepared = prepare_frame(header, (ids.shape[0], ids.shape[1], self.stage0.hidden_size),
                                 HIDDEN_DTYPE, 0, start_ns, start_ns)
        prepare_ns = time.perf_counter_ns() - t0
        t0 += prepare_ns
        try:
            # run here to the last stage: answer the positions asked (a verify step's all)
            answer_for = idx if idx.size and self.answers_here else None
            hidden = compute_step(self.stage0, stream_id, ids, pos, int(mask_tail), row_rewinds,
                                  answer_for, after_rewind=lambda: self._compact(stream_id),
                                  row_tokens=counts, one_query=step.one_query)
        except Exception as exc:
            if mask_tail or row_rewinds.size:
                stream.broken = stream.broken or f"stage 0 failed after a rewind ({exc})"
            raise
        t1 = time.perf_counter_ns()
        stream.next_step += 1
        if self.answers_here:
            return self.inbox.answer_here(header, hidden, top_k, vocab, (t1 - t0) / 1e6,
                                          start_ns)
        try:
            parts = seal_or_encode(prepared, header, hidden, 0, start_ns, start_ns, 0, t1 - t0,
                                   prepare_ns, t1)
            tracker = self._send(parts)
        except TransportError as exc:
            stream.broken = f"a step did not reach stage 1 ({exc})"
            raise StageUnreachable(f"stage 1 at {self.next_addr} is not taking frames: {exc}"
                                   ) from None
        self._guard.hold(stream_id, tracker)
        metrics = self.metrics
        metrics.sent_bytes += len(parts[0]) + hidden.nbytes
        metrics.step_frames += 1
        self.inbox.expect(rid, Pending(stream_id, stream.epoch, header.step, mode, top_k, vocab,
                                       start_ns, time.monotonic() + self.timeout_s))
        self.stats.submitted += 1
        return rid

    def abandon_all(self, why: str) -> None:
        """Forget every request in flight and every answer not yet collected, dissolve the
        row groups here, and make every stream need a reset (``why``): for when the chain
        is known to be broken (a stage's node is down). Late frames of the forgotten
        requests are dropped as stale; a stream's next reset, or a new GROUP frame, starts
        it afresh on every stage."""
        self.wirings += 1
        self.inbox.clear()
        if self._retired:  # stage 0 is another pipeline's now: nothing of it to dissolve
            return
        for group_id in list(self.stage0.groups):
            self.stage0.close_stream(group_id)
            self._streams.pop(group_id, None)
            self._guard.forget(group_id)
        for stream in self._streams.values():
            stream.broken = stream.broken or why

    def _mark_broken(self, stream_id: int, epoch: int, why: str) -> None:
        stream = self._streams.get(stream_id)
        if stream is not None and stream.epoch == epoch and not stream.broken:
            stream.broken = why

    # -- prefix entries (stage 0 here, a PREFIX frame down the chain) -------------------
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
            self._unsent_drops.add(entry_id)  # the stages after keep no old entry of the id
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
            self._unsent_drops.add(entry_id)
            self._flush_prefix_drops(strict=False)

    def drop_all_prefixes(self) -> None:
        """Free every entry on every stage; never raises (a broken chain gets it later)."""
        self.stage0.drop_all_prefixes()
        if self.prefix_cache_supported:
            self._unsent_drops.add_all()
            self._flush_prefix_drops(strict=False)

    def prefix_bytes(self) -> dict[int, int]:
        """Bytes of prefix entries held by the stages run here: stage 0's."""
        return {0: self.stage0.prefix_bytes()}

    def _flush_prefix_drops(self, strict: bool) -> None:
        """Send the drops not sent yet; ``strict``: raise DataPlaneError if any is left."""
        if not self._unsent_drops.flush(self._send_drop) and strict:
            raise StageUnreachable(f"stage 1 at {self.next_addr} is not taking frames: "
                                   "prefix drops are still to be sent")

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
        self.metrics.sent_bytes += frame_bytes(parts)
        return True


def as_int64_vector(values: Any) -> np.ndarray:
    """``values`` as a 1-D int64 array, without a copy (or a numpy call) when it is one."""
    if type(values) is np.ndarray and values.dtype is INT64 and values.ndim == 1:
        return values
    return np.asarray(values, dtype=np.int64).reshape(-1)


def check_logits_idx(logits_idx: np.ndarray | None, tokens: int) -> np.ndarray:
    """The logits indices to send (empty = the last token); ValueError if out of range."""
    if logits_idx is None:
        return EMPTY_INDEX
    idx = np.asarray(logits_idx, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= tokens):
        raise ValueError(f"logits_idx {idx.tolist()} out of range for {tokens} tokens")
    return idx
