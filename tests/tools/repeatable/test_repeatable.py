"""The repeatability benchmark (tools.repeatable): its arithmetic and options (fast), and
its cases on the tiny model, where the repeatable setting must give every output again."""

from __future__ import annotations

import pytest

from dataplane.runtime.config import RuntimeSpec
from tools.repeatable.cases import agreement, batches, run_cases
from tools.repeatable.costs import summarize
from tools.repeatable.prompts import PROMPTS
from tools.repeatable.report import targets, worst_cost
from tools.repeatable.settings import SETTINGS, TodaySpec, parse_settings
from zctl.engine.core import GenerationEngine
from zctl.engine.prefill_pieces import CANONICAL


def test_agreement_counts_outputs_equal_token_for_token() -> None:
    got = agreement([[1, 2], [3], [4, 5]], [[1, 2], [3, 9], [4, 5]])
    assert got == {"identical": 2, "of": 3, "fraction": 2 / 3, "differ": [1]}
    assert agreement([], [])["fraction"] is None
    with pytest.raises(ValueError, match="2 outputs for 1"):
        agreement([[1], [2]], [[1]])


def test_batches_cut_in_order() -> None:
    assert batches(list(range(5)), 2) == [[0, 1], [2, 3], [4]]


def test_settings_put_todays_first_and_refuse_unknown_names() -> None:
    assert [s.name for s in parse_settings("exact,repeatable")] == ["today", "exact", "repeatable"]
    assert [s.name for s in parse_settings("today")] == ["today"]
    with pytest.raises(ValueError, match="fastest"):
        parse_settings("repeatable,fastest")


def test_today_keeps_the_runtime_and_scheduling_before_repeatability() -> None:
    """Today's: per-channel keys, decode steps unpadded, prompts cut anywhere, drafts
    verified together; the repeatable setting is the default runtime and engine."""
    today, repeatable = SETTINGS["today"], SETTINGS["repeatable"]
    assert isinstance(today.runtime(), TodaySpec) and not today.runtime().pad_decode_steps
    assert "KEY_CACHE_QUANT_MODE" not in today.runtime().properties()
    assert not today.pieces.on and not today.one_query
    assert type(repeatable.runtime()) is RuntimeSpec and repeatable.one_query
    assert repeatable.pieces == CANONICAL == GenerationEngine.__init__.__kwdefaults__[
        "prefill_pieces"]
    assert repeatable.runtime().properties()["KEY_CACHE_QUANT_MODE"] == "BY_TOKEN"
    assert today.numerics != repeatable.numerics  # compiled apart: the keys differ
    assert {**today.runtime().properties(), "KEY_CACHE_QUANT_MODE": "BY_TOKEN"} == \
        repeatable.runtime().properties()  # the same numerics otherwise
    assert SETTINGS["exact"].runtime().exact


def test_prompts_vary_in_length_and_share_starts() -> None:
    assert len(PROMPTS) == 20 and len(set(PROMPTS)) == 20
    lengths = sorted(len(p) for p in PROMPTS)
    assert lengths[0] < 10 and lengths[-1] > 1000
    starts = [p[:60] for p in PROMPTS]
    assert max(starts.count(s) for s in starts) >= 3


def test_costs_are_medians_and_paired_ratios() -> None:
    samples = {"today": [{"ttft_ms": 10.0, "tok_s": 100.0}, {"ttft_ms": 20.0, "tok_s": 50.0},
                         {"ttft_ms": 30.0, "tok_s": 80.0}],
               "repeatable": [{"ttft_ms": 11.0, "tok_s": 95.0}, {"ttft_ms": 22.0, "tok_s": 45.0},
                              {"ttft_ms": 30.0, "tok_s": 80.0}]}
    got = summarize(samples, "today")
    assert got["rounds"] == 3 and got["medians"]["today"] == {"ttft_ms": 20.0, "tok_s": 80.0}
    assert got["vs_today"]["repeatable"]["ttft_ms"] == pytest.approx(1.1)
    assert got["vs_today"]["repeatable"]["tok_s"] == pytest.approx(0.95)
    assert worst_cost(got["vs_today"]["repeatable"]) == pytest.approx(
        {"decode": 0.05, "ttft": 0.1})
    # a baseline round that measured nothing leaves nothing to compare against
    samples["today"][1]["tok_s"] = 0.0
    with pytest.raises(ValueError, match="nothing to compare against"):
        summarize(samples, "today")


def test_targets_take_the_worst_model() -> None:
    case = {"identical": 3, "of": 4, "fraction": 0.75, "differ": [2]}
    whole = {"identical": 4, "of": 4, "fraction": 1.0, "differ": []}
    models = {"a": {"cases": {"repeatable": {"cached": whole, "lookup": case}},
                    "costs": {"vs_today": {"repeatable": {"ttft_ms": 1.02, "tok_s": 0.97}}}},
              "b": {"cases": {"repeatable": {"cached": whole}}}}
    got = targets(models, "repeatable")
    assert got["identical_cached"]["met"] is True
    assert got["identical_lookup"] == {"target": "every output identical to the reference",
                                       "value": 0.75, "met": False}
    assert got["decode_cost"]["value"] == pytest.approx(0.03) and got["decode_cost"]["met"]
    assert got["ttft_cost"]["value"] == pytest.approx(0.02) and got["ttft_cost"]["met"]


@pytest.fixture(scope="module")
def tiny_lab(tiny_exports):
    from tools.repeatable.lab import Lab

    export = tiny_exports.get([(0, 2), (2, 4)], weights="int8")
    return Lab(export, [SETTINGS["today"], SETTINGS["repeatable"]])


def test_the_repeatable_setting_gives_every_output_again(tiny_lab) -> None:
    # cold and cached (whole prompts and shared starts), a follow-up turn, 8 at a time in
    # row groups, with prompt lookup, streamed, and replayed after an outage: token for
    # token the reference
    got = run_cases(tiny_lab, "repeatable", PROMPTS, 16,
                    ["cached", "follow_up", "concurrent", "lookup", "streamed", "healed"])
    assert {case: r["fraction"] for case, r in got.items()} == {
        "cached": 1.0, "shared_prefix": 1.0, "follow_up": 1.0, "concurrent": 1.0,
        "lookup": 1.0, "streamed": 1.0, "healed": 1.0}
    assert got["lookup"]["of"] == 20
    assert got["healed"]["outages"] == len(batches(PROMPTS, 8))  # one per batch


def test_an_unknown_case_is_refused(tiny_lab) -> None:
    with pytest.raises(ValueError, match="unknown case"):
        run_cases(tiny_lab, "today", PROMPTS[:1], 4, ["cached", "warm"])
