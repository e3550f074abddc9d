"""Adaptive K by hindsight: the replay of "always draft K" over measured draft matches,
the choice of K from it, and the record of what a replayable drafter would have matched."""

from __future__ import annotations

import numpy as np
import pytest

from zctl.engine.drafting import LookupDrafter, StepCost
from zctl.engine.executor import StepReply
from zctl.engine.hindsight import NO_DRAFT, DraftHindsight, best_fixed_k, walk_ms_per_token
from zctl.engine.sessions import DecodeSession

FLAT = StepCost(step_ms=10.0, token_ms=1.0)


def test_the_walk_steps_over_accepted_drafts_and_prices_width_changes() -> None:
    matches = [NO_DRAFT, 3, 2, 1, 0, 0, NO_DRAFT]
    # K = 0: seven 1-token steps
    assert walk_ms_per_token(matches, 0, FLAT) == pytest.approx(10.0)
    # K = 2: no draft (10); at the 3, 2 accepted (12), landing on the first 0; 0
    # accepted twice (12 each); no draft (10): 56 ms for 7 tokens
    assert walk_ms_per_token(matches, 2, FLAT) == pytest.approx(56 / 7)
    switching = StepCost(step_ms=10.0, token_ms=1.0, switch_ms=5.0)  # 2 width changes
    assert walk_ms_per_token(matches, 2, switching) == pytest.approx((56 + 10) / 7)
    # the last step yields all its accepted drafts, though they run past the window
    assert walk_ms_per_token([5], 5, FLAT) == pytest.approx(15 / 6)
    with pytest.raises(ValueError, match="no positions"):
        walk_ms_per_token([], 1, FLAT)


def test_best_k_follows_the_runs_the_hops_and_the_width_changes() -> None:
    runs = [7, 6, 5, 4, 3, 2, 1, 0] * 4
    # long runs behind a long step: draft them whole
    assert best_fixed_k(runs, StepCost(step_ms=200.0, token_ms=0.5), k_max=16) == 7
    misses = [0, NO_DRAFT, 0, 0, NO_DRAFT] * 6
    assert best_fixed_k(misses, StepCost(10.0, 1.0), k_max=16) == 0  # never right: no drafts
    # a change of width must pay for itself over the horizon: at width 4 already, K = 3
    # holds where from 1-token steps a cheaper short K would be chosen
    mixed = [2, 1, 0, 0, 3, 2, 1, 0, NO_DRAFT] * 4
    cost = StepCost(step_ms=10.0, token_ms=2.0, switch_ms=20.0)
    scores = {k: walk_ms_per_token(mixed, k, cost) for k in range(6)}
    assert min(scores, key=scores.get) != 3  # alone, K = 3 is not the fastest replay
    assert best_fixed_k(mixed, cost, k_max=5, width=4, horizon=4) == 3
    with pytest.raises(ValueError, match="k_max"):
        best_fixed_k(runs, FLAT, k_max=1, k_min=2)


class Scripted:
    """Drafts from a table: position -> draft (none elsewhere)."""

    replayable = True

    def __init__(self, drafts: dict[int, list[int]]) -> None:
        self.drafts = drafts

    def propose(self, history, k):
        return self.drafts.get(len(history), [])[:k]

    def accept(self, n):
        pass


def test_hindsight_records_each_positions_match_in_order() -> None:
    # history 0..9; position p's draft predicts history[p:]: at 3 three right then a
    # wrong one, at 5 wrong at once, at 6 right so far
    drafts = {3: [3, 4, 5, 99], 5: [42], 6: [6, 7, 8, 9]}
    hindsight = DraftHindsight(Scripted(drafts), k_max=4)
    history = list(range(3))
    hindsight.observe(history)  # starts at position 3
    assert list(hindsight.matches) == [] and hindsight.recent == [4]  # holds: counted whole
    for token in range(3, 8):
        history.append(token)
        hindsight.observe(history)
    # 3: matched 3 then refuted; 4: none; 5: 0; 6 and 7 not refuted: whole drafts, not
    # resolved (6 right so far, 7 no draft but waits behind 6, in order); 8 current
    assert list(hindsight.matches) == [3, NO_DRAFT, 0]
    assert hindsight.recent == [3, NO_DRAFT, 0, 4, NO_DRAFT, NO_DRAFT]
    history += [8, 9]
    hindsight.observe(history)
    assert list(hindsight.matches) == [3, NO_DRAFT, 0, 4] + [NO_DRAFT] * 4  # 7 to 10
    assert hindsight.ready()
    hindsight.reset()
    assert hindsight.recent == list(hindsight.matches)  # the samples stay true


def test_the_window_keeps_the_latest_positions() -> None:
    hindsight = DraftHindsight(Scripted({}), k_max=2, window=5)
    history = [1]
    hindsight.observe(history)
    for _ in range(20):
        history.append(1)
        hindsight.observe(history)
    assert list(hindsight.matches) == [NO_DRAFT] * 5 and len(hindsight.recent) == 5


def copy_run_target(prompt: list[int], n: int) -> list[int]:
    """The target's greedy output: the prompt's last 12 tokens backwards (lookup drafts
    the prompt's order there: every draft misses), then the prompt over again."""
    return prompt[::-1][:12] + (prompt * 8)[:n - 12]


def drive(session: DecodeSession, target: list[int], compute_ms: float = 0.0) -> None:
    """Run a session against a target that emits ``target`` (greedy, exact replies),
    each step's stages reporting ``compute_ms`` (0: the steps are all hops)."""
    session.plan()
    session.advance(StepReply(tokens=np.array([target[0]])))
    while not session.done:
        plan = session.plan()
        done = len(session.emitted)
        fed = len(plan.token_ids)
        session.advance(StepReply(tokens=np.array(target[done:done + fed]),
                                  stage_ms=[compute_ms]))


def test_auto_k_drafts_the_copied_run_after_early_misses() -> None:
    # the early drafts all miss: a per-token acceptance estimate then keeps K at 0 but
    # for its probes; the copied run that follows is seen at once in hindsight
    prompt = [int(t) for t in np.random.default_rng(3).permutation(500)[:40]]
    target = copy_run_target(prompt, 100)
    cost = StepCost(step_ms=60.0, token_ms=0.5, switch_ms=6.0)  # hops dominate the step
    session = DecodeSession(0, prompt, 100, k=16, drafter=LookupDrafter(), cost=cost)
    drive(session, target)
    assert session.emitted == target
    assert session.spec.steps <= 30  # one token a step would be 99
    assert max(session.k_used[15:]) == 16


def test_auto_k_stays_off_where_drafts_never_match() -> None:
    prompt = list(range(30))
    target = [1000 + i for i in range(60)]  # never what lookup proposes
    session = DecodeSession(0, prompt, 60, k=8, drafter=LookupDrafter(),
                            cost=StepCost(step_ms=40.0, token_ms=2.0, switch_ms=5.0))
    drive(session, target)
    assert session.emitted == target
    assert sum(session.k_used[10:]) == 0  # and no probes: the replay learns at K = 0


@pytest.mark.parametrize(("compute_ms", "replayed"), [(1e6, False), (0.0, True)])
def test_the_replay_decides_only_where_hops_dominate_the_step(monkeypatch, compute_ms,
                                                              replayed) -> None:
    # steps that are all the stages' compute (a LAN) keep the per-token estimate and its
    # probes; steps that are mostly hops (compute 0 here) take the replay's K
    import zctl.engine.sessions as sessions

    calls = []

    def spy(*args, **kwargs):
        calls.append(args)
        return best_fixed_k(*args, **kwargs)

    monkeypatch.setattr(sessions, "best_fixed_k", spy)
    prompt = [int(t) for t in np.random.default_rng(3).permutation(500)[:40]]
    session = DecodeSession(0, prompt, 60, k=8, drafter=LookupDrafter(),
                            cost=StepCost(step_ms=60.0, token_ms=0.5, switch_ms=7.0))
    target = copy_run_target(prompt, 60)
    drive(session, target, compute_ms)
    assert session.emitted == target
    assert bool(calls) is replayed
