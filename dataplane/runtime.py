"""StageRunner: one compiled stage shard and the KV state of every stream it serves.

Each stream owns an InferRequest (its own stateful KV) and a slot table: which
physical KV slots are still part of the sequence. A step appends ``tokens`` slots;
rewinding either masks slots (cheap, the slots stay) or trims the state tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import openvino as ov

from dataplane.manifest import ExportManifest, StageSpec, load_manifest, verify_export_files
from dataplane.masks import step_mask
from dataplane.rope import rope_tables
from dataplane.rows import RowSource, merge_rows, rows_step_mask

DEVICES = ("CPU", "GPU", "NPU", "AUTO")


_CORE: ov.Core | None = None


def shared_core() -> ov.Core:
    """One OpenVINO Core per process, so every stage here shares its plugins and executors."""
    global _CORE
    if _CORE is None:
        _CORE = ov.Core()
    return _CORE


class StageError(RuntimeError):
    """A stage cannot be loaded, or a step's inputs do not fit it."""


@dataclass(frozen=True)
class RuntimeConfig:
    """Explicit compile properties, so benchmarks compare like with like."""

    device: str = "CPU"
    precision: str | None = "f32"  # INFERENCE_PRECISION_HINT; None keeps the plugin default
    num_threads: int | None = None
    performance_hint: str = "LATENCY"
    kv_cache_precision: str | None = None  # e.g. "f32", "u8"; None keeps the plugin default

    # Not dataclass fields (controlplane.messages.RuntimeSpec mirrors the fields); a subclass
    # may override them, e.g. to benchmark other settings (tools/bench_parity does).
    # ENABLE_CPU_PINNING on CPU devices; None keeps the plugin default (YES on Linux), the
    # same as openvino_genai. With synchronous infer() pinning cost 2-10% per decode step on
    # 2 busy shared cores; with start_async()+wait() pinned and unpinned were within noise.
    cpu_pinning: ClassVar[bool | None] = None
    # Step with start_async() + wait(), so the plugin runs the graph on its own stream thread
    # (as openvino_genai's decode loop does), not a synchronous infer() on the calling
    # thread: 6% (1 stage) and 11% (2 stages) faster per decode step here, step-by-step
    # interleaved A/B on the same export, faster in every paired run.
    async_infer: ClassVar[bool] = True

    def properties(self) -> dict[str, Any]:
        props: dict[str, Any] = {"PERFORMANCE_HINT": self.performance_hint}
        if self.precision:
            props["INFERENCE_PRECISION_HINT"] = self.precision
        if self.num_threads:
            props["INFERENCE_NUM_THREADS"] = int(self.num_threads)
        if self.kv_cache_precision:
            props["KV_CACHE_PRECISION"] = self.kv_cache_precision
        if self.cpu_pinning is not None and self.device.split(":")[0].split(".")[0] == "CPU":
            props["ENABLE_CPU_PINNING"] = bool(self.cpu_pinning)
        return props


@dataclass
class StreamSlots:
    """Per-stream KV bookkeeping: keep[i] is False for masked (rewound) physical slots."""

    request: ov.InferRequest
    keep: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    @property
    def physical(self) -> int:
        return int(self.keep.shape[0])

    @property
    def logical(self) -> int:
        return int(self.keep.sum())


@dataclass
class RowGroup:
    """Streams stepped together as the rows of one request: ``members[r]`` is row r's
    stream id and ``keep[r]`` its slot table (rows share the slot count)."""

    request: ov.InferRequest
    members: list[int]
    keep: np.ndarray  # bool [rows, slots]


class StageRunner:
    """Loads stage ``index`` of an export and steps streams through it.

    Streams step alone (``step``) or, once moved into a row group (``regroup``), as the
    rows of one batched inference (``step_rows``).
    """

    def __init__(
        self,
        export_dir: Path | str,
        index: int,
        config: RuntimeConfig | None = None,
        manifest: ExportManifest | None = None,
        core: ov.Core | None = None,
        verify: bool = True,
    ) -> None:
        self.export_dir = Path(export_dir)
        self.manifest = manifest or load_manifest(self.export_dir, verify_files=False)
        if not 0 <= index < len(self.manifest.stages):
            raise StageError(
                f"stage {index} does not exist: the export has {len(self.manifest.stages)} stages"
            )
        self.spec: StageSpec = self.manifest.stages[index]
        self.config = config or RuntimeConfig()
        if self.config.device.split(":")[0].split(".")[0] not in DEVICES:
            raise StageError(f"unknown device {self.config.device!r}; expected one of {DEVICES}")
        if verify:
            verify_export_files(self.export_dir, self.manifest, [self.spec.xml, self.spec.bin])
        model = self.manifest.model
        self.inv_freq = np.asarray(model.rope_inv_freq, dtype=np.float32)
        self.rope_scaling = model.rope_attention_scaling
        self.hidden_size = model.hidden_size
        core = core or shared_core()
        try:
            self.compiled = core.compile_model(
                str(self.export_dir / self.spec.xml), self.config.device, self.config.properties()
            )
        except RuntimeError as exc:
            raise StageError(f"cannot compile stage {index} on {self.config.device}: {exc}") from None
        self.input_name = self.spec.inputs[0]
        self._has_beam_idx = any(p.get_any_name() == "beam_idx" for p in self.compiled.inputs)
        self._beam = np.zeros(1, dtype=np.int32)
        self.streams: dict[int, StreamSlots] = {}
        self.groups: dict[int, RowGroup] = {}

    def warm_up(self, stream_id: int = -1) -> None:
        """Run a prefill-shaped and a decode-shaped step on a scratch stream, then drop it,
        so the first real request does not pay the plugin's first-inference costs."""
        self.open_stream(stream_id)
        try:
            for positions in (np.arange(8), np.arange(8, 9)):
                shape = (1, len(positions))
                x = (np.zeros(shape, np.int64) if self.spec.first
                     else np.zeros((*shape, self.hidden_size), np.float32))
                self.step(stream_id, x, positions)
        finally:
            self.close_stream(stream_id)

    # -- streams ---------------------------------------------------------------------
    def open_stream(self, stream_id: int) -> StreamSlots:
        if stream_id not in self.streams:
            self.streams[stream_id] = StreamSlots(self.compiled.create_infer_request())
        return self.streams[stream_id]

    def reset_stream(self, stream_id: int) -> None:
        slots = self.open_stream(stream_id)
        slots.request.reset_state()
        slots.keep = np.zeros(0, dtype=bool)

    def close_stream(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)
        self.groups.pop(stream_id, None)

    def _stream(self, stream_id: int) -> StreamSlots:
        slots = self.streams.get(stream_id)
        if slots is None:
            raise StageError(f"stream {stream_id} is not open on stage {self.spec.index}")
        return slots

    # -- stepping --------------------------------------------------------------------
    def check_input(self, x: np.ndarray, positions: np.ndarray) -> None:
        """Raise StageError unless x and positions have the shapes this stage takes."""
        if self.spec.first:
            if x.ndim != 2 or not np.issubdtype(x.dtype, np.integer):
                raise StageError(f"stage 0 takes int token ids [batch, tokens], got {x.dtype} {x.shape}")
        elif x.ndim != 3 or x.shape[2] != self.hidden_size or x.dtype != np.float32:
            raise StageError(
                f"stage {self.spec.index} takes float32 hidden states [batch, tokens, "
                f"{self.hidden_size}], got {x.dtype} {x.shape}"
            )
        if x.shape[0] != 1 or x.shape[1] < 1:
            raise StageError(f"a stream step takes batch 1 and at least one token, got {x.shape}")
        if positions.shape != (x.shape[1],):
            raise StageError(f"positions shape {positions.shape} does not match {x.shape[1]} tokens")

    def step(
        self,
        stream_id: int,
        x: np.ndarray,
        positions: np.ndarray,
        logits_idx: np.ndarray | None = None,
    ) -> np.ndarray:
        """Run one step for a stream; returns hidden states [1, T, H] or logits [1, K, V].

        ``positions`` are logical (RoPE) positions of the T new tokens; ``logits_idx``
        picks which of them get logits on the last stage (default: the last one).
        The returned array is a view into the request's output: copy it to keep it.
        """
        slots = self._stream(stream_id)
        positions = np.asarray(positions, dtype=np.int64)
        self.check_input(x, positions)
        tokens = x.shape[1]
        out = self._infer(slots.request, x, positions[None], step_mask(slots.keep, tokens),
                          self._beam, logits_idx)
        slots.keep = np.concatenate((slots.keep, np.ones(tokens, dtype=bool)))
        return out

    def _infer(self, request: ov.InferRequest, x: np.ndarray, positions: np.ndarray,
               mask: np.ndarray, beam: np.ndarray, logits_idx: np.ndarray | None) -> np.ndarray:
        """Feed one step ([rows, T] positions) to ``request``; returns a view of its output."""
        tokens = x.shape[1]
        cos, sin = rope_tables(positions, self.inv_freq, self.rope_scaling)
        feed: dict[str, np.ndarray] = {
            self.input_name: x if not self.spec.first else x.astype(np.int64, copy=False),
            "attention_mask": mask,
            "rope_cos": cos,
            "rope_sin": sin,
        }
        if self._has_beam_idx:
            feed["beam_idx"] = beam
        elif beam.size > 1:
            raise StageError("this export has no beam_idx input: it cannot step row groups")
        if self.spec.last:
            idx = np.array([tokens - 1]) if logits_idx is None else np.asarray(logits_idx)
            if idx.ndim != 1 or idx.size == 0 or idx.min() < 0 or idx.max() >= tokens:
                raise StageError(f"logits_idx {idx.tolist()} out of range for {tokens} tokens")
            feed["logits_idx"] = idx.astype(np.int64, copy=False)
        if self.config.async_infer:
            request.start_async(feed, share_inputs=True)
            request.wait()
        else:
            request.infer(feed, share_inputs=True, share_outputs=True)
        return request.get_output_tensor(0).data

    # -- rewind ----------------------------------------------------------------------
    def mask_tail(self, stream_id: int, count: int) -> None:
        """Mask-based rewind: drop the last ``count`` *kept* slots from attention."""
        slots = self._stream(stream_id)
        kept = np.flatnonzero(slots.keep)
        if count < 0 or count > kept.size:
            raise StageError(f"cannot rewind {count} tokens of a {kept.size}-token stream")
        if count:
            slots.keep = slots.keep.copy()
            slots.keep[kept[kept.size - count:]] = False

    def trim_tail(self, stream_id: int, count: int) -> None:
        """Trim-based rewind: cut the last ``count`` physical slots out of every state tensor."""
        slots = self._stream(stream_id)
        if count < 0 or count > slots.physical:
            raise StageError(f"cannot trim {count} slots of a {slots.physical}-slot stream")
        if not count:
            return
        keep_len = slots.physical - count
        for state in slots.request.query_state():
            data = state.state.data
            state.state = ov.Tensor(np.ascontiguousarray(data[:, :, :keep_len, :]))
        slots.keep = slots.keep[:keep_len].copy()

    def compact(self, stream_id: int) -> int:
        """Physically drop masked slots from the state; returns how many were removed."""
        slots = self._stream(stream_id)
        masked = int((~slots.keep).sum())
        if not masked:
            return 0
        for state in slots.request.query_state():
            data = state.state.data
            state.state = ov.Tensor(np.ascontiguousarray(data[:, :, slots.keep, :]))
        slots.keep = np.ones(slots.logical, dtype=bool)
        return masked

    # -- row groups ------------------------------------------------------------------
    def regroup(self, group_id: int, members: list[int]) -> None:
        """Make ``group_id`` the row group of ``members``, in that row order.

        A member already in the group keeps its KV row; any other member must be an open
        stream, whose KV moves into a row (the stream is closed). Rows not listed any more
        are dropped; no members disbands the group. Slots are compacted while copying.
        On error nothing changes.
        """
        old = self.groups.get(group_id)
        if group_id in self.streams:
            raise StageError(f"{group_id} is a stream, not a row group")
        if len(set(members)) != len(members):
            raise StageError(f"a row group lists a stream twice: {members}")
        if not members:
            self.groups.pop(group_id, None)
            return
        old_states = _states(old.request) if old is not None else {}
        sources = []
        for sid in members:
            if old is not None and sid in old.members:
                row = old.members.index(sid)
                sources.append(RowSource(old_states, row, old.keep[row]))
                continue
            slots = self.streams.get(sid)
            if slots is None:
                raise StageError(f"stream {sid} is not open on stage {self.spec.index}: it "
                                 f"cannot join row group {group_id}")
            sources.append(RowSource(_states(slots.request), 0, slots.keep))
        try:
            merged, keep = merge_rows(sources)
        except ValueError as exc:
            raise StageError(f"cannot form row group {group_id}: {exc}") from None
        request = old.request if old is not None else self.compiled.create_infer_request()
        for state in request.query_state():
            state.state = ov.Tensor(merged[state.name])
        self.groups[group_id] = RowGroup(request, list(members), keep)
        for sid in members:
            self.streams.pop(sid, None)

    def step_rows(
        self,
        group_id: int,
        x: np.ndarray,
        positions: np.ndarray,
        logits_idx: np.ndarray | None = None,
    ) -> np.ndarray:
        """One step of every row of a group: x [rows, T] ids or [rows, T, H] hidden states,
        ``positions`` [rows, T]; returns [rows, T, H] or logits [rows, K, V] (a view)."""
        group = self.groups.get(group_id)
        if group is None:
            raise StageError(f"row group {group_id} does not exist on stage {self.spec.index}")
        rows = len(group.members)
        positions = np.asarray(positions, dtype=np.int64)
        if x.ndim < 2 or x.shape[0] != rows or positions.shape != x.shape[:2]:
            raise StageError(f"row group {group_id} has {rows} rows: it takes x [{rows}, T, ...] "
                             f"and positions [{rows}, T], got {x.shape} and {positions.shape}")
        self.check_input(x[:1], positions[0])
        tokens = x.shape[1]
        out = self._infer(group.request, x, positions, rows_step_mask(group.keep, tokens),
                          np.arange(rows, dtype=np.int32), logits_idx)
        group.keep = np.concatenate((group.keep, np.ones((rows, tokens), dtype=bool)), axis=1)
        return out


def _states(request: ov.InferRequest) -> dict[str, np.ndarray]:
    """A request's KV state tensors by variable name (views, valid until its next step)."""
    return {state.name: state.state.data for state in request.query_state()}
