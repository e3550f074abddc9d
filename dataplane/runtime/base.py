"""What every stage runner shares: the runtime config, errors, input and stage checks.

``dataplane.runtime.stateful.StageRunner`` (stateful KV) and ``dataplane.runtime.static.
StaticStageRunner`` (the static NPU path) both build on these; ``dataplane.runtime.stateful``
re-exports them, so callers import from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from dataplane.runtime.config import DEVICES, RuntimeSpec, device_kind
from dataplane.runtime.kv.masks import drop_kept_tail
from zctl.manifest import ExportManifest, StageSpec, load_manifest

_CORE: ov.Core | None = None


def shared_core() -> ov.Core:
    """One OpenVINO Core per process, so every stage here shares its plugins and executors."""
    global _CORE
    if _CORE is None:
        _CORE = ov.Core()
    return _CORE


class StageError(RuntimeError):
    """A stage cannot be loaded, or a step's inputs do not fit it."""


def check_step_input(spec: StageSpec, hidden_size: int, x: np.ndarray,
                     positions: np.ndarray) -> None:
    """Raise StageError unless x and positions have the shapes a stream step of ``spec``
    takes: int token ids [1, T] on the first stage, float32 [1, T, hidden] after it."""
    if spec.first:
        if x.ndim != 2 or x.dtype.kind not in "iu":  # (np.issubdtype costs more, per step)
            raise StageError(f"stage 0 takes int token ids [batch, tokens], got {x.dtype} {x.shape}")
    elif x.ndim != 3 or x.shape[2] != hidden_size or x.dtype != np.float32:
        raise StageError(
            f"stage {spec.index} takes float32 hidden states [batch, tokens, "
            f"{hidden_size}], got {x.dtype} {x.shape}"
        )
    if x.shape[0] != 1 or x.shape[1] < 1:
        raise StageError(f"a stream step takes batch 1 and at least one token, got {x.shape}")
    if positions.shape != (x.shape[1],):
        raise StageError(f"positions shape {positions.shape} does not match {x.shape[1]} tokens")


def open_stage(export_dir: Path, index: int, config: RuntimeSpec | None,
               manifest: ExportManifest | None, static: bool
               ) -> tuple[ExportManifest, StageSpec, RuntimeSpec]:
    """The manifest, stage spec and config of stage ``index``, checked: the stage exists,
    the device is known, and the export's KV kind (static or stateful) is ``static``."""
    manifest = manifest or load_manifest(export_dir, verify_files=False)
    if (manifest.static_kv is not None) != static:
        raise StageError(
            f"{export_dir} is a static export: load it with StaticStageRunner" if not static
            else f"{export_dir} is a stateful export: load it with StageRunner")
    if not 0 <= index < len(manifest.stages):
        raise StageError(f"stage {index} does not exist: the export has {len(manifest.stages)} "
                         "stages")
    config = config or RuntimeSpec()
    if device_kind(config) not in DEVICES:
        raise StageError(f"unknown device {config.device!r}; expected one of {DEVICES}")
    return manifest, manifest.stages[index], config


def check_rows_step(group_id: int, rows: int, x: np.ndarray, positions: np.ndarray) -> None:
    """Raise StageError unless x and positions have a ``rows``-row group step's shapes:
    x [rows, T] or [rows, T, H], positions [rows, T]."""
    if x.ndim < 2 or x.shape[0] != rows or positions.shape != x.shape[:2]:
        raise StageError(f"row group {group_id} has {rows} rows: it takes x [{rows}, T, ...] "
                         f"and positions [{rows}, T], got {x.shape} and {positions.shape}")


def check_ragged_step(group_id: int, rows: int, x: np.ndarray, positions: np.ndarray,
                      row_tokens: np.ndarray) -> np.ndarray:
    """The rows' token counts of a ragged step, checked: StageError unless there is one
    positive count per row, they add up to the step's positions [N], and x is [1, N] or
    [1, N, H]."""
    counts = np.asarray(row_tokens, dtype=np.int64).reshape(-1)
    if counts.size != rows or (counts.size and int(counts.min()) < 1):
        raise StageError(f"row group {group_id} has {rows} rows: a ragged step needs one "
                         f"positive token count per row, got {counts.tolist()}")
    total = int(counts.sum())
    if positions.shape != (total,) or x.ndim < 2 or x.shape[:2] != (1, total):
        raise StageError(f"a ragged step of rows {counts.tolist()} takes x [1, {total}, ...] and "
                         f"positions [{total}], got {x.shape} and {positions.shape}")
    return counts


def check_row_rewinds(group_id: int, counts: np.ndarray, held: Sequence[int]) -> np.ndarray:
    """The per-row rewind counts as int64, checked against the tokens each row ``held``:
    StageError unless there is one count per row, each in 0..held."""
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    if counts.size != len(held):
        raise StageError(f"row group {group_id} has {len(held)} rows, got {counts.size} "
                         "rewinds")
    if any(not 0 <= c <= h for c, h in zip(counts, held, strict=True)):
        raise StageError(f"cannot rewind rows by {counts.tolist()}: they hold "
                         f"{list(held)} tokens")
    return counts


def zero_input(runner: Any, tokens: int) -> np.ndarray:
    """A scratch step's input for ``runner``: ``tokens`` zero ids [1, T] on the first stage,
    zero hidden states [1, T, H] on the others."""
    if runner.spec.first:
        return np.zeros((1, tokens), np.int64)
    return np.zeros((1, tokens, runner.hidden_size), np.float32)


def warm_up_steps(runner: Any, stream_id: int, prefill_tokens: int = 8) -> None:
    """Run a prefill-shaped and a decode-shaped step of ``runner`` on a scratch stream,
    then drop it, so the first real request does not pay the plugin's first-inference
    costs."""
    runner.open_stream(stream_id)
    try:
        for positions in (np.arange(prefill_tokens), np.arange(8, 9)):
            runner.step(stream_id, zero_input(runner, len(positions)), positions)
    finally:
        runner.close_stream(stream_id)


class MaskRewind:
    """Mask-based rewind over a runner's per-stream slot tables (a mixin: the runner
    provides ``_stream(stream_id)`` with a ``keep`` table)."""

    groups: dict[int, Any]

    def _stream(self, stream_id: int) -> Any: ...

    def mask_rows_tail(self, group_id: int, counts: np.ndarray) -> None: ...

    def masked_slots(self, stream_id: int) -> int: ...

    def mask_step_tail(self, stream_id: int, mask_tail: int | np.ndarray) -> bool:
        """The rewind a step carries, on this stage: a row group's rows by their own counts,
        a stream by one count. True when it masked anything."""
        if stream_id in self.groups:
            counts = np.asarray(mask_tail, dtype=np.int64).reshape(-1)
            if not counts.any():
                return False
            self.mask_rows_tail(stream_id, counts)
            return True
        if not mask_tail:
            return False
        self.mask_tail(stream_id, int(mask_tail))
        return True

    def compaction_due(self, stream_id: int, threshold: int | None) -> bool:
        """Whether the stream (or row group) has more than ``threshold`` masked slots
        (None: never compact)."""
        return threshold is not None and self.masked_slots(stream_id) > threshold

    def kept_tokens(self, stream_id: int) -> int:
        """The stream's logical length: the KV slots still part of its sequence."""
        return int(self._stream(stream_id).logical)

    def truncate(self, stream_id: int, length: int) -> bool:
        """Rewind the stream to its first ``length`` logical tokens (a cancel: whatever
        this stage computed past them goes; a stage that skipped those steps holds
        ``length`` already). True when it masked anything; StageError if it holds fewer."""
        count = self.kept_tokens(stream_id) - int(length)
        if count < 0:
            raise StageError(f"cannot rewind stream {stream_id} to {length} tokens: it holds "
                             f"{self.kept_tokens(stream_id)}")
        if not count:
            return False
        self.mask_tail(stream_id, count)
        return True

    def mask_tail(self, stream_id: int, count: int) -> None:
        """Mask-based rewind: drop the last ``count`` *kept* slots from attention."""
        slots = self._stream(stream_id)
        try:
            slots.keep = drop_kept_tail(slots.keep, count)
        except ValueError as exc:
            raise StageError(str(exc)) from None
