"""The coordinator's step as a profile times it: the real engine on stages that answer at
once, their frames made as the data plane makes them."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from controlplane.engine_step import InstantStages, time_engine, write_tokenizer
from controlplane.planner.profile import ROWS, ProfileError
from zctl.engine.core import GenerationEngine
from zctl.engine.requests import GenerationDone, GenerationRequest
from zctl.engine.tokenizer import ChatTokenizer


def test_the_engine_steps_each_row_count_and_a_step_costs_more_with_more_rows() -> None:
    figures = time_engine(hidden=64, vocab=384, runs=3, steps=10)
    assert len(figures) == len(ROWS) and all(0 < f < 0.05 for f in figures)
    assert figures[-1] > figures[0]  # eight rows' tokens cost more than one's


def test_the_instant_stages_answer_every_row_and_the_engine_streams_their_tokens(
        tmp_path: Path) -> None:
    write_tokenizer(tmp_path, 50)
    stages = InstantStages(hidden=8, vocab=50, far_s=0.0)
    engine = GenerationEngine(ChatTokenizer(tmp_path), [], lambda: stages, max_streams=4,
                              row_groups=1, vocab_size=50)
    for i in range(3):
        engine.submit(i, GenerationRequest(f"r{i}", max_tokens=6, chat=False, ignore_eos=True,
                                           temperature=0.0, prompt_ids=[10 * i + 1, 10 * i + 2]))
    done = {}
    try:
        for _ in range(1000):
            for client, event in engine.poll(0.0):
                if isinstance(event, GenerationDone):
                    done[client] = event
            if len(done) == 3:
                break
    finally:
        stages.close()
    assert all(not d.error for d in done.values())
    # each token is the one before it plus one, modulo the vocabulary
    assert [done[i].tokens for i in range(3)] == [
        list(np.arange(10 * i + 3, 10 * i + 9) % 50) for i in range(3)]
    assert stages.steps >= 6


def test_impossible_figures_are_refused() -> None:
    with pytest.raises(ProfileError, match="vocab >= 2"):
        time_engine(hidden=64, vocab=1)


def test_a_stage_run_in_each_step_is_left_out_of_the_engines_figure() -> None:
    slept = []

    def stage(rows: int) -> None:
        slept.append(rows)
        time.sleep(0.002)

    figures = time_engine(hidden=64, vocab=384, runs=2, steps=4, stage=stage)
    assert set(slept) == set(ROWS)  # run at every row count
    # 2 ms a step of sleep in the stage, and as long again waiting for the later stages:
    # neither is the engine's
    assert all(f < 0.002 for f in figures)

