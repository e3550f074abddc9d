"""The running placement's predicted tok/s on /metrics: a gauge per stream count while the
cluster status has a prediction, none while it says why it has not."""

from __future__ import annotations

from dataclasses import replace

from controlplane.records import PredictionStatus, StreamsPrediction
from tests.zctl.cli.test_view import cluster, node
from zctl.serve.metrics import ServeMetrics
from zctl.service.messages import ServiceStats


def scrape(prediction: PredictionStatus | None) -> list[str]:
    status = replace(cluster([node("coord", 0, "127.0.0.1")]), prediction=prediction)
    stats = ServiceStats(0, 0, {}, [], [], {}, model="m", cluster=status)
    text = ServeMetrics().render(stats, "m").decode()
    return [line for line in text.splitlines() if line.startswith("zctl_predicted_tok_s")]


def test_each_stream_count_is_a_gauge_while_there_is_a_prediction() -> None:
    predicted = PredictionStatus(70.0, [StreamsPrediction(1, 70.0, 1, 1),
                                        StreamsPrediction(2, 131.5, 2, 1)], ["c"], [14.0], [], 2)
    assert scrape(predicted) == ['zctl_predicted_tok_s{model_name="m",streams="1"} 70.0',
                                 'zctl_predicted_tok_s{model_name="m",streams="2"} 131.5']


def test_no_prediction_is_no_sample() -> None:
    assert scrape(PredictionStatus(error="node n1 has no profile: measuring")) == []
    assert scrape(None) == []
    assert ServeMetrics().render(ServiceStats(0, 0, {}, [], [], {}), "m").count(
        b"\nzctl_predicted_tok_s{") == 0  # no cluster status


def test_the_measured_aggregate_is_a_gauge_per_stream_count_beside_the_prediction() -> None:
    from zctl.engine.decode_rates import DecodeRate
    stats = ServiceStats(0, 0, {}, [], [], {}, model="m",
                         decode_rates=[DecodeRate(1, 60, 1.5), DecodeRate(4, 300, 2.0)])
    text = ServeMetrics().render(stats, "m").decode()
    assert [line for line in text.splitlines()
            if line.startswith("zctl_measured_aggregate_tok_s")] == [
        'zctl_measured_aggregate_tok_s{model_name="m",streams="1"} 40.0',
        'zctl_measured_aggregate_tok_s{model_name="m",streams="4"} 150.0']
    assert "\nzctl_measured_aggregate_tok_s{" not in ServeMetrics().render(
        ServiceStats(0, 0, {}, [], [], {}), "m").decode()  # nothing measured: no sample
