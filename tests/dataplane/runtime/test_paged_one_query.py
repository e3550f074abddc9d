"""Paged stages under the default numerics (a u8 KV cache with by-token keys): a prompt
cut anywhere into pieces of two tokens or more computes the same KV and outputs, and a
one-query step (each token a sequence of its own) computes bit for bit what single
decode steps do, alone, in uniform rows and in ragged rows; stages that cannot refuse one."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

from dataplane.runtime.base import StageError
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.load import load_runner
from dataplane.runtime.stage_chain import StageChain

GROUP = 1 << 30


class ByChannelKeys(RuntimeSpec):
    """The plugin's own paged key cache: quantized per channel over a block."""

    key_cache_by_token: ClassVar[bool] = False


def inputs(runner, tokens: int, seed: int) -> np.ndarray:
    """``tokens`` inputs of the runner's stage: ids on the first, hidden states after it."""
    rng = np.random.default_rng(seed)
    if runner.spec.first:
        return rng.integers(5, 200, size=(1, tokens))
    return rng.standard_normal((1, tokens, runner.hidden_size)).astype(np.float32)


def prefill(runner, sid: int, x: np.ndarray, pieces: list[int]) -> np.ndarray:
    """Open ``sid`` and feed x in ``pieces`` of those many tokens; the last piece's output."""
    runner.open_stream(sid)
    runner.reset_stream(sid)
    pos = 0
    for n in pieces:
        out = runner.step(sid, x[:, pos:pos + n], np.arange(pos, pos + n)).copy()
        pos += n
    return out


def decode(runner, sid: int, x: np.ndarray, start: int) -> np.ndarray:
    """x's tokens fed one a step from position ``start``: the outputs, one row each."""
    return np.concatenate([runner.step(sid, x[:, i:i + 1], np.array([start + i])).copy()
                           for i in range(x.shape[1])], axis=1)


@pytest.fixture(scope="module", params=[0, 1], ids=["stage0", "last"])
def runner(request, dp_export2):
    return load_runner(dp_export2, request.param, RuntimeSpec(paged_attention=True))


@pytest.mark.parametrize("pieces", [[16, 21], [2, 35], [35, 2], [31, 6], [5, 5, 27]])
def test_a_prompt_cut_anywhere_computes_alike(dp_export2, runner, pieces) -> None:
    """Pieces of two tokens or more give the whole prompt's output, and the steps after
    read the same KV; per-channel keys (the plugin's own) differ where a block is written
    in two steps."""
    x, later = inputs(runner, 37, 1), inputs(runner, 4, 2)
    whole = prefill(runner, 1, x, [37])
    after = decode(runner, 1, later, 37)
    cut = prefill(runner, 2, x, pieces)
    assert np.array_equal(cut[:, -1], whole[:, -1])
    assert np.array_equal(decode(runner, 2, later, 37), after)
    for sid in (1, 2):
        runner.close_stream(sid)
    assert runner.pool.used == 0


def test_per_channel_keys_depend_on_the_cut(dp_export2) -> None:
    runner = load_runner(dp_export2, 0, ByChannelKeys(paged_attention=True))
    x, later = inputs(runner, 37, 1), inputs(runner, 4, 2)
    prefill(runner, 1, x, [37])
    prefill(runner, 2, x, [16, 21])
    assert not np.array_equal(decode(runner, 1, later, 37), decode(runner, 2, later, 37))


@pytest.mark.parametrize("past, k", [(40, 2), (62, 4), (90, 8)])
def test_a_one_query_step_computes_what_single_decode_steps_do(runner, past, k) -> None:
    """The last token and its drafts verified in one step (each its own sequence, across
    a block's end too) give every position's output and the KV after it bit for bit as
    the single steps would; the same tokens as one multi-query step do not."""
    x, fed, after = inputs(runner, past, 3), inputs(runner, k, 4), inputs(runner, 2, 5)
    answer = np.arange(k) if runner.spec.last else None
    outs = {}
    for sid, mode in enumerate(("single", "one_query", "together"), start=1):
        prefill(runner, sid, x, [past])
        if mode == "single":
            got = decode(runner, sid, fed, past)
        else:
            got = runner.step(sid, fed, np.arange(past, past + k), answer,
                              one_query=mode == "one_query").copy()
        outs[mode] = (got, decode(runner, sid, after, past + k))
        assert runner.streams[sid].length == past + k + 2
        runner.close_stream(sid)
    assert np.array_equal(outs["one_query"][0], outs["single"][0])
    assert np.array_equal(outs["one_query"][1], outs["single"][1])
    assert not np.array_equal(outs["together"][0], outs["single"][0])
    assert runner.pool.used == 0


def test_rows_of_a_one_query_step_compute_as_alone(runner) -> None:
    """A row group's one-query step, uniform or ragged (rows of 3 and 1 tokens), gives
    each row what its single decode steps give alone."""
    pasts, counts = [30, 45], [3, 1]
    prompts = [inputs(runner, p, 10 + i) for i, p in enumerate(pasts)]
    feeds = [inputs(runner, c, 20 + i) for i, c in enumerate(counts)]
    want = []
    for sid, (prompt, fed) in enumerate(zip(prompts, feeds, strict=True), start=1):
        prefill(runner, sid, prompt, [prompt.shape[1]])
        want.append(decode(runner, sid, fed, prompt.shape[1]))
        runner.close_stream(sid)
    for sid, prompt in enumerate(prompts, start=1):
        prefill(runner, sid, prompt, [prompt.shape[1]])
    runner.regroup(GROUP, [1, 2])
    x = np.concatenate(feeds, axis=1)
    positions = np.concatenate([np.arange(p, p + c) for p, c in zip(pasts, counts, strict=True)])
    answer = np.arange(sum(counts)) if runner.spec.last else None
    got = runner.step_ragged(GROUP, x, positions, np.array(counts), answer, one_query=True)
    assert np.array_equal(got[:, :3], want[0]) and np.array_equal(got[:, 3:], want[1])
    # uniform rows: each row's two tokens
    uniform = np.concatenate([inputs(runner, 2, 30), inputs(runner, 2, 31)])
    rows = runner.step_rows(GROUP, uniform, np.array([[33, 34], [46, 47]]),
                            np.arange(2) if runner.spec.last else None, one_query=True).copy()
    runner.close_stream(GROUP)
    for sid, (prompt, fed, row) in enumerate(zip(prompts, feeds, uniform, strict=True), start=1):
        prefill(runner, sid, prompt, [prompt.shape[1]])
        decode(runner, sid, fed, prompt.shape[1])
        alone = decode(runner, sid, row[None], prompt.shape[1] + fed.shape[1])
        assert np.array_equal(rows[sid - 1], alone[0])
        runner.close_stream(sid)
    assert runner.pool.used == 0


def test_a_one_query_step_of_fewer_sequences_than_threads_is_padded(dp_export2) -> None:
    """As a decode step: empty padding sequences up to the stage's threads, no token more."""
    runner = load_runner(dp_export2, 0, RuntimeSpec(paged_attention=True))
    runner.threads = 4  # (the machine's may be fewer: the padding follows the attribute)
    prefill(runner, 1, inputs(runner, 20, 1), [20])
    runner.step(1, inputs(runner, 2, 2), np.arange(20, 22), one_query=True)
    assert runner.request.get_input_tensor(0).shape[0] == 2
    assert runner.request.get_tensor("past_lens").data.tolist() == [20, 21, 0, 0]
    assert runner.request.get_tensor("subsequence_begins").data.tolist() == [0, 1, 2, 2, 2]
    runner.step(1, inputs(runner, 4, 3), np.arange(22, 26), one_query=True)
    assert runner.request.get_tensor("past_lens").data.tolist() == [22, 23, 24, 25]
    runner.close_stream(1)


def test_a_one_query_step_padded_to_a_recent_shape_computes_alike(dp_export2) -> None:
    """Padded up to a recent step's token count (a padding sequence of several tokens:
    dataplane.runtime.step_shapes), a one-query step still gives the single steps'
    outputs of a runner that pads nothing."""
    padding, plain = (load_runner(dp_export2, 1, RuntimeSpec(paged_attention=True))
                      for _ in range(2))
    padding.shapes.limit = 8
    x, fed = inputs(padding, 50, 1), inputs(padding, 3, 2)
    prefill(padding, 9, inputs(padding, 8, 3), [8])  # a recent step of 8 tokens
    prefill(padding, 1, x, [50])
    got = padding.step(1, fed, np.arange(50, 53), np.arange(3), one_query=True).copy()
    assert padding.request.get_input_tensor(0).shape[0] == 8  # 3 tokens and 5 of padding
    prefill(plain, 1, x, [50])
    assert np.array_equal(got, decode(plain, 1, fed, 50))


def test_stages_without_paged_attention_refuse_a_one_query_step(dp_export2, tiny_exports
                                                                 ) -> None:
    """The stateful and the static runner compute a step's tokens together: a one-query
    step is refused clearly, and the stream is as it was."""
    from dataplane.runtime.stateful import StageRunner
    from dataplane.runtime.static import StaticStageRunner

    static = StaticStageRunner(tiny_exports.get([(0, 2), (2, 4)], static=(64, 8)), 0)
    for stage in (StageRunner(dp_export2, 0), static):
        assert not stage.one_query_supported
        stage.open_stream(1)
        stage.step(1, np.array([[0, 5, 6]]), np.arange(3))
        with pytest.raises(StageError, match="one-query step .* needs paged attention"):
            stage.step(1, np.array([[7, 8]]), np.arange(3, 5), one_query=True)
        assert stage.streams[1].logical == 3
    paged = load_runner(dp_export2, 1, RuntimeSpec(paged_attention=True))
    assert paged.one_query_supported
    assert not StageChain([load_runner(dp_export2, 0), paged]).one_query_supported
    assert StageChain([load_runner(dp_export2, 0, RuntimeSpec(paged_attention=True)),
                       paged]).one_query_supported


@pytest.mark.slow
def test_smollm2_int8_computes_alike_cut_or_verified(smol) -> None:
    """The default model in INT8 (int8 activations, u8 KV): prompts cut anywhere into
    pieces of two tokens or more, and verification steps of 2-8 tokens, bit for bit."""
    from exporter.export import export_model

    source, root = smol
    export = root / "int8-1"
    if not export.exists():
        export_model(source, [(0, 30)], "int8", export)
    runner = load_runner(export, 0, RuntimeSpec(paged_attention=True))
    x, later = inputs(runner, 300, 1), inputs(runner, 3, 2)
    prefill(runner, 1, x, [300])
    after = decode(runner, 1, later, 300)
    for pieces in ([16, 284], [95, 205], [2, 298]):
        prefill(runner, 2, x, pieces)
        assert np.array_equal(decode(runner, 2, later, 300), after), pieces
    for past, k in ((40, 2), (200, 4), (290, 8)):
        fed = inputs(runner, k, past)
        prefill(runner, 1, x[:, :past], [past])
        single = decode(runner, 1, fed, past)
        prefill(runner, 2, x[:, :past], [past])
        verified = runner.step(2, fed, np.arange(past, past + k), np.arange(k), one_query=True)
        assert np.array_equal(verified, single), (past, k)
    for sid in (1, 2):
        runner.close_stream(sid)


def test_a_cluster_computes_a_one_query_step_on_every_stage(dp_export2) -> None:
    """The ONE_QUERY flag takes the step to the last stage as one: its answer is the
    single steps'; a stage that keeps stateful KV answers it with a clear error, and the
    stream serves on once reset."""
    from dataplane.head.errors import DataPlaneError
    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.stateful import StageRunner
    from tests.helpers.worker import head_and_worker

    config = RuntimeSpec(paged_attention=True)
    local = LocalChain.load(str(dp_export2), config)
    prompt, fed = np.arange(5, 45), np.array([7, 8, 9, 10])
    local.open(1)
    local.reset(1)
    local.step(1, prompt, np.arange(40))
    want = np.concatenate([local.step(1, fed[i:i + 1], np.array([40 + i]), want_logits=True
                                      ).logits for i in range(4)])
    for last in (load_runner(dp_export2, 1, config), StageRunner(dp_export2, 1)):
        with head_and_worker(load_runner(dp_export2, 0, config), last) as (pipe, _):
            assert pipe.one_query_supported
            pipe.open(1)
            pipe.reset(1)
            pipe.step(1, prompt, np.arange(40))
            if last.one_query_supported:
                got = pipe.step(1, fed, np.arange(40, 44), np.arange(4), want_logits=True,
                                one_query=True)
                assert np.array_equal(got.logits, want)
                continue
            with pytest.raises(DataPlaneError, match="one-query step .* needs paged attention"):
                pipe.step(1, fed, np.arange(40, 44), np.arange(4), one_query=True)
            pipe.reset(1)
            pipe.step(1, prompt, np.arange(40))
            assert pipe.step(1, fed[:1], np.array([40])).tokens.shape == (1,)
