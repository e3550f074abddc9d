"""StaticStageRunner: a static, stateless stage shard (the NPU path), its KV on the host.

An NPU compiles only static shapes and no state. A static export (``zctl export
--static``) takes the past KV as inputs and returns only the new tokens' KV; this
runner compiles it at two fixed shapes, one token (decode) and ``chunk`` tokens
(prefill chunks, verification: shorter steps are padded, longer ones run chunk by
chunk), and keeps every stream's KV in host buffers of ``context`` slots, bound once
to the stream's requests. A slot table marks which filled slots belong to the
sequence, so rewinds work as on the stateful StageRunner: masking zeroes slots in the
attention mask, trimming only moves the fill point back, compaction copies the kept
slots to the front. Same interface as StageRunner, but row groups (streams batched as
rows of one inference) need the stateful export.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import openvino as ov

from dataplane.runtime import rewind
from dataplane.runtime.base import (
    RowGroupKV,
    StageError,
    check_step_input,
    one_query_needs_paged_attention,
    ragged_needs_paged_attention,
)
from dataplane.runtime.config import RuntimeSpec, device_kind
from dataplane.runtime.hugepages import HugePageScope
from dataplane.runtime.kv.masks import static_step_mask
from dataplane.runtime.kv.slots import SlotCounts
from dataplane.runtime.ov_core import shared_core
from dataplane.runtime.rope import LongSequences, stage_rope
from dataplane.runtime.startup import int4_group, open_stage, warm_up_steps
from zctl.manifest import ExportManifest, verify_export_files

PAST_PREFIX = "past_key_values."
PRESENT_PREFIX = "present."


def present_name(past: str) -> str:
    """The output carrying the new KV of past input ``past`` (``past_key_values.3.key``
    -> ``present.3.key``)."""
    return PRESENT_PREFIX + past.removeprefix(PAST_PREFIX)


# What an NPU compile takes of RuntimeSpec.properties(): it computes in f16 and has
# no CPU threads, and a stateless model has no KV cache precision to set.
NPU_PROPERTIES = ("PERFORMANCE_HINT",)
KV_CACHE_PROPERTIES = ("KV_CACHE_PRECISION", "KEY_CACHE_QUANT_MODE")  # of a plugin's KV cache


def static_properties(config: RuntimeSpec, group: int | None = None) -> dict[str, object]:
    """Compile properties for a static stage on ``config.device`` (``group``: the export's
    INT4 group size, RuntimeSpec.properties): all of them on CPU/GPU, the ones the NPU
    plugin takes on an NPU; never the KV cache's (no KV state: the stream's KV is on the
    host)."""
    props = {k: v for k, v in config.properties(group).items() if k not in KV_CACHE_PROPERTIES}
    if device_kind(config) == "NPU":
        props = {k: v for k, v in props.items() if k in NPU_PROPERTIES}
    return props


@dataclass
class ShapeRequest:
    """A stream's request for one compiled shape, with its inputs' host buffers bound."""

    request: ov.InferRequest
    x: np.ndarray
    mask: np.ndarray
    cos: np.ndarray
    sin: np.ndarray
    logits_idx: np.ndarray | None  # last stage only


@dataclass
class HostKV(SlotCounts):
    """One stream on a static stage: its KV buffers [1, kv_heads, context, head_dim] by past
    input name, the slot table of the filled slots (``keep[i]``: slot i is part of the
    sequence), and a request per compiled token count, made on first use."""

    buffers: dict[str, np.ndarray]
    keep: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    requests: dict[int, ShapeRequest] = field(default_factory=dict)


@dataclass(frozen=True)
class StaticStep:
    """What ``prepare`` checked for ``run``: the step's positions [1, T] and the last
    stage's logits indices (the last token when None)."""

    positions: np.ndarray
    logits_idx: np.ndarray | None


class StaticStageRunner:
    """Loads stage ``index`` of a static export and steps streams through it (a
    ``StageRuntime`` without row groups or prefix entries)."""

    row_groups_supported: ClassVar[bool] = False
    prefix_cache_supported: ClassVar[bool] = False  # no prefix entries either
    paged_attention: ClassVar[bool] = False
    one_query_supported: ClassVar[bool] = False  # a step's tokens are computed together

    def __init__(
        self,
        export_dir: Path | str,
        index: int,
        config: RuntimeSpec | None = None,
        manifest: ExportManifest | None = None,
        core: ov.Core | None = None,
        verify: bool = True,
    ) -> None:
        self.export_dir = Path(export_dir)
        self.manifest, self.spec, self.config = open_stage(self.export_dir, index, config,
                                                           manifest, static=True)
        static = self.manifest.static_kv
        assert static is not None
        if verify:
            verify_export_files(self.export_dir, self.manifest, [self.spec.xml, self.spec.bin])
        model = self.manifest.model
        self.context, self.chunk = static.context, static.chunk
        self.rope = stage_rope(model)
        self.long_sequences = LongSequences(self.rope, index)  # LongRoPE's long streams
        self.hidden_size = model.hidden_size
        self.kv_shape = (1, model.num_kv_heads, self.context, model.head_dim)
        self.kv_dtype = np.dtype(np.float16 if static.kv_dtype == "f16" else np.float32)
        self.input_name = self.spec.inputs[0]
        self.past_names = [n for n in self.spec.inputs if n.startswith(PAST_PREFIX)]
        if not self.past_names:
            raise StageError(f"stage {index} of {self.export_dir} lists no past KV inputs: "
                             "not a static export")
        core = core or shared_core()
        self.compiled: dict[int, ov.CompiledModel] = {}
        try:
            source = core.read_model(str(self.export_dir / self.spec.xml))
            with HugePageScope() as pages:  # see dataplane.runtime.hugepages
                for tokens in sorted({1, self.chunk}):
                    shaped = source.clone()
                    shaped.reshape(self._shapes(tokens))
                    self.compiled[tokens] = core.compile_model(
                        shaped, self.config.device,
                        static_properties(self.config, int4_group(self.manifest)))
        except RuntimeError as exc:
            raise StageError(f"cannot compile static stage {index} on {self.config.device}: "
                             f"{exc}") from None
        self.huge_page_bytes = pages.collapsed
        self.streams: dict[int, HostKV] = {}
        self.groups: dict[int, RowGroupKV] = {}  # always empty: no row groups on a static stage
        # one token's KV: a key and a value of every layer, in the host buffers' type
        self.kv_bytes_per_token = (len(self.past_names) * model.num_kv_heads * model.head_dim
                                   * self.kv_dtype.itemsize)

    def _shapes(self, tokens: int) -> dict[str, ov.PartialShape]:
        """Every input's fixed shape for a ``tokens``-token step."""
        width = self.rope.width
        x = [1, tokens] if self.spec.first else [1, tokens, self.hidden_size]
        shapes = {
            self.input_name: x,
            "attention_mask": [1, 1, tokens, self.context + tokens],
            "rope_cos": [1, tokens, width],
            "rope_sin": [1, tokens, width],
            **{name: list(self.kv_shape) for name in self.past_names},
        }
        if self.spec.last:
            shapes["logits_idx"] = [tokens]
        return {name: ov.PartialShape(shape) for name, shape in shapes.items()}

    def warm_up(self, stream_id: int = -1) -> None:
        """Run a chunk-shaped and a decode-shaped step on a scratch stream, then drop it."""
        warm_up_steps(self, stream_id, min(8, self.chunk))

    # -- streams ---------------------------------------------------------------------
    def open_stream(self, stream_id: int) -> HostKV:
        if stream_id not in self.streams:
            self.streams[stream_id] = HostKV(
                {name: np.zeros(self.kv_shape, self.kv_dtype) for name in self.past_names})
        return self.streams[stream_id]

    def reset_stream(self, stream_id: int, long_rope: bool = False) -> None:
        self.long_sequences.begin(stream_id, long_rope)
        self.open_stream(stream_id).keep = np.zeros(0, dtype=bool)  # old slots: unfilled

    def close_stream(self, stream_id: int) -> None:
        self.long_sequences.forget(stream_id)
        self.streams.pop(stream_id, None)

    def stream(self, stream_id: int) -> HostKV:
        """The stream\'s KV bookkeeping; StageError unless it is open here (stepped alone)."""
        kv = self.streams.get(stream_id)
        if kv is None:
            raise StageError(f"stream {stream_id} is not open on stage {self.spec.index}")
        return kv

    # -- stepping --------------------------------------------------------------------
    def check_input(self, x: np.ndarray, positions: np.ndarray) -> None:
        check_step_input(self.spec, self.hidden_size, x, positions)

    def step(self, stream_id: int, x: np.ndarray, positions: np.ndarray,
             logits_idx: np.ndarray | None = None, one_query: bool = False) -> np.ndarray:
        """Run one step for a stream; returns hidden states [1, T, H] or logits [1, K, V]
        (as StageRunner.step; a view, valid until the stream's next step)."""
        self.stream(stream_id)
        positions = np.asarray(positions, dtype=np.int64)
        self.check_input(x, positions)
        step = self.prepare(stream_id, positions[None], logits_idx, one_query=one_query)
        return self.run(stream_id, x, step).data

    def prepare(self, stream_id: int, positions: np.ndarray,
                logits_idx: np.ndarray | None = None, inputs: object = None,
                row_tokens: np.ndarray | None = None, one_query: bool = False) -> StaticStep:
        """Check a stream's next step (``positions`` [1, T]); ``inputs`` from another stage
        are ignored: a static stage fills its own fixed-shape buffers in ``run``. Ragged
        rows (``row_tokens``) and one-query steps need paged attention: StageError."""
        if row_tokens is not None:
            raise ragged_needs_paged_attention()
        if one_query:
            raise one_query_needs_paged_attention()
        self.stream(stream_id)
        positions = np.asarray(positions, dtype=np.int64)
        if positions.ndim != 2 or positions.shape[0] != 1 or positions.shape[1] < 1:
            raise StageError("a static stage steps one stream at a time: positions must be "
                             f"[1, T], got {positions.shape}")
        if logits_idx is not None and self.spec.last:
            idx = np.asarray(logits_idx, dtype=np.int64).reshape(-1)
            if idx.size == 0 or idx.min() < 0 or idx.max() >= positions.shape[1]:
                raise StageError(f"logits_idx {idx.tolist()} out of range for "
                                 f"{positions.shape[1]} tokens")
            logits_idx = idx
        return StaticStep(positions, logits_idx if self.spec.last else None)

    def run(self, stream_id: int, x: np.ndarray | ov.Tensor, step: StaticStep) -> ov.Tensor:
        """Run ``step`` on x (token ids [1, T], hidden states [1, T, H], or the previous
        stage's output tensor): piece by piece of at most ``chunk`` tokens, each written
        into the stream's KV. Returns the output tensor (as StageRunner.run)."""
        kv = self.stream(stream_id)
        data = x.data if isinstance(x, ov.Tensor) else x
        positions = step.positions[0]
        tokens = positions.shape[0]
        if data.ndim < 2 or data.shape[:2] != (1, tokens):
            raise StageError(f"x {tuple(data.shape)} does not match positions {step.positions.shape}")
        self._make_room(stream_id, kv, tokens)
        want = step.logits_idx if step.logits_idx is not None else np.array([tokens - 1])
        # the step's set (LongRoPE), not a piece's; every token long in a long sequence
        cos, sin = self.rope.tables(step.positions,
                                    long_rows=self.long_sequences.rows([stream_id]))
        pieces = []
        for lo in range(0, tokens, self.chunk):
            hi = min(lo + self.chunk, tokens)
            wanted = want[(want >= lo) & (want < hi)] - lo if self.spec.last else None
            out = self._run_piece(kv, data[:, lo:hi], (cos[0, lo:hi], sin[0, lo:hi]), wanted)
            if out is not None:  # a view of the request's output: the next piece reuses it
                pieces.append(out if tokens <= self.chunk else out.copy())
        if len(pieces) == 1:
            return ov.Tensor(pieces[0], shared_memory=True)
        out = np.concatenate(pieces, axis=1)
        if self.spec.last:  # rows came piece by piece: put them back in the asked order
            order = np.argsort(want // self.chunk, kind="stable")
            out = out[:, np.argsort(order, kind="stable")]
        return ov.Tensor(np.ascontiguousarray(out))

    def _make_room(self, stream_id: int, kv: HostKV, tokens: int) -> None:
        if kv.physical + tokens > self.context:
            self.compact(stream_id)
        if kv.physical + tokens > self.context:
            raise StageError(
                f"stream {stream_id} would hold {kv.physical + tokens} tokens; this static "
                f"export keeps {self.context} (export with a larger --context)")

    def _shape_request(self, kv: HostKV, tokens: int) -> ShapeRequest:
        """The stream's request for ``tokens``-token steps, its KV buffers and input
        buffers bound once."""
        held = kv.requests.get(tokens)
        if held is not None:
            return held
        compiled = self.compiled[tokens]
        request = compiled.create_infer_request()
        for name, buffer in kv.buffers.items():
            request.set_tensor(name, ov.Tensor(buffer, shared_memory=True))
        width = self.rope.width
        held = ShapeRequest(
            request,
            x=(np.zeros((1, tokens), np.int64) if self.spec.first
               else np.zeros((1, tokens, self.hidden_size), np.float32)),
            mask=np.zeros((1, 1, tokens, self.context + tokens), np.float32),
            cos=np.ones((1, tokens, width), np.float32),
            sin=np.zeros((1, tokens, width), np.float32),
            logits_idx=np.zeros(tokens, np.int64) if self.spec.last else None,
        )
        bindings = {self.input_name: held.x, "attention_mask": held.mask,
                    "rope_cos": held.cos, "rope_sin": held.sin}
        if held.logits_idx is not None:
            bindings["logits_idx"] = held.logits_idx
        for name, array in bindings.items():
            request.set_tensor(name, ov.Tensor(array, shared_memory=True))
        kv.requests[tokens] = held
        return held

    def _run_piece(self, kv: HostKV, x: np.ndarray, rope: tuple[np.ndarray, np.ndarray],
                   wanted: np.ndarray | None) -> np.ndarray | None:
        """One inference of at most ``chunk`` real tokens (``rope``: their [T, width] cos and
        sin rows); their KV goes into the stream's buffers. Returns the real rows' hidden
        states, the wanted logits, or None (a last stage's piece nobody asked logits of)."""
        cos, sin = rope
        real = cos.shape[0]
        tokens = 1 if real == 1 else self.chunk
        held = self._shape_request(kv, tokens)
        held.x[:, :real] = x
        held.x[:, real:] = 0
        static_step_mask(kv.keep, real, tokens, self.context, out=held.mask)
        held.cos[0, :real], held.sin[0, :real] = cos, sin
        held.cos[:, real:], held.sin[:, real:] = 1.0, 0.0
        if held.logits_idx is not None:
            asked = wanted if wanted is not None and wanted.size else np.array([real - 1])
            held.logits_idx[:asked.size] = asked
            held.logits_idx[asked.size:] = asked[-1]
        request = held.request
        if self.config.async_infer:
            request.start_async()
            request.wait()
        else:
            request.infer()
        filled = kv.physical
        for name, buffer in kv.buffers.items():
            buffer[:, :, filled:filled + real] = request.get_tensor(present_name(name)).data[
                :, :, :real]
        kv.keep = np.concatenate((kv.keep, np.ones(real, dtype=bool)))
        out = request.get_output_tensor(0).data
        if held.logits_idx is None:
            return out[:, :real]
        return out[:, :wanted.size] if wanted is not None and wanted.size else None

    def prefetch(self, stream_id: int) -> bool:
        """Nothing to bind ahead: a static step writes into buffers bound once."""
        return False

    # -- rewinds: by mask, or by moving the fill point back ---------------------------
    mask_step_tail = rewind.mask_step_tail
    truncate = rewind.truncate
    compaction_due = rewind.compaction_due
    kept_tokens = rewind.kept_tokens
    mask_tail = rewind.mask_tail

    def trim_tail(self, stream_id: int, count: int) -> None:
        """Trim-based rewind: the last ``count`` filled slots become free again (no copy)."""
        kv = self.stream(stream_id)
        if count < 0 or count > kv.physical:
            raise StageError(f"cannot trim {count} slots of a {kv.physical}-slot stream")
        kv.keep = kv.keep[:kv.physical - count].copy()

    def compact(self, stream_id: int) -> int:
        """Move the kept slots to the front of the buffers; returns how many were dropped."""
        kv = self.stream(stream_id)
        kept = np.flatnonzero(kv.keep)
        masked = kv.physical - kept.size
        if masked:
            for buffer in kv.buffers.values():
                buffer[:, :, :kept.size] = buffer[:, :, kept]
            kv.keep = np.ones(kept.size, dtype=bool)
        return masked

    def masked_slots(self, stream_id: int) -> int:
        kv = self.stream(stream_id)
        return kv.physical - kv.logical

    # -- row groups: not on a static stage -------------------------------------------
    def _no_groups(self) -> StageError:
        return StageError("a static (NPU) export steps streams one at a time: row groups "
                          "need the stateful export")

    def regroup(self, group_id: int, members: list[int]) -> None:
        raise self._no_groups()

    def mask_rows_tail(self, group_id: int, counts: np.ndarray) -> None:
        raise self._no_groups()

    def step_rows(self, group_id: int, x: np.ndarray, positions: np.ndarray,
                  logits_idx: np.ndarray | None = None, one_query: bool = False
                  ) -> np.ndarray:
        raise self._no_groups()

    def step_ragged(self, group_id: int, x: np.ndarray, positions: np.ndarray,
                    row_tokens: np.ndarray, logits_idx: np.ndarray | None = None,
                    one_query: bool = False) -> np.ndarray:
        raise ragged_needs_paged_attention()

    def row_of(self, stream_id: int) -> tuple[int, int] | None:
        """Never a row: a static stage has no row groups."""
        return None

    # -- prefix entries: not on a static stage ---------------------------------------
    def save_prefix(self, stream_id: int, entry_id: int, length: int, take: bool = False) -> None:
        raise StageError("a static (NPU) export keeps no prefix cache: prefix entries need "
                         "the stateful export")

    def load_prefix(self, stream_id: int, entry_id: int, length: int, take: bool = False) -> None:
        self.save_prefix(stream_id, entry_id, length, take)

    def drop_prefix(self, entry_id: int) -> None:
        """Nothing to drop: a static stage never holds an entry."""

    def drop_all_prefixes(self) -> None:
        """Nothing to drop: a static stage never holds an entry."""

    def prefix_bytes(self) -> int:
        return 0
