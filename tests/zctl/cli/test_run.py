"""``zctl run``'s sampling options: left out, they are the model's defaults (None on the
request); given, each overrides its own field; checked before a cluster starts; the
report says what the engine sampled with."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from zctl.cli.app import app
from zctl.cli.run import check_sampling, prediction_report, sampling_report
from zctl.engine.requests import (
    FROM_GENERATION_CONFIG,
    FROM_LLAMA_SERVER,
    GenerationRequest,
    Sampling,
)


def test_options_left_out_are_the_models_defaults() -> None:
    fields = check_sampling(None, None, None, None)
    assert fields == {"temperature": None, "top_k": None, "top_p": None, "min_p": None,
                      "seed": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                      "repetition_penalty": None}
    one = check_sampling(None, 0, None, 3)  # --top-k 0 --seed 3: the rest as the model says
    assert (one["top_k"], one["seed"], one["temperature"], one["top_p"]) == (0, 3, None, None)
    assert check_sampling(0.0, None, None, None)["temperature"] == 0.0  # greedy, one flag away


@pytest.mark.parametrize(("options", "why"), [
    ((-1.0, None, None, None), "temperature"), ((None, -2, None, None), "top_k"),
    ((None, None, 1.5, None), "top_p"), ((None, None, None, -1), "seed"),
    ((float("nan"), None, None, None), "temperature")])
def test_bad_options_are_refused_with_the_reason(options: tuple, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_sampling(*options)
    with pytest.raises(ValueError, match="repetition_penalty"):
        check_sampling(None, None, None, None, repetition_penalty=0.0)
    with pytest.raises(ValueError, match="min_p"):
        check_sampling(None, None, None, None, min_p=1.5)


def test_the_report_says_what_was_sampled_with_and_where_it_came_from() -> None:
    req = GenerationRequest("r", "hi", top_k=0, seed=5)
    used = Sampling(0.8, 0, 0.95, 0.05, 1.0, FROM_LLAMA_SERVER)
    assert sampling_report(req, used) == {
        "temperature": 0.8, "top_k": 0, "top_p": 0.95, "min_p": 0.05, "seed": 5,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "defaults": "llama-server", "given": ["top_k"]}
    greedy = GenerationRequest("r", "hi", temperature=0.0, frequency_penalty=0.5)
    assert sampling_report(greedy, Sampling(0.0, 20, 0.9, 0.0, 1.1, FROM_GENERATION_CONFIG)) == {
        "temperature": 0.0, "repetition_penalty": 1.1, "presence_penalty": 0.0,
        "frequency_penalty": 0.5, "defaults": "generation_config", "given": ["temperature"]}
    assert sampling_report(req, None) is None  # a service that did not say


def test_the_report_sets_the_runs_speed_against_the_clusters_prediction() -> None:
    from controlplane.records import PredictionStatus, StreamsPrediction

    predicted = PredictionStatus(80.0, [StreamsPrediction(1, 80.0, 2, 1),
                                        StreamsPrediction(2, 150.0, 2, 1)], ["c", "n1"],
                                 [6.0, 6.0], [0.1, 0.1], 2)
    assert prediction_report(predicted, 1, 100.0) == {
        "streams": 1, "measured_tok_s": 100.0, "predicted_tok_s": 80.0, "relative_error": -0.2,
        "row_groups": 2}
    assert prediction_report(predicted, 2, 120.0)["relative_error"] == 0.25
    assert prediction_report(predicted, 1, 0.0)["relative_error"] is None  # one token: no rate
    none = prediction_report(PredictionStatus(error="the link c -> n1 is not measured yet"),
                             1, 100.0)
    assert none == {"streams": 1, "measured_tok_s": 100.0, "predicted_tok_s": None,
                    "relative_error": None,
                    "no_prediction": "the link c -> n1 is not measured yet"}
    assert "3 streams are not predicted" in prediction_report(predicted, 3, 1.0)["no_prediction"]
    assert prediction_report(None, 1, 1.0)["no_prediction"] == "the coordinator made none"


def test_the_help_says_what_the_defaults_are() -> None:
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", result.output))
    for default in ("else 0.8 as llama-server's", "else 40", "else 0.95", "else 0.05",
                    "else 1"):
        assert default in text, default
