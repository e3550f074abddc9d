"""StageRunner: one compiled stage shard and the KV state of every stream it serves.

Each stream owns an InferRequest (its own stateful KV) and a slot table: which
physical KV slots are still part of the sequence. A step appends ``tokens`` slots;
rewinding either masks slots (cheap, the slots stay) or trims the state tensors. On a
stage whose sliding-window layers' states may be trimmed (an export stating
``sliding_kv_trimmable``), those states keep only the last slots of the table: the window
and a margin (dataplane.runtime.kv.sliding_states).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import openvino as ov

from dataplane.runtime import rewind
from dataplane.runtime.base import (
    StageError,
    check_row_rewinds,
    check_rows_step,
    check_step_input,
    one_query_needs_paged_attention,
    ragged_needs_paged_attention,
)
from dataplane.runtime.config import RuntimeSpec, device_kind
from dataplane.runtime.hugepages import HugePageScope
from dataplane.runtime.kv.masks import MASK_MIN, drop_kept_tail, one_token_mask, step_mask
from dataplane.runtime.kv.prefix_entries import PrefixEntries
from dataplane.runtime.kv.rows import RowSource, find_row, merge_rows, rows_step_mask
from dataplane.runtime.kv.sliding_states import SlidingStates, merge_rows_right, trimmed
from dataplane.runtime.kv.slots import (
    DecodeBuffers,
    RowGroup,
    StepInputs,
    StepOutput,
    StreamSlots,
    request_states,
)
from dataplane.runtime.kv.slots import shared_tensor as _shared
from dataplane.runtime.ov_core import shared_core
from dataplane.runtime.rope import LongSequences, StageRopeRows, stage_rope
from dataplane.runtime.startup import int4_group, open_stage, warm_up_steps
from zctl.manifest import ExportManifest, verify_export_files


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


class StageRunner:
    """Loads stage ``index`` of an export and steps streams through it.

    Streams step alone (``step``) or, once moved into a row group (``regroup``), as the
    rows of one batched inference (``step_rows``); rewinds mask slots (``mask_tail``) or trim
    the state (``trim_tail``). Its prefix entries (``prefixes``: a
    dataplane.runtime.kv.prefix_entries.PrefixEntries) keep KV for streams that start alike.
    A ``StageRuntime``.
    """

    # One-row decode steps write their inputs into per-stream DecodeBuffers bound once,
    # rather than binding fresh tensors (bit-identical; off only to test that).
    decode_buffers: ClassVar[bool] = True
    row_groups_supported: ClassVar[bool] = True  # (a static export's runner: False)
    prefix_cache_supported: ClassVar[bool] = True
    paged_attention: ClassVar[bool] = False  # KV as OpenVINO state (PagedStageRunner: True)
    # A step's tokens are one sequence of the stateful attention: a verification step
    # computes its tokens together (multi-query), never as single decode steps would
    one_query_supported: ClassVar[bool] = False

    def __init__(
        self,
        export_dir: Path | str,
        index: int,
        config: RuntimeSpec | None = None,
        manifest: ExportManifest | None = None,
        core: ov.Core | None = None,
        verify: bool = True,
        graph: ov.Model | None = None,
    ) -> None:
        """``graph``: the stage's stateful model in memory, in place of the export's xml
        (a node's profile runs a synthetic stage so: dataplane.runtime.synthetic)."""
        self.export_dir = Path(export_dir)
        self.manifest, self.spec, self.config = open_stage(self.export_dir, index, config,
                                                           manifest, static=False)
        if device_kind(self.config) == "NPU":
            raise StageError("the NPU compiles only static shapes without state: export the "
                             "model with `zctl export --static` for it")
        if verify and graph is None:
            verify_export_files(self.export_dir, self.manifest, [self.spec.xml, self.spec.bin])
        model = self.manifest.model
        self.rope = stage_rope(model)
        self._last_token_idx: dict[int, ov.Tensor] = {}  # logits_idx [T - 1] by T
        self._rope_rows = StageRopeRows(self.rope)
        self.long_sequences = LongSequences(self.rope, index)  # LongRoPE's long streams
        self.hidden_size = model.hidden_size
        core = core or shared_core()
        try:
            with HugePageScope() as pages:  # the weights the plugin repacks: huge pages
                self.compiled = core.compile_model(
                    graph or str(self.export_dir / self.spec.xml), self.config.device,
                    self.config.properties(int4_group(self.manifest)))
        except RuntimeError as exc:
            raise StageError(f"cannot compile stage {index} on {self.config.device}: {exc}") from None
        self.huge_page_bytes = pages.collapsed
        self.input_name = self.spec.inputs[0]
        output = self.compiled.outputs[0]
        last_dim = output.get_partial_shape()[-1]
        # [rows, T, H] hidden states or [rows, K, V] logits: bound as a StepOutput
        self._output_dim = last_dim.get_length() if last_dim.is_static else None
        self._output_type = output.get_element_type()
        self._has_beam_idx = any(p.get_any_name() == "beam_idx" for p in self.compiled.inputs)
        self._beam = np.zeros(1, dtype=np.int32)
        self._beam_tensor = _shared(self._beam)  # read-only, bound to every one-row step
        self.streams: dict[int, StreamSlots] = {}
        self.groups: dict[int, RowGroup] = {}
        # what one token's KV costs here, in the cache precision compiled (an int, bytes)
        self.kv_bytes_per_token = kv_bytes_per_token(self.compiled, self.spec.num_layers,
                                                     model.num_kv_heads, model.head_dim)
        # the sliding layers' states, trimmed to their window and margin (None: every
        # state keeps every slot: no sliding layer here, or an export whose graph cannot)
        self.sliding = (SlidingStates.of_stage(
            self.spec.state_names, model.sliding_layers, model.sliding_window,
            self.config.sliding_margin, self.config.sliding_slack)
            if model.sliding_kv_trimmable else None)
        # what a stream's held slots (status) leave out for the slots its sliding states dropped
        self._sliding_share = (0.0 if self.sliding is None
                               else len(self.sliding.layers) / self.spec.num_layers)
        self.prefixes = PrefixEntries(self.streams, self.groups, self.spec.index,
                                      self.kv_bytes_per_token, self.sliding)

    def warm_up(self, stream_id: int = -1) -> None:
        """Run a prefill-shaped and a decode-shaped step on a scratch stream, then drop it,
        so the first real request does not pay the plugin's first-inference costs."""
        warm_up_steps(self, stream_id)

    # -- streams ---------------------------------------------------------------------
    def open_stream(self, stream_id: int) -> StreamSlots:
        if stream_id not in self.streams:
            self.streams[stream_id] = StreamSlots(self.compiled.create_infer_request(),
                                                  sliding_share=self._sliding_share)
        return self.streams[stream_id]

    def reset_stream(self, stream_id: int, long_rope: bool = False) -> None:
        self.long_sequences.begin(stream_id, long_rope)
        slots = self.open_stream(stream_id)
        slots.request.reset_state()
        slots.keep = np.zeros(0, dtype=bool)
        slots.sliding_start = slots.sliding_gone = 0

    def close_stream(self, stream_id: int) -> None:
        self.long_sequences.forget(stream_id)
        self.streams.pop(stream_id, None)
        self.groups.pop(stream_id, None)

    def stream(self, stream_id: int) -> StreamSlots:
        """The stream\'s KV bookkeeping; StageError unless it is open here (stepped alone)."""
        slots = self.streams.get(stream_id)
        if slots is None:
            raise StageError(f"stream {stream_id} is not open on stage {self.spec.index}")
        return slots

    # -- stepping --------------------------------------------------------------------
    def check_input(self, x: np.ndarray, positions: np.ndarray) -> None:
        """Raise StageError unless x and positions have the shapes this stage takes."""
        check_step_input(self.spec, self.hidden_size, x, positions)

    def step(
        self,
        stream_id: int,
        x: np.ndarray,
        positions: np.ndarray,
        logits_idx: np.ndarray | None = None,
        one_query: bool = False,
    ) -> np.ndarray:
        """Run one step for a stream; returns hidden states [1, T, H] or logits [1, K, V].

        ``positions`` are logical (RoPE) positions of the T new tokens; ``logits_idx``
        picks which of them get logits on the last stage (default: the last one).
        The returned array is a view into the request's output: copy it to keep it.
        A one-query step needs paged attention: StageError.
        """
        slots = self.stream(stream_id)
        positions = np.asarray(positions, dtype=np.int64)
        self.check_input(x, positions)
        inputs = self.prepare(stream_id, positions[None], logits_idx, one_query=one_query)
        return self._output_data(slots, self.run(stream_id, x, inputs), 1, positions.shape[0],
                                 logits_idx)

    def prepare(
        self,
        stream_id: int,
        positions: np.ndarray,
        logits_idx: np.ndarray | None = None,
        inputs: StepInputs | None = None,
        row_tokens: np.ndarray | None = None,
        one_query: bool = False,
    ) -> StepInputs:
        """Bind every input of a stream's (or row group's) next step but x to its request.

        ``positions`` are [rows, T] (one row for a stream). ``inputs`` from an earlier
        stage of a chain are reused when they were built for the same positions and slot
        table (the usual case: a chain keeps its stages' tables in sync), else rebuilt.
        Returns the inputs bound, for ``run`` and the next stage. Ragged rows
        (``row_tokens``) and one-query steps need paged attention: StageError.
        """
        if row_tokens is not None:
            raise ragged_needs_paged_attention()
        if one_query:
            raise one_query_needs_paged_attention()
        target = self._target(stream_id)
        positions = np.asarray(positions, dtype=np.int64)
        ahead, target.prefetched = target.prefetched, None
        if (ahead is not None and inputs is None and logits_idx is None
                and ahead.keep is target.keep and positions.shape == ahead.positions.shape
                and (int(positions[0, 0]) == int(ahead.positions[0, 0]) if positions.size == 1
                     else np.array_equal(positions, ahead.positions))):
            return ahead  # bound while the stage was idle (see prefetch)
        if inputs is None or not inputs.fits(positions, target.keep):
            inputs = self._step_inputs(positions, target.keep, target, self._long_rows(stream_id))
        self._bind(target, inputs, logits_idx)
        return inputs

    def prefetch(self, stream_id: int) -> bool:
        """Bind a stream's likely next step (one token at the next position) while the
        stage is idle: built right after an inference, with cold caches, on the critical
        path, inputs cost several times more. A ``prepare`` of exactly that step only
        checks the guess; any other step binds its own. A row group's guess is every row's
        next position. Returns whether it bound anything (not before a first step)."""
        target = self.groups.get(stream_id) or self.streams.get(stream_id)
        if target is None or target.last is None or target.prefetched is not None:
            return False
        inputs = self._step_inputs(target.last.positions[:, -1:] + 1, target.keep, target,
                                   self._long_rows(stream_id))
        self._bind(target, inputs, None)
        target.prefetched = inputs
        return True

    def _bind(self, target: StreamSlots | RowGroup, inputs: StepInputs,
              logits_idx: np.ndarray | None) -> None:
        """Bind ``inputs`` (and the last stage's logits_idx) to the target's request; a
        tensor already bound (the decode buffers, shared read-only ones) is not bound again."""
        rows, tokens = inputs.positions.shape
        if not self._has_beam_idx and rows > 1:
            raise StageError("this export has no beam_idx input: it cannot step row groups")
        bound = target.bound
        self._bind_one(target, "attention_mask", inputs.attention_mask)
        self._bind_one(target, "rope_cos", inputs.rope_cos)
        self._bind_one(target, "rope_sin", inputs.rope_sin)
        if self._has_beam_idx:
            self._bind_one(target, "beam_idx", inputs.beam_idx)
        bound["inputs"] = inputs  # keeps any numpy memory under its tensors alive
        if self.spec.last:
            if logits_idx is None:  # the last token: one read-only tensor per T, shared
                idx_tensor = self._last_token_idx.get(tokens)
                if idx_tensor is None:
                    idx_tensor = _shared(np.array([tokens - 1], dtype=np.int64))
                    self._last_token_idx[tokens] = idx_tensor
            else:
                idx = np.asarray(logits_idx)
                if idx.ndim != 1 or idx.size == 0 or idx.min() < 0 or idx.max() >= tokens:
                    raise StageError(f"logits_idx {idx.tolist()} out of range for {tokens} tokens")
                idx_tensor = _shared(idx.astype(np.int64, copy=False))
            self._bind_one(target, "logits_idx", idx_tensor)

    @staticmethod
    def _bind_one(target: StreamSlots | RowGroup, name: str, tensor: ov.Tensor) -> None:
        if target.bound.get(name) is not tensor:
            target.request.set_tensor(name, tensor)
            target.bound[name] = tensor

    def run(self, stream_id: int, x: np.ndarray | ov.Tensor, inputs: StepInputs) -> ov.Tensor:
        """Run the step ``prepare`` bound, on x: token ids [rows, T], hidden states
        [rows, T, H], or the previous stage's output tensor as it is (no copy).

        Appends the T slots to the slot table(s); returns the output tensor, which the
        request reuses: it is valid until the stream's next step.
        """
        target = self._target(stream_id)
        request = target.request
        if isinstance(x, np.ndarray):
            self.check_input(x[:1], inputs.positions[0])
            dims = x.shape
            if self.spec.first:
                x = x.astype(np.int64, copy=False)
            buffers = target.decode
            x = (buffers.input_from(x) if buffers is not None and dims[:2] == (1, 1)
                 and x.dtype in (np.int64, np.float32) else _shared(x))
        else:
            dims = x.shape  # an ov.Shape: index it (iterating one costs ~0.1 ms on this path)
        if (dims[0], dims[1]) != inputs.positions.shape:
            raise StageError(f"x {list(dims)} does not match positions {inputs.positions.shape}")
        self._bind_one(target, self.input_name, x)
        output = target.output
        if output is None and self.decode_buffers and self._output_dim is not None:
            output = target.output = StepOutput(self._output_type, self._output_dim)
            request.set_output_tensor(0, output.tensor)
        if self.config.async_infer:
            request.start_async()
            request.wait()
        else:
            request.infer(share_outputs=True)
        target.keep, target.last = inputs.after, inputs
        if self.sliding is not None:
            self._slide(target)
        return output.tensor if output is not None else request.get_output_tensor(0)

    def _slide(self, target: StreamSlots | RowGroup) -> None:
        """Trim the sliding layers' states of ``target`` to its window and margin, once
        their slack is used up (kv.sliding_states.SlidingStates.start_after)."""
        assert self.sliding is not None
        start = self.sliding.start_after(target.keep, target.sliding_start)
        if start == target.sliding_start:
            return
        drop = start - target.sliding_start
        for state in target.request.query_state():
            if self.sliding.is_sliding(state.name):
                state.state = ov.Tensor(trimmed(state.state.data, drop))
        if isinstance(target, RowGroup):
            gone = target.sliding_gone if target.sliding_gone is not None else 0
            target.sliding_gone = self.sliding.gone_after(target.keep, start, gone)
        else:
            target.sliding_gone = self.sliding.gone_after(target.keep, start,
                                                          target.sliding_gone)
        target.sliding_start = start

    def _target(self, stream_id: int) -> StreamSlots | RowGroup:
        """The row group ``stream_id``, else the stream."""
        group = self.groups.get(stream_id)
        return group if group is not None else self.stream(stream_id)

    def _long_rows(self, stream_id: int) -> np.ndarray | None:
        """Which rows of the stream's (or row group's) steps turn long throughout (None:
        none), from what their resets said (LongSequences)."""
        group = self.groups.get(stream_id)
        return self.long_sequences.rows(group.members if group is not None else [stream_id])

    def _step_inputs(self, positions: np.ndarray, keep: np.ndarray,
                     target: StreamSlots | RowGroup | None = None,
                     long_rows: np.ndarray | None = None) -> StepInputs:
        """RoPE tables and attention mask of a [rows, T] step over slot table(s) ``keep``
        (``long_rows``: the rows long throughout, StageRope.tables); a one-row decode step
        of ``target`` writes them into its DecodeBuffers."""
        long_row = long_rows is not None and bool(long_rows[0])
        rows, tokens = positions.shape
        if tokens == 1:  # a decode step (one token per row): the few-call path
            if keep.ndim == 1:  # np.append's wrappers cost ~50 us here, cold
                after = np.empty(keep.shape[0] + 1, dtype=bool)
                after[:-1] = keep
                after[-1] = True
            else:
                after = np.concatenate((keep, np.ones((rows, 1), dtype=bool)), axis=1)
            if rows == 1 and target is not None and self.decode_buffers:
                buffers = target.decode
                if buffers is None:
                    buffers = target.decode = DecodeBuffers(self.rope.width)
                self._rope_rows.into(int(positions[0, 0]), buffers.cos, buffers.sin, long_row)
                return StepInputs(positions, keep, after, buffers.mask_after(keep, after, MASK_MIN),
                                  buffers.rope_cos, buffers.rope_sin, self._beam_tensor)
            if rows == 1:
                cos, sin = self._rope_rows.one(int(positions[0, 0]), long_row)
            else:
                cos, sin = self.rope.tables(positions, long_rows=long_rows)
            beam = self._beam if rows == 1 else np.arange(rows, dtype=np.int32)
            return StepInputs(positions, keep, after, _shared(one_token_mask(after)),
                              _shared(cos), _shared(sin), _shared(beam))
        cos, sin = self.rope.tables(positions, long_rows=long_rows)
        mask = rows_step_mask(keep, tokens) if keep.ndim == 2 else step_mask(keep, tokens)
        beam = self._beam if rows == 1 else np.arange(rows, dtype=np.int32)
        new = np.ones((rows, tokens) if keep.ndim == 2 else tokens, dtype=bool)
        after = np.concatenate((keep, new), axis=keep.ndim - 1)
        return StepInputs(positions, keep, after, _shared(mask), _shared(cos), _shared(sin),
                          _shared(beam))

    # -- rewinds: by mask, or by trimming the state -------------------------------------
    mask_step_tail = rewind.mask_step_tail
    truncate = rewind.truncate
    compaction_due = rewind.compaction_due
    kept_tokens = rewind.kept_tokens

    def mask_tail(self, stream_id: int, count: int) -> None:
        """Mask-based rewind: drop the stream's last ``count`` *kept* slots from attention
        (StageError if it keeps fewer, or if its sliding layers lack the keys the query
        after them sees: the stream is then unchanged)."""
        slots = self.stream(stream_id)
        try:
            keep = drop_kept_tail(slots.keep, count)
        except ValueError as exc:
            raise StageError(str(exc)) from None
        self._check_window(slots.sliding_gone, int(keep.sum()), count)
        slots.keep = keep

    def _check_window(self, gone: int, logical: int, count: int) -> None:
        """StageError when a stream (or a row) rewound by ``count`` tokens to ``logical``
        lacks keys its next query sees: its sliding states lack its first ``gone``."""
        if self.sliding is not None and count and self.sliding.refuses(logical, gone):
            raise StageError(self.sliding.refusal(self.spec.index, count, logical + count))

    def trim_tail(self, stream_id: int, count: int) -> None:
        """Trim-based rewind: cut the last ``count`` physical slots out of every state tensor
        (StageError, the stream unchanged, when its sliding layers would lack keys)."""
        slots = self.stream(stream_id)
        if count < 0 or count > slots.physical:
            raise StageError(f"cannot trim {count} slots of a {slots.physical}-slot stream")
        if not count:
            return
        keep_len = slots.physical - count
        keep = slots.keep[:keep_len].copy()
        self._check_window(slots.sliding_gone, int(keep.sum()),
                           int(slots.keep[keep_len:].sum()))
        start = min(slots.sliding_start, keep_len)  # a sliding state holds [start, keep_len)
        for state in slots.request.query_state():
            held = keep_len - start if self._slides(state.name) else keep_len
            state.state = ov.Tensor(np.ascontiguousarray(state.state.data[:, :, :held]))
        slots.keep, slots.sliding_start = keep, start

    def _slides(self, name: str) -> bool:
        """Whether state ``name`` is a sliding layer's, trimmed from the front."""
        return self.sliding is not None and self.sliding.is_sliding(name)

    def compact(self, stream_id: int) -> int:
        """Physically drop masked slots from the state; returns how many were removed."""
        slots = self.stream(stream_id)
        masked = int((~slots.keep).sum())
        if not masked:
            return 0
        start = slots.sliding_start
        for state in slots.request.query_state():
            data = state.state.data
            kept = slots.keep[start:] if self._slides(state.name) else slots.keep
            state.state = ov.Tensor(np.ascontiguousarray(data[:, :, kept, :]))
        slots.sliding_start = int(slots.keep[:start].sum())
        slots.keep = np.ones(slots.logical, dtype=bool)
        return masked

    # -- row groups ------------------------------------------------------------------
    def regroup(self, group_id: int, members: list[int]) -> None:
        """Make ``group_id`` the row group of ``members``, in that row order.

        A member already in the group keeps its KV row; any other member must be an open
        stream, whose KV moves into a row (the stream is closed). Rows not listed any more
        are dropped; no members disbands the group. Slots are compacted while copying (on
        a stage whose sliding states are trimmed, every row ends at the last slot, so the
        rows' windows share the last slots: kv.sliding_states.merge_rows_right). On error
        nothing changes.
        """
        old = self.groups.get(group_id)
        if group_id in self.streams:
            raise StageError(f"{group_id} is a stream, not a row group")
        if len(set(members)) != len(members):
            raise StageError(f"a row group lists a stream twice: {members}")
        if not members:
            self.groups.pop(group_id, None)
            return
        old_states = request_states(old.request) if old is not None else {}
        sources = []
        for sid in members:
            if old is not None and sid in old.members:
                row = old.members.index(sid)
                gone = old.sliding_gone[row] if old.sliding_gone is not None else 0
                sources.append(RowSource(old_states, row, old.keep[row], old.sliding_start,
                                         int(gone)))
                continue
            slots = self.streams.get(sid)
            if slots is None:
                raise StageError(f"stream {sid} is not open on stage {self.spec.index}: it "
                                 f"cannot join row group {group_id}")
            sources.append(RowSource(request_states(slots.request), 0, slots.keep,
                                     slots.sliding_start, slots.sliding_gone))
        try:
            if self.sliding is None:
                merged, keep = merge_rows(sources)
                start, gone = 0, None
            else:
                rows = merge_rows_right(sources, self.sliding)
                merged, keep, start, gone = (rows.states, rows.keep, rows.sliding_start,
                                             rows.sliding_gone)
        except ValueError as exc:
            raise StageError(f"cannot form row group {group_id}: {exc}") from None
        request = old.request if old is not None else self.compiled.create_infer_request()
        for state in request.query_state():
            state.state = ov.Tensor(merged[state.name])
        self.groups[group_id] = RowGroup(request, list(members), keep, start, gone,
                                         sliding_share=self._sliding_share)
        for sid in members:
            self.streams.pop(sid, None)

    def mask_rows_tail(self, group_id: int, counts: np.ndarray) -> None:
        """Mask-based rewind per row: drop each row's last ``counts[row]`` kept slots."""
        group = self.groups.get(group_id)
        if group is None:
            raise StageError(f"row group {group_id} does not exist on stage {self.spec.index}")
        kept = [np.flatnonzero(row) for row in group.keep]
        counts = check_row_rewinds(group_id, counts, [k.size for k in kept])
        if group.sliding_gone is not None:  # every row checked before any is rewound
            for count, k, gone in zip(counts, kept, group.sliding_gone, strict=True):
                self._check_window(int(gone), k.size - int(count), int(count))
        keep = group.keep.copy()
        for row, (count, k) in enumerate(zip(counts, kept, strict=True)):
            if count:
                keep[row, k[k.size - count:]] = False
        group.keep = keep

    def row_of(self, stream_id: int) -> tuple[int, int] | None:
        """(group id, row) of the row group ``stream_id`` is a row of here, if any."""
        return find_row(self.groups, stream_id)

    def masked_slots(self, stream_id: int) -> int:
        """Masked slots of a stream, or of a row group's fullest row's padding and rewinds
        (what compaction would free)."""
        group = self.groups.get(stream_id)
        if group is not None:
            return int(group.keep.shape[1] - group.keep.sum(axis=1).max(initial=0))
        slots = self.stream(stream_id)
        return slots.physical - slots.logical

    def step_rows(
        self,
        group_id: int,
        x: np.ndarray,
        positions: np.ndarray,
        logits_idx: np.ndarray | None = None,
        one_query: bool = False,
    ) -> np.ndarray:
        """One step of every row of a group: x [rows, T] ids or [rows, T, H] hidden states,
        ``positions`` [rows, T]; returns [rows, T, H] or logits [rows, K, V] (a view)."""
        group = self.groups.get(group_id)
        if group is None:
            raise StageError(f"row group {group_id} does not exist on stage {self.spec.index}")
        rows = len(group.members)
        positions = np.asarray(positions, dtype=np.int64)
        check_rows_step(group_id, rows, x, positions)
        inputs = self.prepare(group_id, positions, logits_idx, one_query=one_query)
        return self._output_data(group, self.run(group_id, x, inputs), rows, positions.shape[1],
                                 logits_idx)

    def _output_data(self, target: StreamSlots | RowGroup, tensor: ov.Tensor, rows: int,
                     tokens: int, logits_idx: np.ndarray | None) -> np.ndarray:
        """A step's output as numpy: [rows, T, H], or logits [rows, K, V] for the K
        positions of ``logits_idx`` (default: the last token)."""
        output = target.output
        if output is None or tensor is not output.tensor:
            return tensor.data
        answers = (1 if logits_idx is None else len(logits_idx)) if self.spec.last else tokens
        return output.view((rows, answers, output.tensor_dim))

    def step_ragged(self, group_id: int, x: np.ndarray, positions: np.ndarray,
                    row_tokens: np.ndarray, logits_idx: np.ndarray | None = None,
                    one_query: bool = False) -> np.ndarray:
        """Rows of different token counts need paged attention: StageError."""
        raise ragged_needs_paged_attention()

    # -- prefix entries (self.prefixes) --------------------------------------------------
    def save_prefix(self, stream_id: int, entry_id: int, length: int, take: bool = False) -> None:
        """Keep the stream's (or a row's) first ``length`` logical KV slots as entry
        ``entry_id`` (PrefixEntries.save)."""
        self.prefixes.save(stream_id, entry_id, length, take)

    def load_prefix(self, stream_id: int, entry_id: int, length: int, take: bool = False) -> None:
        """Make entry ``entry_id``'s first ``length`` tokens the stream's KV
        (PrefixEntries.load)."""
        self.prefixes.load(stream_id, entry_id, length, take)

    def drop_prefix(self, entry_id: int) -> None:
        """Free entry ``entry_id`` (an unknown id is no error)."""
        self.prefixes.drop(entry_id)

    def drop_all_prefixes(self) -> None:
        self.prefixes.drop_all()

    def prefix_bytes(self) -> int:
        """Bytes of the prefix entries held here (any thread)."""
        return self.prefixes.nbytes()
