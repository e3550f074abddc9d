"""The static NPU path: a stateless export with fixed shapes, its KV kept on the host."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.base import StageError
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.kv.masks import MASK_MIN, static_step_mask
from dataplane.runtime.load import load_runner
from dataplane.runtime.ov_core import shared_core
from dataplane.runtime.stateful import StageRunner
from dataplane.runtime.static import StaticStageRunner, static_properties
from zctl.engine.scheduler import generate_greedy, generate_speculative, run_sessions
from zctl.engine.sessions import DecodeSession
from zctl.engine.stats import SpeculativeStats
from zctl.manifest import MANIFEST_NAME, ManifestError, StaticKV, load_manifest

EXACT = RuntimeSpec(precision="f32", kv_cache_precision="f32")
CONTEXT, CHUNK = 48, 4
PROMPTS = [[0, 17, 42, 99, 5, 230, 7, 8, 9, 10], [0, 11, 12, 13, 14, 15, 11, 12, 13, 14, 15],
           [0, 300, 301]]
N = 20


@pytest.fixture(scope="module")
def static2(tiny_exports) -> Path:
    return tiny_exports.get([(0, 2), (2, 4)], static=(CONTEXT, CHUNK))


@pytest.fixture(scope="module")
def stateful2(tiny_exports) -> Path:
    return tiny_exports.get([(0, 2), (2, 4)])


def _chain(export: Path, rewind: str = "mask") -> LocalChain:
    return LocalChain.load(str(export), EXACT, rewind=rewind)


def _logits(chain: LocalChain, tokens, start: int, idx=None) -> np.ndarray:
    tokens = np.asarray(tokens, dtype=np.int64)
    idx = np.arange(len(tokens)) if idx is None else np.asarray(idx)
    return chain.step(0, tokens, np.arange(start, start + len(tokens)), idx,
                      want_logits=True).logits


def test_static_mask_is_the_dynamic_mask_over_filled_slots() -> None:
    keep = np.array([True, False, True])
    mask = static_step_mask(keep, 2, 4, 5)[0, 0]
    assert mask.shape == (4, 9)
    visible = mask == 0
    assert visible[:2, :5].tolist() == [[True, False, True, False, False]] * 2
    assert visible[:, 5:].tolist() == [[True, False, False, False], [True, True, False, False],
                                       [False, False, True, False], [False, False, False, True]]
    assert (mask[~visible] == MASK_MIN).all()
    with pytest.raises(ValueError, match="does not fit"):
        static_step_mask(np.ones(5, bool), 1, 1, 4)


def test_compile_properties_per_device() -> None:
    cpu = static_properties(RuntimeSpec(num_threads=2, kv_cache_precision="u8"))
    assert cpu == {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32",
                   "INFERENCE_NUM_THREADS": 2, "CPU_RUNTIME_CACHE_CAPACITY": 1000}
    assert static_properties(RuntimeSpec(device="NPU", num_threads=2)) == {
        "PERFORMANCE_HINT": "LATENCY"}


def test_export_is_stateless_with_kv_as_io(static2: Path, stateful2: Path) -> None:
    manifest = load_manifest(static2)
    assert manifest.static_kv == StaticKV(CONTEXT, CHUNK) and not manifest.beam_idx
    for spec in manifest.stages:
        assert spec.state_names == ()
        assert sum(n.startswith("past_key_values.") for n in spec.inputs) == 2 * spec.num_layers
        assert sum(n.startswith("present.") for n in spec.outputs) == 2 * spec.num_layers
    runner = StaticStageRunner(static2, 1, EXACT)
    for tokens, compiled in runner.compiled.items():  # what an NPU needs: no dynamic dims
        assert all(port.get_partial_shape().is_static for port in compiled.inputs)
        assert all(port.get_partial_shape().is_static for port in compiled.outputs)
        assert list(compiled.input("attention_mask").get_shape()) == [1, 1, tokens,
                                                                      CONTEXT + tokens]
    assert sorted(runner.compiled) == [1, CHUNK]
    assert isinstance(load_runner(static2, 0, EXACT), StaticStageRunner)
    assert type(load_runner(stateful2, 0, EXACT)) is StageRunner


def test_greedy_equals_the_stateful_chain(static2: Path, stateful2: Path) -> None:
    static, stateful = _chain(static2), _chain(stateful2)
    for prompt in PROMPTS:  # prompts longer than a chunk run piece by piece
        want = list(generate_greedy(stateful, prompt, N, prefill_chunk=16))
        assert list(generate_greedy(static, prompt, N, prefill_chunk=16)) == want
        assert list(generate_greedy(static, prompt, N, prefill_chunk=3)) == want


def test_logits_of_any_positions_across_pieces(static2: Path, stateful2: Path) -> None:
    static, stateful = _chain(static2), _chain(stateful2)
    for chain in (static, stateful):
        chain.open(0)
    idx = [9, 2, 5, 5, 0]  # unordered, repeated, spanning three pieces of 4
    got = _logits(static, PROMPTS[0], 0, idx)
    want = _logits(stateful, PROMPTS[0], 0, idx)
    assert got.shape == want.shape == (5, 384)
    np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("rewind", ["mask_tail", "trim_tail"])
def test_rewind_equals_never_having_seen_the_draft(static2: Path, rewind: str) -> None:
    chain, reference = _chain(static2), _chain(static2)
    for c in (chain, reference):
        c.open(0)
        _logits(c, PROMPTS[0], 0)
    _logits(chain, [300, 301, 302], len(PROMPTS[0]))
    for runner in chain.runners:
        getattr(runner, rewind)(0, 3)
    after = _logits(chain, [42, 43], len(PROMPTS[0]))
    np.testing.assert_allclose(after, _logits(reference, [42, 43], len(PROMPTS[0])), atol=1e-4)
    physical = chain.runners[0].streams[0].physical
    assert physical == len(PROMPTS[0]) + 2 + (3 if rewind == "mask_tail" else 0)
    # one slot too few masked changes the logits: the comparison above can fail
    wrong, again = _chain(static2), _chain(static2)
    for c in (wrong, again):
        c.open(0)
        _logits(c, PROMPTS[0], 0)
    _logits(wrong, [300, 301, 302], len(PROMPTS[0]))
    for runner in wrong.runners:
        runner.mask_tail(0, 2)
    assert np.abs(_logits(wrong, [42], len(PROMPTS[0]))
                  - _logits(again, [42], len(PROMPTS[0]))).max() > 1e-3


def test_compaction_and_a_full_context(static2: Path) -> None:
    chain, reference = _chain(static2), _chain(static2)
    for c in (chain, reference):
        c.open(0)
        _logits(c, PROMPTS[0], 0)
    _logits(chain, [300, 301, 302], 10)
    for runner in chain.runners:
        runner.mask_tail(0, 3)
        assert runner.masked_slots(0) == 3 and runner.compact(0) == 3 and runner.compact(0) == 0
        assert runner.streams[0].physical == 10
    np.testing.assert_allclose(_logits(chain, [42], 10), _logits(reference, [42], 10), atol=1e-4)
    # fill the context with drafts, then mask them: the next step compacts them away
    draft = list(range(100, 100 + CONTEXT - 11))
    _logits(chain, draft, 11)
    for runner in chain.runners:
        runner.mask_tail(0, len(draft))
        assert runner.streams[0].physical == CONTEXT
    np.testing.assert_allclose(_logits(chain, [7], 11), _logits(reference, [7], 11), atol=1e-4)
    assert [r.streams[0].physical for r in chain.runners] == [12, 12]
    # more tokens than the context holds: a clear error, the stream unchanged and usable
    with pytest.raises(StageError, match=f"keeps {CONTEXT}.*--context"):
        _logits(chain, list(range(CONTEXT)), 12)
    assert [r.streams[0].physical for r in chain.runners] == [12, 12]
    np.testing.assert_allclose(_logits(chain, [8], 12), _logits(reference, [8], 12), atol=1e-4)


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_speculative_equals_greedy(static2: Path, mode: str) -> None:
    chain = _chain(static2, rewind=mode)
    from tests.zctl.engine.test_drafting import ScriptedDrafter

    for prompt in PROMPTS:
        want = list(generate_greedy(chain, prompt, N, prefill_chunk=4))
        assert list(generate_speculative(chain, prompt, N, k=4, prefill_chunk=4)) == want
        # every accept count 0..k and every rewind length, drafted on purpose
        stats, drafter = SpeculativeStats(), ScriptedDrafter(prompt, want)
        assert list(generate_speculative(chain, prompt, N, k=4, prefill_chunk=4, stats=stats,
                                         drafter=drafter)) == want
        assert set(drafter.counts[:5]) == {0, 1, 2, 3, 4} and stats.rejections > 0


def test_scheduler_does_not_batch_rows_on_a_static_chain(static2: Path) -> None:
    chain = _chain(static2)
    assert not chain.row_groups_supported
    sessions = [DecodeSession(i, p, 8, prefill_chunk=4) for i, p in enumerate(PROMPTS)]
    list(run_sessions(chain, sessions, row_groups=2))
    want = [list(generate_greedy(chain, p, 8, stream_id=9, prefill_chunk=4)) for p in PROMPTS]
    assert [s.error for s in sessions] == [None] * len(PROMPTS)
    assert [s.emitted for s in sessions] == want
    runner = chain.runners[0]
    with pytest.raises(StageError, match="row groups need the stateful export"):
        runner.regroup(100, [0, 1])


def test_bad_input_is_refused_and_the_stream_survives(static2: Path, stateful2: Path,
                                                      tmp_path: Path) -> None:
    runner = StaticStageRunner(static2, 1, EXACT)
    runner.open_stream(0)
    good = np.zeros((1, 2, 64), np.float32)
    for x, pos in ((np.zeros((1, 2, 65), np.float32), np.arange(2)),
                   (good.astype(np.float64), np.arange(2)), (good, np.arange(3))):
        with pytest.raises(StageError):
            runner.step(0, x, pos)
    with pytest.raises(StageError, match="out of range"):
        runner.step(0, good, np.arange(2), np.array([2]))
    with pytest.raises(StageError, match="not open"):
        runner.step(5, good, np.arange(2))
    assert runner.streams[0].physical == 0
    assert runner.step(0, good, np.arange(2)).shape == (1, 1, 384)
    with pytest.raises(StageError, match="static export"):
        StageRunner(static2, 0, EXACT)
    with pytest.raises(StageError, match="stateful export"):
        StaticStageRunner(stateful2, 0, EXACT)
    with pytest.raises(StageError, match="zctl export --static"):
        StageRunner(stateful2, 0, RuntimeSpec(device="NPU"))
    if "NPU" not in shared_core().available_devices:  # no NPU here: a clear error, no crash
        with pytest.raises(StageError, match="cannot compile static stage 0 on NPU"):
            StaticStageRunner(static2, 0, RuntimeSpec(device="NPU"))
    with pytest.raises(ManifestError, match="chunk <= context"):
        StaticKV(8, 16)
    broken = tmp_path / "broken"
    shutil.copytree(static2, broken)
    raw = json.loads((broken / MANIFEST_NAME).read_text())
    for bad in ({"context": 8}, {"context": "8", "chunk": 2}, [8, 2]):
        (broken / MANIFEST_NAME).write_text(json.dumps({**raw, "static_kv": bad}))
        with pytest.raises(ManifestError, match="static"):
            load_manifest(broken)


@pytest.mark.slow
def test_a_static_draft_model(tiny_exports, stateful2: Path, tmp_path: Path) -> None:
    """A static 1-stage export as the drafter: its own rewinds run on host KV."""
    from dataplane.runtime.draft_model import ModelDrafter
    from exporter.export import export_model
    from exporter.sources import open_source
    from tests.helpers.tiny_models import build_llama
    from tests.zctl.engine.test_drafting import speculate

    target = _chain(stateful2)
    same = ModelDrafter(StaticStageRunner(tiny_exports.get([(0, 4)], static=(CONTEXT, CHUNK)), 0,
                                          EXACT))
    export_model(open_source(str(build_llama(tmp_path / "other", seed=1))), [(0, 4)], "fp32",
                 tmp_path / "other-static", static_kv=StaticKV(CONTEXT, CHUNK))
    other = ModelDrafter(StaticStageRunner(tmp_path / "other-static", 0, EXACT))  # disagrees
    for prompt in PROMPTS:
        want = list(generate_greedy(target, prompt, N, prefill_chunk=4))
        got, stats = speculate(target, prompt, n=N, drafter=same)
        assert got == want and stats.accepted == stats.proposed > 0
        got, stats = speculate(target, prompt, n=N, drafter=other)
        assert got == want and stats.rejections > 0


@pytest.mark.slow
def test_f16_host_kv(tiny_exports, static2: Path) -> None:
    """An f16 host KV: half the bytes, the KV's I/O in f16, greedy output unchanged here."""
    half = tiny_exports.get([(0, 2), (2, 4)], static=(CONTEXT, CHUNK, "f16"))
    assert load_manifest(half).static_kv == StaticKV(CONTEXT, CHUNK, "f16")
    runner = StaticStageRunner(half, 1, EXACT)
    runner.open_stream(0)
    assert all(b.dtype == np.float16 for b in runner.streams[0].buffers.values())
    compiled = runner.compiled[1]
    past = [p for p in compiled.inputs if p.get_any_name().startswith("past_key_values.")]
    present = [p for p in compiled.outputs if p.get_any_name().startswith("present.")]
    assert past and present and all(p.get_element_type() == ov.Type.f16 for p in past + present)
    chain_half, chain_full = _chain(half), _chain(static2)
    for chain in (chain_half, chain_full):
        chain.open(0)
    np.testing.assert_allclose(_logits(chain_half, PROMPTS[0], 0),
                               _logits(chain_full, PROMPTS[0], 0), atol=0.05, rtol=0.01)
    for prompt in PROMPTS:
        assert (list(generate_greedy(chain_half, prompt, N, prefill_chunk=4))
                == list(generate_greedy(chain_full, prompt, N, prefill_chunk=4)))
    with pytest.raises(ManifestError, match="dtype"):
        StaticKV(8, 4, "bf16")
