"""The cluster view (pure): stage rows from a cluster status, percentiles over a window,
tok/s over a window, the prediction for the streams running."""

from __future__ import annotations

from dataclasses import replace

from controlplane.records import PredictionStatus, StreamsPrediction
from tests.zctl.cli.test_view import cluster, node
from zctl.service.cluster_view import cluster_view, stage_rows
from zctl.service.messages import HistogramSnapshot, HopStats, ServiceStats, StageStats

BOUNDS = [1.0, 2.0, 4.0, 8.0]


def hist(*counts: int, total: float = 0.0) -> HistogramSnapshot:
    return HistogramSnapshot(BOUNDS, list(counts), total)


def status():
    return cluster([node("coord", 0, "127.0.0.1"), node("n1", 1, "127.0.0.2", kv_slots=3),
                    node("n2", 2, "127.0.0.3"), node("spare", None, "127.0.0.4",
                                                     state="idle")])


def stats(compute: list[HistogramSnapshot], generated: int, running: int = 1,
          prediction: PredictionStatus | None = None) -> ServiceStats:
    st = status()
    stages = [StageStats(i, n, True, 2, h) for i, (n, h) in
              enumerate(zip(["coordinator", "n1", "n2"], compute, strict=True))]
    hops = [HopStats("0-1", 1000 * generated, compute[0])]
    return ServiceStats(running, 0, {"generated_tokens": generated}, stages, hops,
                        {"coordinator": True}, model="m",
                        cluster=replace(st, prediction=prediction))


def test_stage_rows_name_each_stages_node_address_device_and_layers() -> None:
    rows = stage_rows(status())
    assert [(r.index, r.node, r.host, r.layers) for r in rows] == [
        (0, "coordinator", "127.0.0.1", "0-11"), (1, "n1", "127.0.0.2", "12-22"),
        (2, "n2", "127.0.0.3", "23-29")]
    assert rows[1].address == "tcp://127.0.0.2:5000" and rows[1].device == "CPU"
    assert rows[1].kv_slots == 3 and rows[1].ram_free == 6 << 30
    orphan = replace(status(), nodes=[node("coord", 0, "127.0.0.1")])
    assert stage_rows(orphan)[1].node == "" and stage_rows(orphan)[1].layers == "12-22"


def test_the_view_reads_latency_and_tok_s_over_its_window() -> None:
    first = stats([hist(10, 0, 0, 0, 0)] * 3, generated=10)
    later = stats([hist(10, 0, 0, 10, 0)] * 3, generated=30)
    view = cluster_view(later, first, 2.0)
    assert view["tok_s"] == 10.0 and view["window_s"] == 2.0
    compute = view["stages"][1]["compute_ms"]
    assert compute["count"] == 10 and 4.0 < compute["p50"] < compute["p95"] <= 8.0
    assert view["hops"][0]["bytes_per_s"] == 10000.0
    assert view["hops"][0]["network_ms"]["count"] == 10
    assert [s["hop"] for s in view["stages"]] == ["0-1", None, None]  # only 0-1 measured
    assert [s["layers"] for s in view["stages"]] == ["0-11", "12-22", "23-29"]
    assert view["stages"][1]["address"] == "tcp://127.0.0.2:5000"
    assert [n["id"] for n in view["nodes"]] == ["coordinator", "n1", "n2", "spare"]
    assert view["nodes"][3]["alive"] and view["pipeline"] == "serving"
    since_start = cluster_view(later, None, 0.0)
    assert since_start["tok_s"] is None and since_start["stages"][1]["compute_ms"]["count"] == 20
    idle = cluster_view(later, later, 1.0)
    assert idle["stages"][0]["compute_ms"] == {"p50": None, "p95": None, "count": 0}
    assert idle["tok_s"] == 0.0


def test_the_prediction_is_for_the_streams_running_and_says_why_when_missing() -> None:
    prediction = PredictionStatus(20.0, [StreamsPrediction(1, 20.0, 1, 1),
                                         StreamsPrediction(2, 35.0, 1, 2)],
                                  ["coord", "n1"], [1.0, 2.0], [0.5, 0.25])
    view = cluster_view(stats([hist(1, 0, 0, 0, 0)] * 3, 5, running=2, prediction=prediction),
                        None, 0.0)
    assert view["prediction"]["tok_s"] == 35.0 and view["prediction"]["streams"] == 2
    missing = PredictionStatus(error="node n1 has no profile yet")
    view = cluster_view(stats([hist(1, 0, 0, 0, 0)] * 3, 5, running=0, prediction=missing),
                        None, 0.0)
    assert view["prediction"]["tok_s"] is None and "profile" in view["prediction"]["error"]
    assert cluster_view(stats([hist(1, 0, 0, 0, 0)] * 3, 5), None, 0.0)["prediction"] is None


def test_without_a_cluster_status_the_view_still_has_the_stages() -> None:
    bare = replace(stats([hist(1, 0, 0, 0, 0)] * 3, 5), cluster=None, health="down for x")
    view = cluster_view(bare, None, 0.0)
    assert view["pipeline"] == "down" and view["nodes"] == [] and view["plan"] is None
    assert [s["node"] for s in view["stages"]] == ["coordinator", "n1", "n2"]
