"""tools.robustness.soak: resident memory (psutil) and the figures made of it, the process
tree, the idle state after the load, the request mix, the options; and (slow) a short
soak of a real local cluster of the tiny model behind the OpenAI API."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import typer
from typer.testing import CliRunner

from tools.harness.load import RequestRecord
from tools.robustness.soak import leak_figures, main, roots
from tools.robustness.soak_load import MAX_TOKENS, Prompt, answer_kind, draw_request, prompt_pool
from tools.robustness.soak_probe import (
    RssSeries,
    ServiceSample,
    growth_pct,
    metric_value,
    process_tree,
    read_rss_kb,
)


def test_resident_memory_of_a_process_and_of_none() -> None:
    assert read_rss_kb(os.getpid()) > 0  # this process
    assert read_rss_kb(2**22 + 1) is None  # no such process
    zombie = subprocess.Popen(["true"])
    wait_until = time.monotonic() + 10
    while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < wait_until
        time.sleep(0.01)
    assert read_rss_kb(zombie.pid) is None  # exited, not yet reaped
    zombie.wait()


def test_growth_is_from_the_end_of_warm_up_to_the_end_of_the_load() -> None:
    assert growth_pct(100, 104) == 4.0 and growth_pct(200, 190) == -5.0
    with pytest.raises(ValueError):
        growth_pct(0, 10)
    series = RssSeries("node1", 7, [(0.0, 50_000), (5.0, 102_400), (10.0, 110_000),
                                    (15.0, 104_448), (20.0, 300_000)])
    got = series.figures(warm_s=4.0, end_s=16.0)
    assert got == {"name": "node1", "pid": 7, "rss_warm_mb": 100.0, "rss_end_mb": 102.0,
                   "rss_max_mb": 293.0, "growth_pct": 2.0,
                   "growth_second_half_pct": round((104_448 / 110_000 - 1) * 100, 2),
                   "samples": 5, "rss_by_minute_mb": [293.0]}
    assert RssSeries("late", 8, [(30.0, 1000)]).figures(4.0, 16.0) is None


def test_the_process_tree_holds_every_descendant_named_after_its_root() -> None:
    root = subprocess.Popen(["sh", "-c", "sh -c 'sleep 30 & wait' & wait"])  # 2 levels below
    try:
        wait_until = time.monotonic() + 10
        while len(psutil.Process(root.pid).children(recursive=True)) < 2:
            assert time.monotonic() < wait_until
            time.sleep(0.01)
        (inner,) = psutil.Process(root.pid).children()
        (sleeper,) = inner.children()
        tree = process_tree({"coordinator": root.pid, "gone": 2**22 + 1})
        assert tree == {root.pid: "coordinator", inner.pid: "coordinator/sh",
                        sleeper.pid: "coordinator/sleep", 2**22 + 1: "gone"}
    finally:
        for process in psutil.Process(root.pid).children(recursive=True):
            process.kill()
        root.kill()
        root.wait()


class _Record:
    pids = [100, 101, 102, 103]


def test_the_roots_are_the_coordinator_the_nodes_and_the_api_last() -> None:
    assert roots(_Record()) == {"coordinator": 100, "node1": 101, "node2": 102, "api": 103}


def test_a_prometheus_sample_is_read_by_name() -> None:
    text = ("# HELP zctl_api_requests_in_flight x\nzctl_api_requests_in_flight 3.0\n"
            'vllm:num_requests_running{model_name="m"} 2.0\n')
    assert metric_value(text, "zctl_api_requests_in_flight") == 3.0
    assert metric_value(text, "vllm:num_requests_running") == 2.0
    assert metric_value(text, "zctl_api_max_queue") is None


def _sample(running: int = 0, waiting: int = 0, kv: tuple[int, ...] = (0, 0), prefix: int = 0,
            in_flight: int | None = 0) -> ServiceSample:
    return ServiceSample(0.0, running, waiting, list(kv), prefix, in_flight)


def test_leaks_are_whatever_the_cluster_still_holds_against_before_the_load() -> None:
    idle = leak_figures(_sample(), _sample(prefix=900), prefix_cap_tokens=1000)
    assert idle["leaked"] == [] and idle["prefix_cached_tokens"] == 900
    leaked = leak_figures(_sample(), _sample(1, 2, (0, 48), 1200, 3), prefix_cap_tokens=1000)
    assert leaked["leaked"] == [
        "the engine has 1 running, 2 waiting", "the API holds 3 requests",
        "stage 1 holds 48 KV slots (idle: 0)",
        "1200 tokens of cached prefixes, over the cap of 1000"]
    assert leak_figures(_sample(kv=(4, 4)), _sample(kv=(4, 4)), 0)["leaked"] == []


class _Tokenizer:
    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        return [0] * (len(messages[0][1].split()) + 5)


def test_the_prompt_pool_keeps_what_fits_the_context_shortest_first() -> None:
    pool = prompt_pool(_Tokenizer(), max_context=200)
    assert pool == sorted(pool, key=lambda p: p.tokens)
    assert all(p.room >= MAX_TOKENS[0] and p.tokens + p.room < 200 for p in pool)
    assert pool[-1].tokens > 2 * pool[0].tokens  # lengths vary
    assert len(prompt_pool(_Tokenizer(), max_context=4000)) > len(pool)
    with pytest.raises(RuntimeError, match="no prompt fits"):
        prompt_pool(_Tokenizer(), max_context=20)


def test_the_mix_has_every_kind_within_each_prompts_room() -> None:
    rng = random.Random(3)
    prompts = [Prompt("short", 10, 500), Prompt("long " * 50, 300, 20)]
    drawn = [draw_request(rng, "m", prompts) for _ in range(400)]
    assert {r.kind for r in drawn} == {"stream", "whole", "stop", "sampled", "cancel"}
    for r in drawn:
        room = next(p.room for p in prompts if p.text == r.payload["messages"][0]["content"])
        assert MAX_TOKENS[0] <= r.payload["max_tokens"] <= min(room, MAX_TOKENS[1])
        assert r.payload["stream"] == (r.kind != "whole")
        assert (r.cancel_after > 0) == (r.kind == "cancel")
        assert ("stop" in r.payload) == (r.kind == "stop")
        assert ("seed" in r.payload) == (r.kind == "sampled")


def test_a_bursts_answers_are_named_by_their_status() -> None:
    assert answer_kind(RequestRecord()) == "200"
    assert answer_kind(RequestRecord(error="http 429: over the queue")) == "429"
    assert answer_kind(RequestRecord(error="no [DONE]: the stream ended early")) == \
        "200 without [DONE]"
    assert answer_kind(RequestRecord(error="ReadTimeout: timed out")) == "ReadTimeout"


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(main)
    return app


@pytest.mark.parametrize("args", [["--nodes", "1"], ["--streams", "0"], ["--minutes", "0"],
                                  ["--minutes", "1", "--warmup-s", "60"],
                                  ["--max-queue", "-1"]])
def test_bad_options_are_refused_before_anything_starts(args: list[str]) -> None:
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 2, result.output


@pytest.mark.e2e
def test_a_short_soak_of_the_tiny_model_leaves_the_cluster_idle(
        tiny_exports, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    result = CliRunner().invoke(_app(), [
        "--model", str(export_dir), "--streams", "4", "--minutes", "0.4", "--warmup-s", "6",
        "--sample-s", "2", "--drain-s", "30", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["errors"] == 0 and out["error_kinds"] == {}, out
    assert out["completed"] > 0 and out["cancelled"] > 0 and out["tokens"] > 0
    assert out["requests"] == out["completed"] + out["cancelled"] + out["cut_at_deadline"]
    assert set(out["kinds"]) == {"stream", "whole", "stop", "sampled", "cancel"}
    assert out["passed_leaks"] and out["leaks"]["leaked"] == [], out["leaks"]
    assert out["leaks"]["running"] == out["leaks"]["waiting"] == 0
    assert out["leaks"]["api_in_flight"] == 0 and out["leaks"]["kv_slots"] == [0, 0]
    burst = out["burst"]
    assert out["passed_queue"] and burst["rejected"] >= 1 and not burst["errors"], burst
    assert burst["served"] + burst["rejected"] == burst["sent"] == out["max_queue"] + 8
    assert 1 <= out["max_queue_seen"] <= out["max_queue"]
    names = [p["name"] for p in out["processes"]]
    assert names[:3] == ["coordinator", "node1", "api"], names
    for p in out["processes"]:
        assert p["rss_warm_mb"] > 0 and p["rss_end_mb"] > 0 and p["samples"] >= 2, p
        assert p["rss_max_mb"] >= max(p["rss_warm_mb"], p["rss_end_mb"]), p
        assert isinstance(p["growth_pct"], float), p
    assert not list((tmp_path / "home").rglob("cluster.json"))  # its own home, cleaned up
