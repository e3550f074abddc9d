"""A paged stage's one-token graph (dataplane.runtime.one_token): single-token steps run on
it, every other step on the dynamic graph, over the same block caches, and the outputs are
bit for bit the dynamic graph's; ``decode_graph`` chooses it; a failed compile leaves the
stage on its dynamic graph."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import dataplane.runtime.one_token as one_token
from dataplane.head.local_chain import LocalChain
from dataplane.runtime.base import StageError
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.paged import PagedStageRunner
from zctl.engine.scheduler import generate_greedy, generate_speculative

PROMPT = [0, *range(5, 60)]


class StaticDecode(RuntimeSpec):
    decode_graph = "static"


class DynamicDecode(RuntimeSpec):
    decode_graph = "dynamic"


class UnknownDecode(RuntimeSpec):
    decode_graph = "sometimes"


@pytest.fixture(scope="module", params=["int4", "int8"])
def export(request, tiny_exports):
    """The tiny model in 2 stages, INT4 or INT8 weights."""
    return tiny_exports.get([(0, 2), (2, 4)], weights=request.param)


def pair(export, stage: int, blocks: int = 256) -> tuple[PagedStageRunner, PagedStageRunner]:
    """The stage with and without its one-token graph (the default numerics: int8 dynamic
    quantization, the u8 cache)."""
    runners = tuple(PagedStageRunner(export, stage, spec(paged_attention=True), blocks=blocks)
                    for spec in (StaticDecode, DynamicDecode))
    assert runners[0].one_token is not None and runners[1].one_token is None
    return runners


def feed(runner: PagedStageRunner, tokens: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if runner.spec.first:
        return rng.integers(5, 200, size=(1, tokens))
    return rng.standard_normal((1, tokens, runner.hidden_size)).astype(np.float32)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_stream_computes_bit_for_bit_as_on_the_dynamic_graph(export, stage) -> None:
    """A prompt (growing the block cache: both graphs must see the new one), decode steps,
    a verification step, a rewind, a one-query step and decode steps again: every output
    equal, every single-token step on the one-token graph, the others on the dynamic one."""
    static, dynamic = pair(export, stage, blocks=1)
    steps = [(40, False), *[(1, False)] * 5, (4, False), "rewind", *[(1, False)] * 3,
             (3, True), *[(1, False)] * 4]
    for runner in (static, dynamic):
        runner.open_stream(1)
    position = 0
    for index, step in enumerate(steps):
        if step == "rewind":
            for runner in (static, dynamic):
                runner.mask_tail(1, 3)
            position -= 3
            continue
        tokens, one_query = step
        x, positions = feed(static, tokens, index), np.arange(position, position + tokens)
        outs = [runner.step(1, x, positions, one_query=one_query).copy()
                for runner in (static, dynamic)]
        assert np.array_equal(outs[0], outs[1]), f"step {index} ({tokens} tokens) differs"
        want = static.one_token if tokens == 1 else static.dynamic
        assert static.request is want.request
        position += tokens
    assert static.pool.capacity > 1  # the cache grew under both graphs
    for runner in (static, dynamic):
        runner.close_stream(1)
        assert runner.pool.used == 0


def test_a_one_token_step_is_not_padded_to_the_dynamic_graphs_recent_shape(dp_export2
                                                                         ) -> None:
    """Padding keeps the dynamic graph's shape; a step on the one-token graph changes it
    not, so it is not padded."""
    static = PagedStageRunner(dp_export2, 0, StaticDecode(paged_attention=True))
    dynamic = PagedStageRunner(dp_export2, 0, DynamicDecode(paged_attention=True))
    for runner in (static, dynamic):
        runner.shapes.limit = 7
        runner.open_stream(1)
        runner.step(1, feed(runner, 8, 1), np.arange(8))
        runner.step(1, feed(runner, 1, 2), np.arange(8, 9))
    assert static.request is static.one_token.request
    assert static.request.get_input_tensor(0).shape[0] == 1
    assert dynamic.request.get_input_tensor(0).shape[0] == 8  # padded to the last shape


def test_a_row_groups_steps_run_on_the_dynamic_graph_and_compute_alike(export) -> None:
    """One token for each of several rows is not a one-token step: the dynamic graph runs
    it; the rows' outputs, and a lone decode step after, equal the dynamic-only stage's."""
    static, dynamic = pair(export, 0)
    outs = []
    for runner in (static, dynamic):
        for sid, length in ((1, 20), (2, 33)):
            runner.open_stream(sid)
            runner.step(sid, feed(runner, length, sid), np.arange(length))
        runner.regroup(10, [1, 2])
        rows = runner.step_rows(10, np.array([[7], [9]]), np.array([[20], [33]])).copy()
        ran_on = runner.request
        runner.regroup(10, [1])
        alone = runner.step_rows(10, np.array([[8]]), np.array([[21]])).copy()
        outs.append((rows, alone))
        if runner is static:
            assert ran_on is static.dynamic.request
            assert static.request is static.one_token.request
        runner.close_stream(10)
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])


def test_greedy_and_speculative_tokens_equal_the_dynamic_graphs(export) -> None:
    """Through a chain of both stages: greedy tokens, and speculative decoding's (drafts
    verified and rewound), the same with and without the one-token graphs."""
    chains = [LocalChain.load(str(export), spec(paged_attention=True))
              for spec in (StaticDecode, DynamicDecode)]
    assert all(r.one_token is not None for r in chains[0].runners)
    greedy = [list(generate_greedy(chain, PROMPT, 24)) for chain in chains]
    assert greedy[0] == greedy[1]
    prompt = [*PROMPT, *PROMPT[1:20]]
    spec = [list(generate_speculative(chain, prompt, 24, k=4, prefill_chunk=16))
            for chain in chains]
    assert spec[0] == spec[1]


def test_decode_graph_chooses_and_auto_asks_for_room_and_small_layers() -> None:
    assert one_token.wants_one_token_graph("static", 10**12, 0, 1)
    assert not one_token.wants_one_token_graph("dynamic", 1, 10**12, 30)
    weights = 100 * 2**20  # 30 layers of 3.3 MB: small enough to gain
    assert one_token.wants_one_token_graph(
        "auto", weights, one_token.AUTO_MEMORY_FACTOR * weights, 30)
    assert not one_token.wants_one_token_graph(
        "auto", weights, one_token.AUTO_MEMORY_FACTOR * weights - 1, 30)
    big = 800 * 2**20  # 16 layers of 50 MB: the 1B shape, where it did not gain
    assert not one_token.wants_one_token_graph("auto", big, 100 * big, 16)
    assert one_token.wants_one_token_graph("static", big, 0, 16)
    # a mixture of experts' stage never: static, the plugin computes every expert
    assert not one_token.wants_one_token_graph("static", weights, 10**12, 30, experts=8)
    assert not one_token.wants_one_token_graph("auto", weights, 10**12, 30, experts=8)
    with pytest.raises(StageError, match="decode_graph takes one of auto, static, dynamic"):
        one_token.wants_one_token_graph("sometimes", 1, 1, 1)


def test_an_unknown_decode_graph_is_refused_at_load(dp_export2) -> None:
    with pytest.raises(StageError, match="'sometimes'"):
        PagedStageRunner(dp_export2, 0, UnknownDecode(paged_attention=True))


def test_auto_leaves_a_stage_short_of_memory_on_its_dynamic_graph(
        dp_export2, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dataplane.runtime.paged.available_memory", lambda: 1)
    assert PagedStageRunner(dp_export2, 0, RuntimeSpec(paged_attention=True)).one_token is None
    monkeypatch.setattr("dataplane.runtime.paged.available_memory", lambda: 2**50)
    assert PagedStageRunner(dp_export2, 0, RuntimeSpec(paged_attention=True)).one_token


def test_a_one_token_graph_that_fails_to_compile_leaves_the_stage_serving(
        dp_export2, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The reshape or compile raises: a log line, and every step runs on the dynamic graph."""
    def broken(*args, **kwargs):
        raise RuntimeError("Exception from src/core/src/shape_util.cpp: cannot reshape\nmore")

    monkeypatch.setattr(one_token, "one_token_model", broken)
    with caplog.at_level(logging.WARNING, logger="zctl.dataplane.runtime"):
        runner = PagedStageRunner(dp_export2, 0, StaticDecode(paged_attention=True))
    assert runner.one_token is None
    assert "its one-token graph did not compile: Exception from" in caplog.text
    assert "more" not in caplog.text
    want = PagedStageRunner(dp_export2, 0, DynamicDecode(paged_attention=True))
    for r in (runner, want):
        r.open_stream(1)
        r.step(1, np.array([PROMPT]), np.arange(len(PROMPT)))
    outs = [r.step(1, np.array([[7]]), np.array([len(PROMPT)])).copy() for r in (runner, want)]
    assert np.array_equal(*outs)
    assert runner.request is runner.dynamic.request


def test_weights_bytes_counts_the_constants() -> None:
    import openvino as ov
    from openvino import opset13 as ops

    x = ops.parameter([1, 4], ov.Type.f32)
    w = ops.constant(np.ones((4, 3), np.float32))
    model = ov.Model([ops.matmul(x, w, False, False)], [x])
    assert one_token.weights_bytes(model) == 4 * 3 * 4
