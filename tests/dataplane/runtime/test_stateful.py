"""StageRunner: input checks, per-stream KV, and rewind by mask, trim and compaction."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.base import StageError
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.ov_core import shared_core
from dataplane.runtime.paged import PagedStageRunner
from dataplane.runtime.stateful import StageRunner
from zctl.engine.executor import reply_from_logits
from zctl.engine.prefill import prefill_chunks
from zctl.manifest import ManifestError, load_manifest

EXACT = RuntimeSpec(precision="f32", kv_cache_precision="f32")
PROMPT = np.array([0, 17, 33, 90, 12, 250, 7], dtype=np.int64)


@pytest.fixture(scope="module")
def two_stage(tiny_exports) -> Path:
    return tiny_exports.get([(0, 2), (2, 4)])


def _chain(export_dir: Path) -> LocalChain:
    return LocalChain.load(str(export_dir), EXACT)


def _logits(chain: LocalChain, stream: int, tokens: np.ndarray, start: int) -> np.ndarray:
    reply = chain.step(stream, tokens, np.arange(start, start + len(tokens)),
                       np.arange(len(tokens)), want_logits=True)
    return reply.logits


def test_wrong_inputs_are_refused_and_stream_survives(two_stage: Path) -> None:
    runner = StageRunner(two_stage, 1, EXACT)
    runner.open_stream(0)
    hidden = runner.manifest.model.hidden_size
    bad = [
        (np.zeros((1, 2, hidden + 1), np.float32), np.arange(2), "hidden states"),
        (np.zeros((1, 2, hidden), np.float64), np.arange(2), "float32"),
        (np.zeros((1, 2, hidden), np.float32), np.arange(3), "positions shape"),
        (np.zeros((2, 2, hidden), np.float32), np.arange(2), "batch 1"),
    ]
    for x, positions, message in bad:
        with pytest.raises(StageError, match=message):
            runner.step(0, x, positions)
    with pytest.raises(StageError, match="logits_idx"):
        runner.step(0, np.zeros((1, 2, hidden), np.float32), np.arange(2), np.array([5]))
    assert runner.streams[0].physical == 0  # nothing was appended by refused steps
    out = runner.step(0, np.zeros((1, 2, hidden), np.float32), np.arange(2))
    assert out.shape == (1, 1, runner.manifest.model.vocab_size)
    with pytest.raises(StageError, match="not open"):
        runner.step(5, np.zeros((1, 1, hidden), np.float32), np.arange(1))


def test_stage_index_device_and_corruption_checks(two_stage: Path, tmp_path: Path) -> None:
    with pytest.raises(StageError, match="does not exist"):
        StageRunner(two_stage, 2)
    with pytest.raises(StageError, match="unknown device"):
        StageRunner(two_stage, 0, RuntimeSpec(device="TPU"))
    broken = tmp_path / "broken"
    shutil.copytree(two_stage, broken)
    with open(broken / "stage1.bin", "r+b") as handle:
        handle.seek(100)
        handle.write(b"\xff\xff\xff\xff")
    StageRunner(broken, 0)  # stage 0's files are intact
    with pytest.raises(ManifestError, match="corrupted"):
        StageRunner(broken, 1)
    (broken / "stage0.xml").unlink()
    with pytest.raises(ManifestError, match="missing"):
        load_manifest(broken)


def test_dynamic_quantization_can_be_turned_off_on_cpu(two_stage: Path) -> None:
    assert "DYNAMIC_QUANTIZATION_GROUP_SIZE" not in RuntimeSpec().properties()
    off = RuntimeSpec(dynamic_quantization=False)
    assert off.properties()["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == 0
    assert "DYNAMIC_QUANTIZATION_GROUP_SIZE" not in RuntimeSpec(
        device="NPU", dynamic_quantization=False).properties()  # a CPU/GPU plugin property
    runner = StageRunner(two_stage, 0, off)
    assert int(runner.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == 0


def test_an_int4_export_quantizes_activations_in_its_weight_groups(tiny_exports) -> None:
    """INT4: the dynamic quantization's group is the weights' (not the plugin's 32);
    INT8 and an export compiled without dynamic quantization are left as they were."""
    assert RuntimeSpec().properties(int4_group=64)["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == 64
    assert "DYNAMIC_QUANTIZATION_GROUP_SIZE" not in RuntimeSpec().properties(int4_group=24)
    assert RuntimeSpec(dynamic_quantization=False).properties(
        int4_group=64)["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == 0
    assert "DYNAMIC_QUANTIZATION_GROUP_SIZE" not in RuntimeSpec(device="GPU").properties(
        int4_group=64)
    int4, int8 = tiny_exports.get([(0, 4)], "int4"), tiny_exports.get([(0, 4)], "int8")
    group = load_manifest(int4).group_size
    assert group == 64
    for runner_class in (StageRunner, PagedStageRunner):
        compiled = runner_class(int4, 0).compiled
        assert int(compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == group
        compiled = runner_class(int8, 0).compiled
        assert int(compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == int(
            shared_core().get_property("CPU", "DYNAMIC_QUANTIZATION_GROUP_SIZE"))
        off = runner_class(int4, 0, RuntimeSpec(dynamic_quantization=False)).compiled
        assert int(off.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == 0


def test_the_plugins_primitive_cache_is_bounded_on_cpu(two_stage: Path) -> None:
    """Each new step shape adds compiled primitives; a serving stage sees many shapes."""
    assert RuntimeSpec().properties()["CPU_RUNTIME_CACHE_CAPACITY"] == 1000
    assert "CPU_RUNTIME_CACHE_CAPACITY" not in RuntimeSpec(device="GPU").properties()
    compiled_with: list[dict] = []

    class RecordingCore(ov.Core):  # (a compiled model cannot report this property)
        def compile_model(self, model, device, properties):  # noqa: ANN001, ANN201
            compiled_with.append(dict(properties))
            return super().compile_model(model, device, properties)

    for runner in (StageRunner, PagedStageRunner):
        runner(two_stage, 0, RuntimeSpec(), core=RecordingCore())
        assert compiled_with.pop()["CPU_RUNTIME_CACHE_CAPACITY"] == 1000


def test_streams_have_independent_kv(two_stage: Path) -> None:
    chain = _chain(two_stage)
    for stream in (1, 2):
        chain.open(stream)
        chain.reset(stream)
    a = _logits(chain, 1, PROMPT, 0)
    _logits(chain, 2, PROMPT[::-1].copy(), 0)
    fresh = _chain(two_stage)
    fresh.open(0)
    np.testing.assert_array_equal(a, _logits(fresh, 0, PROMPT, 0))
    next_1 = _logits(chain, 1, np.array([5]), len(PROMPT))
    next_0 = _logits(fresh, 0, np.array([5]), len(PROMPT))
    np.testing.assert_allclose(next_1, next_0, atol=1e-5)


def _rewind_then_continue(export_dir: Path, rewind: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Prefill, speculate 3 wrong tokens, rewind them, then feed the right token."""
    chain = _chain(export_dir)
    chain.open(0)
    chain.reset(0)
    _logits(chain, 0, PROMPT, 0)
    _logits(chain, 0, np.array([300, 301, 302]), len(PROMPT))  # draft, all rejected
    for runner in chain.runners:
        getattr(runner, rewind)(0, 3)
    after = _logits(chain, 0, np.array([42, 43]), len(PROMPT))
    reference = _chain(export_dir)
    reference.open(0)
    _logits(reference, 0, PROMPT, 0)
    expected = _logits(reference, 0, np.array([42, 43]), len(PROMPT))
    return after, expected, chain.runners[0].streams[0].physical


@pytest.mark.parametrize("rewind", ["mask_tail", "trim_tail"])
def test_rewind_equals_never_having_seen_the_draft(two_stage: Path, rewind: str) -> None:
    after, expected, physical = _rewind_then_continue(two_stage, rewind)
    np.testing.assert_allclose(after, expected, atol=1e-4)
    assert reply_from_logits(after).tokens.tolist() == reply_from_logits(expected).tokens.tolist()
    assert physical == len(PROMPT) + 2 + (3 if rewind == "mask_tail" else 0)


def test_rewind_off_by_one_is_caught(two_stage: Path) -> None:
    """Masking one slot too few (or too many) changes the logits: the test above can fail."""
    chain = _chain(two_stage)
    chain.open(0)
    _logits(chain, 0, PROMPT, 0)
    _logits(chain, 0, np.array([300, 301, 302]), len(PROMPT))
    for runner in chain.runners:
        runner.mask_tail(0, 2)
    wrong = _logits(chain, 0, np.array([42, 43]), len(PROMPT))
    reference = _chain(two_stage)
    reference.open(0)
    _logits(reference, 0, PROMPT, 0)
    expected = _logits(reference, 0, np.array([42, 43]), len(PROMPT))
    assert np.abs(wrong - expected).max() > 1e-3


def test_compact_drops_masked_slots_and_keeps_logits(two_stage: Path) -> None:
    chain = _chain(two_stage)
    chain.open(0)
    _logits(chain, 0, PROMPT, 0)
    _logits(chain, 0, np.array([300, 301, 302]), len(PROMPT))
    for runner in chain.runners:
        runner.mask_tail(0, 3)
        assert runner.compact(0) == 3
        assert runner.streams[0].physical == len(PROMPT)
        assert runner.compact(0) == 0
    after = _logits(chain, 0, np.array([42]), len(PROMPT))
    reference = _chain(two_stage)
    reference.open(0)
    _logits(reference, 0, PROMPT, 0)
    np.testing.assert_allclose(after, _logits(reference, 0, np.array([42]), len(PROMPT)), atol=1e-4)


def test_rewind_bounds(two_stage: Path) -> None:
    runner = StageRunner(two_stage, 0, EXACT)
    runner.open_stream(0)
    runner.step(0, PROMPT[None, :3], np.arange(3))
    with pytest.raises(StageError, match="cannot rewind 4"):
        runner.mask_tail(0, 4)
    with pytest.raises(StageError, match="cannot trim 4"):
        runner.trim_tail(0, 4)


def test_prefill_chunking_is_exact(two_stage: Path) -> None:
    assert prefill_chunks(7, 3) == [(0, 3), (3, 6), (6, 7)]
    whole, chunked = _chain(two_stage), _chain(two_stage)
    whole.open(0)
    chunked.open(0)
    expected = _logits(whole, 0, PROMPT, 0)[-1]
    for lo, hi in prefill_chunks(len(PROMPT), 3):
        last = _logits(chunked, 0, PROMPT[lo:hi], lo)[-1]
    np.testing.assert_allclose(last, expected, atol=1e-4)


def test_prefetched_inputs_give_the_same_steps_and_wrong_guesses_are_rebuilt(
        two_stage: Path) -> None:
    """prefetch binds the guessed next step (one token at the next position); a step that
    matches uses it, any other step (more tokens, another position, after a rewind or a
    compaction) builds its own, and every output equals a runner that never prefetches."""
    plain, ahead = StageRunner(two_stage, 1, EXACT), StageRunner(two_stage, 1, EXACT)
    hidden = plain.manifest.model.hidden_size
    rng = np.random.default_rng(7)
    for runner in (plain, ahead):
        runner.open_stream(0)
    assert not ahead.prefetch(0)  # nothing stepped yet: nothing to guess
    assert not ahead.prefetch(99)  # not a stream
    script = [  # (tokens, first position, rewind before the step)
        (5, 0, 0), (1, 5, 0), (1, 6, 0), (3, 7, 0), (1, 10, 2), (1, 9, 0), (1, 12, 0),
        (1, 11, 0), (2, 12, 0), (1, 14, 0)]
    used = 0
    for i, (tokens, start, rewind) in enumerate(script):
        x = rng.standard_normal((1, tokens, hidden), dtype=np.float32)
        positions = np.arange(start, start + tokens)
        outs = []
        for runner in (plain, ahead):
            if rewind:
                runner.mask_tail(0, rewind)
            if i == 6:
                runner.compact(0)
            guess = runner.streams[0].prefetched
            outs.append(np.array(runner.step(0, x, positions)))
            if runner is ahead:
                used += guess is not None and runner.streams[0].last is guess
                assert runner.prefetch(0) and not runner.prefetch(0)  # once per step
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_array_equal(ahead.streams[0].keep, plain.streams[0].keep)
    assert used == 3  # steps 2, 3 and 10 were the guessed next token


def test_prefetch_guesses_every_row_of_a_group(two_stage: Path) -> None:
    plain, ahead = StageRunner(two_stage, 1, EXACT), StageRunner(two_stage, 1, EXACT)
    hidden = plain.manifest.model.hidden_size
    rng = np.random.default_rng(11)
    prompts = [rng.standard_normal((1, n, hidden), dtype=np.float32) for n in (4, 6)]
    for runner in (plain, ahead):
        for sid, x in enumerate(prompts):
            runner.open_stream(sid)
            runner.step(sid, x, np.arange(x.shape[1]))
        runner.regroup(100, [0, 1])
    assert not ahead.prefetch(100)  # a new group has not stepped yet
    positions, used = np.array([[4], [6]]), 0
    for i in range(4):
        x = rng.standard_normal((2, 1, hidden), dtype=np.float32)
        outs = []
        for runner in (plain, ahead):
            if i == 2:
                runner.mask_rows_tail(100, np.array([1, 0]))  # a rewind: the guess is off
            guess = runner.groups[100].prefetched
            outs.append(np.array(runner.step_rows(100, x, positions)))
            if runner is ahead:
                used += guess is not None and runner.groups[100].last is guess
                assert runner.prefetch(100)
        np.testing.assert_array_equal(outs[0], outs[1])
        positions = positions + 1
    assert used == 2  # steps 1 and 3


class _FreshTensors(StageRunner):
    decode_buffers = False


@pytest.mark.parametrize("stage", [0, 1])
def test_decode_buffers_equal_fresh_tensors(two_stage: Path, stage: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """One-row decode steps write their inputs into per-stream buffers bound once, and
    every step its output into a tensor bound once (StepOutput); over decodes that outgrow
    the mask buffer, rewinds, compaction, trimming, multi-token steps, answers for chosen
    positions, two streams and a one-row group, every output equals binding fresh tensors
    per step and reading the request's own output."""
    from dataplane.runtime.kv.slots import DecodeBuffers

    monkeypatch.setattr(DecodeBuffers, "INITIAL_CAPACITY", 4)  # grow twice
    fresh, buffered = _FreshTensors(two_stage, stage, EXACT), StageRunner(two_stage, stage, EXACT)
    hidden = fresh.manifest.model.hidden_size
    rng = np.random.default_rng(3)
    for runner in (fresh, buffered):
        runner.open_stream(0)
        runner.open_stream(1)
    script = [  # (stream, tokens, first position, action before the step)
        (0, 3, 0, ""), (1, 2, 0, ""), (0, 1, 3, ""), (1, 1, 2, ""), (0, 1, 4, ""),
        (0, 1, 5, ""), (0, 1, 6, "mask 2"), (0, 1, 5, ""), (1, 1, 3, ""), (0, 1, 6, "compact"),
        (0, 2, 7, ""), (0, 1, 9, ""), (0, 1, 10, "trim 1"), (0, 1, 10, ""), (1, 1, 4, ""),
        (0, 1, 11, "prefetch"), (0, 1, 12, ""), (0, 3, 13, "answer 0 2"), (0, 1, 16, ""),
        (0, 2, 17, "answer 1"), (0, 1, 19, ""), (1, 1, 5, "group"), (1, 1, 6, "")]
    grouped = False
    for sid, tokens, start, action in script:
        x = (rng.integers(0, 200, (1, tokens)) if stage == 0
             else rng.standard_normal((1, tokens, hidden), dtype=np.float32))
        x.setflags(write=False)  # as a received frame's payload
        positions = np.arange(start, start + tokens)
        outs = []
        for runner in (fresh, buffered):
            if action.startswith("mask"):
                runner.mask_tail(sid, int(action.split()[1]))
            elif action.startswith("trim"):
                runner.trim_tail(sid, int(action.split()[1]))
            elif action == "compact":
                runner.compact(sid)
            elif action == "prefetch":
                runner.prefetch(sid)
            elif action == "group":
                runner.regroup(100, [sid])
            answer = (np.array([int(a) for a in action.split()[1:]])
                      if action.startswith("answer") else None)
            if sid == 1 and (grouped or action == "group"):
                outs.append(np.array(runner.step_rows(100, x, positions[None])))
            else:
                outs.append(np.array(runner.step(sid, x, positions, answer)))
        grouped = grouped or action == "group"
        np.testing.assert_array_equal(outs[0], outs[1])
    assert buffered.streams[0].decode is not None and fresh.streams[0].decode is None
    assert buffered.streams[0].output is not None and fresh.streams[0].output is None
    assert buffered.streams[0].decode.capacity >= 16 > 4  # outgrew its first buffer
    assert buffered.groups[100].decode is not None
