"""ModelDrafter: a small model (a 1-stage export) proposing draft tokens for speculation.

It implements the engine's ``Drafter`` on its own stage runtime and rewinds its KV by mask;
``DraftModels`` loads each draft model once for the engine's speculative requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dataplane.runtime.base import StageError, StageRuntime
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.load import load_runner
from zctl.engine.prefill import prefill_chunks
from zctl.engine.requests import RequestRefused
from zctl.manifest import ManifestError, load_manifest


class ModelDrafter:
    """A small model (a 1-stage export sharing the target's tokenizer) drafting greedily.

    It keeps its own KV for ``stream_id`` on its own runtime and rewinds it by mask:
    each proposal rewinds to the longest common prefix of what it has fed and the new
    history, feeds the rest, then decodes k tokens. Not replayable: every draft costs the
    draft model's steps.
    """

    replayable = False

    def __init__(self, runner: StageRuntime, stream_id: int = 0, prefill_chunk: int = 256,
                 compact_threshold: int = 64) -> None:
        if not (runner.spec.first and runner.spec.last):
            raise ValueError("a drafter model must be a 1-stage export")
        self.runner, self.stream_id = runner, stream_id
        self.prefill_chunk, self.compact_threshold = prefill_chunk, compact_threshold
        runner.open_stream(stream_id)
        runner.reset_stream(stream_id)
        self.fed: list[int] = []

    def _sync(self, history: Sequence[int]) -> int:
        """Rewind to the common prefix with ``history`` (keeping one token to feed)."""
        common = 0
        for mine, theirs in zip(self.fed, history, strict=False):
            if mine != theirs:
                break
            common += 1
        common = min(common, len(history) - 1)
        if common == 0:
            self.runner.reset_stream(self.stream_id)
        else:
            self.runner.mask_tail(self.stream_id, len(self.fed) - common)
            if self.runner.compaction_due(self.stream_id, self.compact_threshold):
                self.runner.compact(self.stream_id)
        del self.fed[common:]
        return common

    def _feed(self, tokens: Sequence[int]) -> int:
        start = len(self.fed)
        logits = None
        for lo, hi in prefill_chunks(len(tokens), self.prefill_chunk):
            ids = np.asarray(tokens[lo:hi], dtype=np.int64)[None]
            logits = self.runner.step(self.stream_id, ids, np.arange(start + lo, start + hi))
        self.fed.extend(int(t) for t in tokens)
        assert logits is not None
        return int(logits.reshape(-1, logits.shape[-1])[-1].argmax())

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        if k < 1 or not history:
            return []
        common = self._sync(history)
        out = [self._feed(history[common:])]
        while len(out) < k:
            out.append(self._feed(out[-1:]))
        return out

    def accept(self, n: int) -> None:
        pass


class DraftModels:
    """The engine's ``load_drafter``: a ``ModelDrafter`` for a request's draft model path,
    each model loaded once (with ``config``) and checked against the target's vocabulary."""

    def __init__(self, vocab_size: int, config: RuntimeSpec | None = None) -> None:
        self.vocab_size, self.config = vocab_size, config
        self._runners: dict[Path, StageRuntime] = {}

    def __call__(self, path: str, stream_id: int) -> ModelDrafter:
        return ModelDrafter(self.runner(path), stream_id)

    def runner(self, path: str) -> StageRuntime:
        """The draft model at ``path`` (loaded once); RequestRefused if it cannot draft."""
        export = Path(path).expanduser().resolve()
        if export in self._runners:
            return self._runners[export]
        try:
            manifest = load_manifest(export)
        except (ManifestError, OSError) as exc:
            raise RequestRefused(f"draft model {path}: {exc}") from None
        if len(manifest.stages) != 1:
            raise RequestRefused(f"draft model {path} has {len(manifest.stages)} stages; a drafter "
                                 "must be a 1-stage export (zctl export MODEL --stages 1)")
        if manifest.model.vocab_size != self.vocab_size:
            raise RequestRefused(
                f"draft model {path} has a {manifest.model.vocab_size}-token vocabulary, the "
                f"target {self.vocab_size}: a drafter must share the tokenizer")
        try:
            runner = load_runner(export, 0, self.config, manifest=manifest, verify=False)
        except StageError as exc:
            raise RequestRefused(f"draft model {path}: {exc}") from None
        self._runners[export] = runner
        return runner
