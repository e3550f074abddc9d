"""PagedStageRunner: a stateful export's stages on PagedAttention give the stateful
stages' tokens (prefill in any chunks, rewinds, row groups, prefixes sharing blocks)."""

from __future__ import annotations

import numpy as np
import pytest

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.base import StageError
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.kv.blocks import BlockPool
from dataplane.runtime.load import load_runner
from dataplane.runtime.paged import PagedStageRunner
from zctl.engine.executor import Step
from zctl.engine.scheduler import StreamScheduler, generate_greedy, generate_speculative, run_sessions
from zctl.engine.sessions import DecodeSession

EXACT = dict(precision="f32", kv_cache_precision="f32", dynamic_quantization=False)
PROMPT = [0, *range(5, 80)]
N = 16


@pytest.fixture(scope="module")
def stateful(dp_export2):
    return LocalChain.load(str(dp_export2), RuntimeSpec(**EXACT))


@pytest.fixture(scope="module")
def paged(dp_export2):
    return LocalChain.load(str(dp_export2), RuntimeSpec(**EXACT, paged_attention=True))


@pytest.fixture(scope="module")
def want(stateful):
    return list(generate_greedy(stateful, PROMPT, N))


def test_load_runner_picks_the_paged_runner(dp_export2) -> None:
    runner = load_runner(dp_export2, 0, RuntimeSpec(paged_attention=True))
    assert isinstance(runner, PagedStageRunner) and runner.block_size > 0
    assert runner.kv_bytes_per_token > 0


@pytest.mark.parametrize("chunk", [None, 7, 32])
def test_greedy_equals_the_stateful_stages(paged, want, chunk) -> None:
    assert list(generate_greedy(paged, PROMPT, N, prefill_chunk=chunk)) == want


def test_rewinds_shorten_the_sequence(paged, want) -> None:
    got = list(generate_speculative(paged, [*PROMPT, *PROMPT[1:20]], N, k=4, prefill_chunk=16))
    assert got == list(generate_greedy(paged, [*PROMPT, *PROMPT[1:20]], N))
    runner = paged.runners[0]
    runner.open_stream(9)
    runner.reset_stream(9)
    runner.step(9, np.array([PROMPT[:10]]), np.arange(10))
    with pytest.raises(StageError, match="cannot rewind 11"):
        runner.mask_tail(9, 11)
    runner.mask_tail(9, 4)
    assert runner.streams[9].length == 6
    runner.close_stream(9)


def test_row_groups_step_every_member_as_its_own_sequence(paged, stateful) -> None:
    prompts = [PROMPT[:30], PROMPT[:50], [0, 3, 4, 5]]
    want = [list(generate_greedy(stateful, p, N, stream_id=40 + i)) for i, p in enumerate(prompts)]
    sessions = [DecodeSession(i, p, N) for i, p in enumerate(prompts)]
    list(run_sessions(paged, sessions, row_groups=1))
    assert [s.emitted for s in sessions] == want
    assert all(not r.groups and not r.streams for r in paged.runners)  # all freed
    assert all(r.pool.used == 0 for r in paged.runners)


def test_padded_steps_give_the_tokens_of_unpadded_ones(dp_export2, stateful) -> None:
    """Rows leave the group at different steps, so later steps are padded up to the
    earlier size (dataplane.runtime.step_shapes): the tokens are those of each stream alone."""
    chain = LocalChain.load(str(dp_export2), RuntimeSpec(**EXACT, paged_attention=True))
    pads: list[int] = []
    for runner in chain.runners:
        runner.shapes.limit = 8
        runner.shapes.pad = lambda t, pad=runner.shapes.pad: pads.append(pad(t)) or pads[-1]
    prompts = [PROMPT[:30], PROMPT[:50], [0, 3, 4, 5], PROMPT[:12]]
    lengths = [16, 5, 9, 12]
    want = [list(generate_greedy(stateful, p, n, stream_id=60 + i))
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    sessions = [DecodeSession(i, p, n) for i, (p, n) in enumerate(zip(prompts, lengths,
                                                                      strict=True))]
    list(run_sessions(chain, sessions, row_groups=1))
    assert [s.emitted for s in sessions] == want
    assert sum(1 for p in pads if p) >= 4  # both stages padded the steps after rows left
    assert all(r.pool.used == 0 and not r.streams and not r.groups for r in chain.runners)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_padded_step_answers_as_the_unpadded_one(dp_export2, stage) -> None:
    """A row leaves a group of 4: the padded runner's 3-row step (hidden states of stage 0,
    logits of the last stage) equals the unpadded runner's."""
    runners = [load_runner(dp_export2, stage, spec(**EXACT, paged_attention=True))
               for spec in (RuntimeSpec, DecodeStepsUnpadded)]
    runners[0].shapes.limit = 4
    rng = np.random.default_rng(3)
    hidden = runners[0].hidden_size

    def x_of(rows, tokens):
        if stage == 0:
            return rng.integers(5, 200, size=(rows, tokens))
        return rng.standard_normal((rows, tokens, hidden)).astype(np.float32)

    prompts = [x_of(1, n) for n in (7, 12, 3, 9)]
    steps = [x_of(4, 1), x_of(3, 1)]
    outs = []
    for runner in runners:
        for sid, prompt in enumerate(prompts):
            runner.open_stream(sid)
            runner.step(sid, prompt, np.arange(prompt.shape[1]))
        runner.regroup(100, [0, 1, 2, 3])
        lengths = [p.shape[1] for p in prompts]
        runner.step_rows(100, steps[0], np.array(lengths)[:, None])
        runner.regroup(100, [0, 1, 2])
        outs.append(runner.step_rows(100, steps[1], np.array(lengths[:3])[:, None] + 1).copy())
    assert runners[0].shapes.pad(3) == 1 and runners[1].shapes.pad(3) == 0  # it was padded
    assert outs[0].shape == outs[1].shape
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_no_step_is_padded_beyond_the_scratch_block(dp_export2) -> None:
    """A limit past the scratch block's size (warm_up never sets one) pads nothing: the
    stream's next steps answer as on a runner that never pads."""
    runners = [load_runner(dp_export2, 0, RuntimeSpec(**EXACT, paged_attention=True))
               for _ in range(2)]
    runners[0].shapes.limit = 4 * runners[0].block_size
    big = runners[0].block_size + 8
    outs = []
    for runner in runners:
        runner.open_stream(1)
        runner.step(1, np.arange(5, 5 + big)[None], np.arange(big))
        steps = [runner.step(1, np.array([[7 + i]]), np.array([big + i])).copy()
                 for i in range(3)]  # the first would pad by block_size + 7
        outs.append(np.concatenate(steps, axis=1))
        runner.close_stream(1)
        assert runner.pool.used == 0
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)


class DecodeStepsUnpadded(RuntimeSpec):
    pad_decode_steps = False


@pytest.mark.parametrize("stage", [0, 1])
def test_a_long_step_runs_in_its_bucket_and_answers_as_unpadded(
        dp_export2, stage, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 70-token prompt runs as 72 tokens (dataplane.runtime.step_shapes.bucket_pad); its output
    and the next steps' equal a runner's that never pads."""
    import dataplane.runtime.paged as paged

    runners = [load_runner(dp_export2, stage, spec(**EXACT, paged_attention=True))
               for spec in (RuntimeSpec, DecodeStepsUnpadded)]
    rng = np.random.default_rng(5)
    hidden = runners[0].hidden_size
    prompt = (rng.integers(5, 200, size=(1, 70)) if stage == 0
              else rng.standard_normal((1, 70, hidden)).astype(np.float32))
    nexts = [prompt[:, i:i + 1] for i in range(3)]
    outs, ran = [], []
    for runner, pads in zip(runners, (True, False), strict=True):
        if not pads:
            monkeypatch.setattr(paged, "bucket_pad", lambda tokens, most: 0)
        runner.open_stream(1)
        first = runner.step(1, prompt, np.arange(70)).copy()
        ran.append(runner.request.get_input_tensor(0).shape[0])
        later = [runner.step(1, x, np.array([70 + i])).copy() for i, x in enumerate(nexts)]
        outs.append([first, *later])
        runner.close_stream(1)
        assert runner.pool.used == 0
    assert ran == [72, 70]
    for padded, plain in zip(*outs, strict=True):
        assert padded.shape == plain.shape
        np.testing.assert_allclose(padded, plain, rtol=1e-4, atol=1e-4)


def test_warm_up_measures_the_padding_limit_and_keeps_nothing(dp_export2) -> None:
    runner = load_runner(dp_export2, 1, RuntimeSpec(paged_attention=True))
    runner.warm_up()
    assert 0 <= runner.shapes.limit <= runner.block_size
    assert not runner.streams and runner.pool.used == 0


def _prefill(chain, stream, tokens, start=0):
    chain.open(stream)
    if not start:
        chain.reset(stream)
    reply = chain.step(stream, np.array(tokens[start:]), np.arange(start, len(tokens)))
    return int(reply.tokens[-1])


def test_a_loaded_prefix_gives_the_tokens_of_a_full_prefill(paged, stateful) -> None:
    text = [0, *range(100, 180)]
    first = _prefill(paged, 1, text)
    for runner in paged.runners:
        runner.save_prefix(1, 77, len(text))
    assert all(r.prefix_bytes() > 0 for r in paged.runners)
    follow = [*text, first, 7, 8, 9]
    want = list(generate_greedy(stateful, follow, 8, stream_id=3))
    for length in (len(text), 45):  # the whole entry, and one ending inside a block
        paged.open(2)
        paged.reset(2)
        for runner in paged.runners:
            runner.load_prefix(2, 77, length)
        session = DecodeSession(2, follow, 8)
        session.skip_prefix(length)
        scheduler = StreamScheduler(paged)
        scheduler.sessions[2] = session  # already reset and loaded: schedule it as it is
        while scheduler.active:
            scheduler.poll()
        assert session.emitted == want
    # the source stream is intact: its blocks were shared, and copied before being written
    assert _prefill(stateful, 8, text) == first
    after = stateful.step(8, np.array([first]), np.array([len(text)]))
    reply = paged.step(1, np.array([first]), np.array([len(text)]))
    assert int(reply.tokens[-1]) == int(after.tokens[-1])
    stateful.close_stream(8)
    for runner in paged.runners:
        runner.drop_all_prefixes()
        assert runner.prefix_bytes() == 0
    paged.close_stream(1)
    paged.close_stream(2)


def test_bad_prefix_operations_are_refused(paged) -> None:
    runner = paged.runners[0]
    runner.open_stream(5)
    runner.reset_stream(5)
    with pytest.raises(StageError, match="not held"):
        runner.load_prefix(5, 12345, 4)
    runner.step(5, np.array([PROMPT[:10]]), np.arange(10))
    with pytest.raises(StageError, match="cannot keep 11"):
        runner.save_prefix(5, 1, 11)
    runner.save_prefix(5, 1, 10)
    with pytest.raises(StageError, match="holding 10"):
        runner.load_prefix(5, 1, 4)  # not reset first
    with pytest.raises(StageError, match="not open"):
        runner.save_prefix(999, 1, 1)
    runner.drop_prefix(1)
    runner.drop_prefix(1)  # unknown ids: no error
    runner.close_stream(5)
    assert runner.pool.used == 0


def test_the_cache_grows_when_its_blocks_run_out(dp_export2, want) -> None:
    config = RuntimeSpec(**EXACT, paged_attention=True)
    runners = [PagedStageRunner(dp_export2, i, config, blocks=1) for i in range(2)]
    chain = LocalChain(runners)
    assert list(generate_greedy(chain, PROMPT, N)) == want
    assert runners[0].pool.capacity > 1


def test_the_block_pool_counts_references() -> None:
    pool = BlockPool(2)
    a, b = pool.alloc(), pool.alloc()
    assert (a, b) == (0, 1) and pool.alloc() is None
    pool.retain([a])
    assert pool.shared(a) and not pool.shared(b)
    pool.release([a, a])
    with pytest.raises(ValueError):
        pool.release([a])
    pool.grow(4)
    assert pool.capacity == 4 and pool.used == 1
    assert pool.alloc() == 0


def test_a_cluster_of_paged_stages_serves_streams_and_row_groups(dp_export2, stateful) -> None:
    from dataplane.head.cluster_head import ClusterHead
    from dataplane.worker.stage_worker import StageWorker

    config = RuntimeSpec(**EXACT, paged_attention=True)
    pipe = ClusterHead(PagedStageRunner(dp_export2, 0, config), "tcp://127.0.0.1:1",
                       "tcp://127.0.0.1:*", timeout_s=10)
    worker = StageWorker(PagedStageRunner(dp_export2, 1, config), "tcp://127.0.0.1:*",
                         pipe.reply_endpoint)
    pipe.rewire(worker.endpoint)
    worker.start()
    try:
        prompts = [PROMPT, PROMPT[:40], [0, 9, 8, 7]]
        want = [list(generate_greedy(stateful, p, N, stream_id=50 + i, prefill_chunk=8))
                for i, p in enumerate(prompts)]
        assert list(generate_greedy(pipe, PROMPT, N, prefill_chunk=8)) == want[0]
        sessions = [DecodeSession(i, p, N, prefill_chunk=8) for i, p in enumerate(prompts)]
        list(run_sessions(pipe, sessions, row_groups=1))
        assert [s.emitted for s in sessions] == want
    finally:
        worker.stop()
        pipe.close()


def test_ragged_rows_on_a_stateful_stage_are_refused_clearly(dp_export2, stateful) -> None:
    """A ragged step reaching a stage that keeps stateful KV (a mixed cluster) fails with a
    clear error and leaves the stage serving; stage 0 refuses one before sending it."""
    from dataplane.head.cluster_head import ClusterHead
    from dataplane.head.errors import DataPlaneError
    from dataplane.runtime.stateful import StageRunner
    from dataplane.worker.stage_worker import StageWorker

    config = RuntimeSpec(**EXACT, paged_attention=True)
    pipe = ClusterHead(PagedStageRunner(dp_export2, 0, config), "tcp://127.0.0.1:1",
                       "tcp://127.0.0.1:*", timeout_s=10)
    worker = StageWorker(StageRunner(dp_export2, 1, RuntimeSpec(**EXACT)), "tcp://127.0.0.1:*",
                         pipe.reply_endpoint)
    pipe.rewire(worker.endpoint)
    worker.start()
    try:
        for sid in (1, 2):
            pipe.open(sid)
            pipe.reset(sid)
            pipe.step(sid, np.array(PROMPT[:5]), np.arange(5))
        pipe.regroup(70, [1, 2])
        rid = pipe.submit(Step(70, np.array([5, 6, 7]), np.array([5, 5, 6]),
                               row_tokens=np.array([1, 2])))
        with pytest.raises(DataPlaneError, match="ragged rows .* need paged attention"):
            pipe.collect(rid)
        want = list(generate_greedy(stateful, PROMPT[:30], 4, stream_id=80))
        pipe.regroup(70, [])  # the broken group disbands; streams still serve
        assert list(generate_greedy(pipe, PROMPT[:30], 4, stream_id=9)) == want
    finally:
        worker.stop()
        pipe.close()
    head = StageRunner(dp_export2, 0, RuntimeSpec(**EXACT))
    for sid in (1, 2):
        head.open_stream(sid)
        head.step(sid, np.array([PROMPT[:3]]), np.arange(3))
    head.regroup(71, [1, 2])
    from dataplane.worker.hop import compute_step
    with pytest.raises(StageError, match="need paged attention"):
        compute_step(head, 71, np.zeros((1, 3), np.int64), np.arange(3), 0, np.zeros(0, np.int64),
                     row_tokens=np.array([1, 2]))


def test_paged_attention_is_a_cpu_runtime(dp_export2) -> None:
    from zctl.launcher.processes import runtime_spec

    assert runtime_spec("f32", None, "CPU").paged_attention
    assert not runtime_spec("f32", None, "GPU.1").paged_attention  # GPU: the stateful KV
    assert not runtime_spec("f32", None, "CPU", paged_attention=False).paged_attention
    with pytest.raises(StageError, match="CPU plugin only"):
        PagedStageRunner(dp_export2, 0, RuntimeSpec(device="GPU", paged_attention=True))


def test_a_ragged_step_computes_each_row_as_its_own_step(paged) -> None:
    """Rows of different token counts in one inference (a decoding row beside a prompt's
    chunk) give each row the logits it gets stepped alone."""
    a, b = PROMPT[:20], PROMPT[:45]
    alone = {}
    for sid, tokens in ((50, a), (51, b)):
        paged.open(sid)
        paged.reset(sid)
        alone[sid] = paged.step(sid, np.array(tokens), np.arange(len(tokens)),
                                np.arange(len(tokens)), want_logits=True)
        paged.close_stream(sid)
    for sid, tokens in ((52, a[:19]), (53, b[:30])):  # row 52 decodes, 53 prefills on
        paged.open(sid)
        paged.reset(sid)
        paged.step(sid, np.array(tokens), np.arange(len(tokens)))
    paged.regroup(60, [52, 53])
    ids = np.array([a[19], *b[30:]])
    positions = np.array([19, *range(30, 45)])
    reply = paged.step(60, ids, positions, want_logits=True, row_tokens=np.array([1, 15]))
    assert reply.logits.shape[0] == 2
    np.testing.assert_allclose(reply.logits[0], alone[50].logits[-1], atol=1e-4)
    np.testing.assert_allclose(reply.logits[1], alone[51].logits[-1], atol=1e-4)
    # logits_idx indexes the whole step: every token of row 53's chunk, none of 52's
    paged.rewind(60, np.array([1, 15]))
    reply = paged.step(60, ids, positions, np.arange(1, 16), want_logits=True,
                       row_tokens=np.array([1, 15]))
    np.testing.assert_allclose(reply.logits, alone[51].logits[30:45], atol=1e-4)
    runner = paged.runners[0]
    with pytest.raises(StageError, match="positive token count per row"):
        runner.step_ragged(60, ids[None], positions, np.array([16]))
    with pytest.raises(StageError, match="takes x"):
        runner.step_ragged(60, ids[None], positions, np.array([2, 15]))
    assert [s.length for s in runner.groups[60].seqs] == [20, 45]  # refused: nothing changed
    paged.close_stream(60)
    assert all(r.pool.used == 0 for r in paged.runners)



@pytest.mark.parametrize("padded", [True, False])
def test_a_decode_step_carries_a_padding_sequence_so_a_row_computes_alike(dp_export2, padded
                                                                          ) -> None:
    """By default a decode step of fewer sequences than the stage's threads carries empty
    padding sequences up to that many, so the CPU plugin computes its attention as it
    does a row group's (else it splits a lone sequence's along the past): a lone stream's
    output equals, bit for bit, the same step as one row of a group, and the step runs
    no token more."""
    spec = RuntimeSpec if padded else DecodeStepsUnpadded
    runner = load_runner(dp_export2, 0, spec(paged_attention=True))  # default numerics
    prompt = np.array([[0, *range(5, 200), *range(5, 100)]])
    n = prompt.shape[1]

    def prefilled(sid: int) -> None:
        runner.open_stream(sid)
        runner.step(sid, prompt, np.arange(n))

    prefilled(1)
    alone = runner.step(1, np.array([[7]]), np.array([n])).copy()
    ran = runner.request.get_input_tensor(0).shape[0]
    sequences = runner.request.get_tensor("past_lens").shape[0]
    runner.close_stream(1)
    rows = []
    for others in (1, 7):
        sids = [1, *range(10, 10 + others)]
        for sid in sids:
            prefilled(sid)
        runner.regroup(1 << 30, sids)
        rows.append(runner.step_rows(1 << 30, np.full((len(sids), 1), 7),
                                     np.full((len(sids), 1), n))[0].copy())
        runner.close_stream(1 << 30)
    assert ran == 1 and sequences == (max(runner.threads, 1) if padded else 1)
    assert np.array_equal(rows[0], rows[1])  # 2 rows or 8: alike
    if padded:
        assert np.array_equal(alone[0], rows[0])
    assert runner.pool.used == 0
