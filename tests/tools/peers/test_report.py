"""Ratios (zctl over llama.cpp, latencies inverted) and the targets."""

from __future__ import annotations

import io

from rich.console import Console

from tools.peers.greedy import agreement
from tools.peers.report import (
    case_ratios,
    figure_ratio,
    flat,
    greedy_targets,
    render,
    targets,
    unmeasured_targets,
)


def rounds(*values: dict) -> list[dict]:
    return list(values)


def test_a_ratio_is_the_median_of_the_rounds_paired_ratios() -> None:
    zctl = rounds({"decode_tok_s": 50.0}, {"decode_tok_s": 60.0}, {"decode_tok_s": 40.0})
    llama = rounds({"decode_tok_s": 50.0}, {"decode_tok_s": 40.0}, {"decode_tok_s": 80.0})
    assert figure_ratio(zctl, llama, "decode_tok_s") == 1.0  # median of 1.0, 1.5, 0.5


def test_latencies_are_inverted_so_above_one_is_still_zctl_better() -> None:
    zctl, llama = rounds({"ttft_ms": 50.0}), rounds({"ttft_ms": 100.0})
    assert figure_ratio(zctl, llama, "ttft_ms") == 2.0
    zctl = rounds({"itl_ms": {"p50": 20.0, "p99": 40.0}})
    llama = rounds({"itl_ms": {"p50": 10.0, "p99": 40.0}})
    assert figure_ratio(zctl, llama, "itl_ms_p50") == 0.5
    assert figure_ratio(zctl, llama, "itl_ms_p99") == 1.0


def test_no_pair_no_ratio() -> None:
    assert figure_ratio(rounds({"tok_s": 5.0}), [], "tok_s") is None
    assert figure_ratio(rounds({"tok_s": 5.0}), rounds({"tok_s": 0.0}), "tok_s") is None
    assert flat({"ttft_ms": {"p50": None, "p99": 3.0}, "error_kinds": {}, "ok": True}) == {
        "ttft_ms_p99": 3.0}


def record(case: str, nodes: int, zctl: dict, llama: dict) -> dict:
    return {"case": case, "nodes": nodes, "figures": {"zctl": zctl, "llama.cpp": llama},
            "failures": {}, "placement": {}}


def test_targets_per_case() -> None:
    one = record("smollm2-135m/int4/1n/0ms", 1,
                 {"one_stream.p128": [{"decode_tok_s": 90.0, "ttft_ms": 10.0}]},
                 {"one_stream.p128": [{"decode_tok_s": 100.0, "ttft_ms": 10.0}]})
    two = record("smollm2-135m/int4/2n-split/10ms", 2,
                 {"one_stream.p128": [{"decode_tok_s": 30.0}],
                  "serve.c8": [{"tok_s": 130.0}], "serve.c16": [{"tok_s": 100.0}]},
                 {"one_stream.p128": [{"decode_tok_s": 20.0}],
                  "serve.c8": [{"tok_s": 100.0}], "serve.c16": [{"tok_s": 100.0}]})
    big = record("random-1b/int8/1n/0ms", 1, {"one_stream.p128": [{"decode_tok_s": 9.5}]},
                 {"one_stream.p128": [{"decode_tok_s": 10.0}]})
    ratios = {k: v for r in (one, two, big) for k, v in case_ratios(r).items()}
    assert ratios["smollm2-135m/int4/1n/0ms/one_stream.p128/decode_tok_s"] == 0.9
    assert ratios["smollm2-135m/int4/1n/0ms/one_stream.p128/ttft_ms"] == 1.0
    got = targets([one, two, big], ratios, [128])
    assert got["one_node/smollm2-135m/int4/1n/0ms/p128"] == {
        "value": 0.9, "target": 0.9, "met": True,
        "figure": "smollm2-135m/int4/1n/0ms/one_stream.p128/decode_tok_s"}
    assert got["one_node/random-1b/int8/1n/0ms/p128"]["target"] == 1.0
    assert not got["one_node/random-1b/int8/1n/0ms/p128"]["met"]
    assert got["one_stream/smollm2-135m/int4/2n-split/10ms/p128"]["value"] == 1.5
    assert got["aggregate/smollm2-135m/int4/2n-split/10ms/c8"]["met"]  # 1.3 >= 1.2
    assert not got["aggregate/smollm2-135m/int4/2n-split/10ms/c16"]["met"]  # 1.0


def test_a_target_is_judged_on_the_ratio_not_on_its_rounded_figure() -> None:
    one = record("smollm2-135m/int4/1n/0ms", 1, {"one_stream.p128": [{"decode_tok_s": 89.96}]},
                 {"one_stream.p128": [{"decode_tok_s": 100.0}]})
    got = targets([one], case_ratios(one), [128])["one_node/smollm2-135m/int4/1n/0ms/p128"]
    assert got["value"] == 0.9 and got["met"] is False  # 0.8996 < 0.9


def test_a_failed_peer_leaves_its_targets_unmet_and_the_table_says_why() -> None:
    failed = record("smollm2-135m/int4/2n-split/0ms", 2,
                    {"one_stream.p128": [{"decode_tok_s": 30.0}]}, {})
    failed["failures"] = {"llama.cpp": {"error": "llama-server -np 1 exited with 3",
                                        "log_tail": "fake crash"}}
    ratios = case_ratios(failed)
    got = targets([failed], ratios, [128])
    assert got["one_stream/smollm2-135m/int4/2n-split/0ms/p128"]["value"] is None
    assert not got["one_stream/smollm2-135m/int4/2n-split/0ms/p128"]["met"]
    out = io.StringIO()
    render({"run": {"date": "d", "cpu": "c", "cpus": 2, "commit": "x"}, "llama_cpp": {},
            "cases": [failed], "ratios": ratios, "targets": got}, Console(file=out, width=200))
    assert "exited with 3" in out.getvalue() and "fake crash" in out.getvalue()


def test_a_case_this_machine_cannot_measure_keeps_its_targets_unmet_with_the_reason() -> None:
    from tools.peers.cases import case_matrix

    cases, skipped = case_matrix(["smollm2-135m"], ["int4"], ["3-split"], [0.0, 10.0], 2)
    assert not cases and len(skipped) == 2
    got = unmeasured_targets(skipped, [128, 1024])
    key = "smollm2-135m/int4/3n-split/10ms"
    assert set(got) == {f"{kind}/{case}/{tail}" for case in skipped
                        for kind, tail in (("one_stream", "p128"), ("one_stream", "p1024"),
                                           ("aggregate", "c8"), ("aggregate", "c16"))}
    entry = got[f"one_stream/{key}/p1024"]
    assert entry["value"] is None and entry["met"] is False and entry["target"] == 1.0
    assert "3 nodes with a core each need 3 cores" in entry["not_measured"]
    assert got[f"aggregate/{key}/c16"]["target"] == 1.2


def test_the_greedy_check_is_a_target_per_model_unmet_unless_every_token_matched() -> None:
    got = greedy_targets({
        "same": agreement([1, 2, 3, 4], [1, 2, 3, 4]),
        "parted": agreement([1, 2, 3, 4], [1, 2, 9, 9]),
        "longer": agreement([1, 2], [1, 2, 3]),  # all of zctl's matched, but more came
        "failed": {"error": "llama-server -np 1 exited with 3", "log_tail": "fake crash"},
        "not run": {"not_run": "--no-greedy-check"}})
    assert got["greedy/same"] == {"value": 1.0, "target": 1.0, "met": True,
                                  "figure": "greedy/same: matched / tokens"}
    assert (got["greedy/parted"]["value"], got["greedy/parted"]["met"]) == (0.5, False)
    assert (got["greedy/longer"]["value"], got["greedy/longer"]["met"]) == (1.0, False)
    for model in ("failed", "not run"):
        assert (got[f"greedy/{model}"]["value"], got[f"greedy/{model}"]["met"]) == (None, False)


def test_a_failed_delay_or_greedy_check_is_printed_with_its_log() -> None:
    out = io.StringIO()
    failure = {"error": "llama-server -np 1 exited with 3", "log_tail": "line one\nfake crash"}
    render({"run": {"date": "d", "cpu": "c", "cpus": 2, "commit": "x"}, "llama_cpp": {},
            "delay_check": [{"delay_ms": 10.0, "zctl_one_way_ms": 10.1, "relay_one_way_ms": None,
                             "same": False, "error": "the relay check exited with 1",
                             "log_tail": "OSError: address already in use"}],
            "greedy": {"smollm2-135m": failure}, "cases": [], "ratios": {},
            "targets": greedy_targets({"smollm2-135m": failure})}, Console(file=out, width=200))
    text = out.getvalue()
    assert "per-hop delay check at 10 ms failed: the relay check exited with 1\n" \
           "OSError: address already in use" in text
    assert "greedy check smollm2-135m failed: llama-server -np 1 exited with 3\n" \
           "line one\nfake crash" in text
    assert "greedy/smollm2-135m" in text
