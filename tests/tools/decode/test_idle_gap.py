"""tools/decode/idle_gap: its pure summary, and its chain stepping on the tiny model (real
greedy steps in every mode, op counters when asked)."""

from __future__ import annotations

import pytest

from tools.decode.idle_gap import (
    MODES,
    CountingConfig,
    dispatch_us,
    idle,
    mode_of,
    step_chain,
    summarise,
)


def test_summarise_gives_each_modes_extra_time_over_back_to_back() -> None:
    samples = {"back_to_back": [[99.0, 5.0, 5.0, 6.0], [99.0, 4.0, 4.0]],
               "sleep": [[99.0, 5.5, 5.5], [99.0, 4.5, 4.5]],
               "spin": [[99.0, 5.0], [99.0, 4.0]]}
    out = summarise(samples)  # the first sample of each is dropped
    assert out["p50_ms"] == {"back_to_back": [5.0, 4.0], "sleep": [5.5, 4.5], "spin": [5.0, 4.0]}
    assert out["extra_ms_per_step"] == {"sleep": 1.0, "spin": 0.0}
    assert out["ratio"] == {"sleep": 0.9, "spin": 1.0}


def test_modes_rotate_and_an_unknown_mode_is_refused() -> None:
    assert [mode_of(i) for i in range(4)] == [*MODES, MODES[0]]
    idle("back_to_back", 1.0)  # returns at once
    with pytest.raises(ValueError, match="unknown mode 'nap'"):
        idle("nap", 0.0)


def test_step_chain_decodes_greedily_in_every_mode(dp_export2) -> None:
    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.config import RuntimeSpec
    from zctl.engine.scheduler import generate_greedy

    prompt = [0, 17, 42, 99]
    samples = step_chain(LocalChain.load(str(dp_export2), RuntimeSpec()), prompt, 6, 0.0005)
    expected = list(generate_greedy(LocalChain.load(str(dp_export2), RuntimeSpec()), prompt, 7))
    assert samples.tokens == expected
    assert samples.ops == {}
    for mode in MODES:
        assert [len(stage) for stage in samples.wall[mode]] == [2, 2]
        assert all(ms > 0 for stage in samples.wall[mode] for ms in stage)


def test_counted_chain_reports_op_time(dp_export2) -> None:
    from dataplane.head.local_chain import LocalChain

    chain = LocalChain.load(str(dp_export2), CountingConfig())
    samples = step_chain(chain, [3, 1, 4], 3, 0.0, count_ops=True)
    for mode in MODES:  # without the counters the plugin reports no ops: a sum of 0
        assert [len(stage) for stage in samples.ops[mode]] == [1, 1]
        assert all(ms > 0 for stage in samples.ops[mode] for ms in stage)


def test_dispatch_us_times_every_mode() -> None:
    out = dispatch_us(0.0002, reps=9, width=8)
    assert set(out) == set(MODES) and all(v > 0 for v in out.values())
