"""tools/spec/draft_ceiling: lookup's continuations and the tokens a round trip yields (pure)."""

from __future__ import annotations

import pytest
import typer

from tools.spec.draft_ceiling import (
    ALL,
    ceiling,
    drafts_for,
    lookup_continuations,
    parse_branches,
    tokens_per_round_trip,
)
from zctl.engine.drafting import lookup_draft


def test_continuations_come_longest_suffix_first_most_recent_first_and_distinct() -> None:
    history = [1, 2, 3, 1, 2, 4, 9, 2]
    # suffix [2]: after the 2 at 4 comes 4 9 2 ..., after the 2 at 1 comes 3 1 2 ...
    assert lookup_continuations(history, 3) == [[4, 9, 2], [3, 1, 2]]
    assert lookup_continuations(history, 3)[0] == lookup_draft(history, 3)  # the chain's
    assert lookup_continuations([5, 6, 7], 2) == []  # no suffix seen before
    assert lookup_continuations([1, 1, 1], 3) == [[1, 1, 1]]  # one continuation, once


def test_a_round_trip_yields_its_best_accepted_prefix_plus_one() -> None:
    prompt = [1, 2, 3, 1, 2, 4]
    output = [1, 2, 3, 7]  # after "... 4": lookup has nothing, then "1" -> "2 4" or "2 3"
    chain = tokens_per_round_trip(prompt, output, drafts_for(1), 4)
    tree = tokens_per_round_trip(prompt, output, drafts_for(ALL), 4)
    # chain: [1] nothing drafted; "1" drafts 2 4 (most recent): 2 accepted, then 3; then 7
    assert chain == pytest.approx(4 / 3)
    # every branch: after "1" the branch 2 3 1 ... matches 2 3, so 1, then 2 3 + 7: 2 trips
    assert tree == pytest.approx(4 / 2)
    with pytest.raises(ValueError):
        tokens_per_round_trip(prompt, [], drafts_for(1), 4)


def test_a_periodic_text_goes_k_plus_one_a_round_trip() -> None:
    prompt = [1, 2, 3] * 4
    assert tokens_per_round_trip(prompt, [1, 2, 3] * 5, drafts_for(1), 4) == pytest.approx(5.0)


def test_ceiling_reports_each_branch_count_over_the_chain() -> None:
    outputs = [("a", [1, 2, 3, 1, 2, 4], [1, 2, 3, 7])]
    result = ceiling(outputs, [1, 2, ALL], 4)
    assert result["over_chain"]["1"] == 1.0
    assert result["over_chain"]["all"] == pytest.approx(1.5)
    assert result["prompts"][0]["prompt"] == "a"


def test_parse_branches() -> None:
    assert parse_branches("2,all,2") == [1, 2, ALL]
    for bad in ("0", "x", "-1"):
        with pytest.raises(typer.BadParameter):
            parse_branches(bad)
