"""An experiment's rows (tools.wan.analysis, tools.wan.plots): the ratios the evaluation
reports, the CSV and the figures written."""

from __future__ import annotations

import csv

from tools.wan.analysis import (
    COLUMNS,
    auto_k_over_best_fixed,
    best_fixed_k,
    best_over_plain,
    comparisons,
    lookup_over_plain,
    payload_over_full,
    streams_over_one,
    top1_over_full,
    write_csv,
)
from tools.wan.plots import draw_all


def row(delay: float, config: str, tok_s: float, streams: int = 1, payload: str = "top1",
        link: str = "unlimited", k_mean: float | None = None, stages: int = 2) -> dict:
    decoding, _, k = config.partition("-")
    k = {"auto": "auto", "": ""}.get(k, k.removeprefix("k"))
    bandwidth = link.removesuffix("-tbf")
    rate = 0.0 if link == "unlimited" else float(
        bandwidth.removeprefix("relay-").removesuffix("mbit"))
    return {"scenario": "t", "stages": stages, "delay_ms": delay, "jitter_ms": 0.0,
            "rate_mbit": rate, "relay": link.startswith("relay"), "relay_delay_ms": 0.0,
            "shaper": "tbf" if link.endswith("-tbf") else "ours",
            "link": link, "hops": "", "decoding": decoding, "k": k, "config": config,
            "streams": streams, "payload": payload, "tok_s": tok_s, "k_mean": k_mean,
            "error": ""}


LATENCY_ROWS = [
    row(0, "plain", 20.0), row(0, "lookup-k1", 19.0), row(0, "lookup-k3", 18.0),
    row(0, "lookup-auto", 19.5, k_mean=0.5), row(0, "plain", 21.0, streams=4),
    row(100, "plain", 2.0), row(100, "lookup-k1", 3.0), row(100, "lookup-k3", 4.0),
    row(100, "lookup-auto", 3.9, k_mean=3.2), row(100, "plain", 7.0, streams=4),
    row(100, "lookup-auto", 13.0, streams=4),
]


def test_best_fixed_k_per_latency_with_adaptive_ks_mean():
    best = best_fixed_k(LATENCY_ROWS)
    assert best["0"]["k"] == 1 and best["100"]["k"] == 3
    assert best["100"]["auto_k_mean"] == 3.2 and best["0"]["tok_s"] == 19.0


def test_best_over_plain_and_adaptive_k_over_best_fixed():
    assert best_over_plain(LATENCY_ROWS) == {"0": 1.05, "100": 6.5}
    assert auto_k_over_best_fixed(LATENCY_ROWS) == {"0": 1.026, "100": 0.975}


def test_lookup_over_plain_and_streams_over_one_pair_the_same_cluster():
    assert lookup_over_plain(LATENCY_ROWS) == {
        "lookup-k1 x1@0ms": 0.95, "lookup-k3 x1@0ms": 0.9, "lookup-auto x1@0ms": 0.975,
        "lookup-k1 x1@100ms": 1.5, "lookup-k3 x1@100ms": 2.0, "lookup-auto x1@100ms": 1.95,
        "lookup-auto x4@100ms": 1.857}
    assert streams_over_one(LATENCY_ROWS) == {
        "plain x4@0ms": 1.05, "plain x4@100ms": 3.5, "lookup-auto x4@100ms": 3.333}
    assert {"lookup_over_plain", "streams_over_one"} <= set(comparisons(LATENCY_ROWS))


def test_keys_name_stage_counts_when_several_were_run():
    rows = [row(100, "plain", 2.0), row(100, "plain", 4.0, streams=4),
            row(100, "plain", 1.5, stages=3), row(100, "plain", 3.0, streams=4, stages=3)]
    assert best_over_plain(rows) == {"100@2stages": 2.0, "100@3stages": 2.0}


def test_top1_over_full_per_link_pairs_the_same_configuration():
    rows = [row(20, "plain", 22.0, link="relay-20mbit"),
            row(20, "plain", 2.75, payload="logits", link="relay-20mbit"),
            row(20, "plain", 25.0, link="20mbit"),
            row(20, "plain", 5.0, payload="logits", link="20mbit"),
            row(20, "lookup-auto", 30.0, link="20mbit")]  # no logits twin: not paired
    assert top1_over_full(rows) == {"relay-20mbit": 8.0, "20mbit": 5.0}
    rows.append(row(20, "plain", 11.0, payload="topk", link="relay-20mbit"))
    assert payload_over_full(rows, "topk") == {"relay-20mbit": 4.0}


def test_failed_cells_are_left_out_of_the_ratios():
    rows = [row(0, "plain", 10.0), {**row(0, "plain", 0.0, streams=4), "tok_s": None,
                                    "error": "cluster: did not start"}]
    assert comparisons(rows)["best_over_plain"] == {"0": 1.0}


def test_the_csv_has_every_column_and_one_row_per_cell(tmp_path):
    write_csv(LATENCY_ROWS, tmp_path / "results.csv")
    with (tmp_path / "results.csv").open() as f:
        read = list(csv.DictReader(f))
    assert list(read[0]) == list(COLUMNS) and len(read) == len(LATENCY_ROWS)
    assert read[5]["tok_s"] == "2.0" and read[0]["cpu"] == ""


def test_every_figure_the_rows_can_fill_is_written(tmp_path):
    bandwidth = [row(10, "plain", t, payload=p, link=link) for t, p, link in [
        (20.0, "top1", "1mbit"), (0.5, "logits", "1mbit"), (22.0, "top1", "100mbit"),
        (15.0, "logits", "100mbit"), (18.0, "top1", "relay-1mbit"),
        (0.25, "logits", "relay-1mbit")]]
    jitter = [{**row(50, "plain", t), "jitter_ms": j} for t, j in [(5.0, 0.0), (4.0, 25.0)]]
    written = draw_all(LATENCY_ROWS + bandwidth + jitter, tmp_path, "test")
    assert {p.name for p in written} == {"throughput_vs_latency.png", "best_k_vs_latency.png",
                                         "payload_vs_bandwidth.png", "streams_vs_latency.png",
                                         "throughput_vs_jitter.png"}
    assert all(p.stat().st_size > 1000 for p in written)
    assert draw_all([row(0, "plain", 1.0)], tmp_path / "none", "one cell") == []
