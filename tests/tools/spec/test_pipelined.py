"""tools/spec/pipelined's figures (pure): system order, paired ratios, identity, means."""

from __future__ import annotations

import pytest
import typer

from tools.spec.pipelined import (
    Sample,
    all_true,
    parse_systems,
    prompt_entry,
    same_as,
    summary,
)


def runs(*tok_s: float, tokens=(1, 2, 3)) -> list[Sample]:
    return [Sample(t, list(tokens)) for t in tok_s]


def test_systems_are_parsed_in_order() -> None:
    assert parse_systems("genai, plain") == ["plain", "genai"]
    for bad in ("", "plain,magic"):
        with pytest.raises(typer.BadParameter):
            parse_systems(bad)


def test_ratios_pair_runs_and_identity_compares_with_plain() -> None:
    samples = {"plain": runs(40.0, 50.0), "spec": runs(44.0, 55.0),
               "pipelined": runs(60.0, 75.0, tokens=(1, 2, 4)), "genai": runs(50.0, 50.0)}
    entry = prompt_entry("p", samples)
    assert entry["pipelined_over_plain"] == pytest.approx(1.5)
    assert entry["pipelined_over_genai_one_core"] == pytest.approx(1.35)
    assert entry["identical"] is False and entry["identical_by_system"]["spec"] is True
    assert same_as(samples, "missing") is None and all_true([None, None]) is None
    other = prompt_entry("q", {**samples, "pipelined": runs(80.0, 100.0)})
    head = summary([entry, other], ["plain", "spec", "pipelined", "genai"])
    assert head["identical"] is False
    assert head["pipelined_over_plain"] == pytest.approx(1.75)
    assert head["mean_tok_s"]["plain"] == 45.0


def test_a_system_left_out_has_no_ratio() -> None:
    entry = prompt_entry("p", {"plain": runs(40.0), "genai": runs(50.0)})
    assert entry["pipelined_over_plain"] is None and entry["plain_over_genai_one_core"] == 0.8
    assert summary([entry], ["plain", "genai"])["pipelined_over_plain"] is None
