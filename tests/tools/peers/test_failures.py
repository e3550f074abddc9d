"""Bad input: a llama.cpp that fails mid-run (a llama-server that dies during the greedy
check or answers it without token ids, a damaged GGUF, one whose layers cannot take
zctl's split, a llama-bench that prints no figures) is that peer's failure, with its log
where there is one, and the run goes on. zctl's side and the models are stand-ins: a fake
llama-server in zctl's place, tiny GGUFs written by gguf-py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from tests.tools.peers.fakes import BENCH_EMPTY_JSON, fake_llama_cpp
from tools.peers import cli, greedy
from tools.peers.build import LlamaBinaries, find_binaries
from tools.peers.cases import Case, CasePlan
from tools.peers.gguf import GgufFailure, GgufFile, GgufLayout, gguf_layout
from tools.peers.processes import Node
from tools.peers.systems import LlamaServed, llama_served

PLAN = CasePlan(prompts=(16,), tokens=4, clients=(1,), requests=2, rounds=1)
SPLITS = {"1-stages": [(0, 4)], "2-stages": [(0, 2), (2, 4)]}  # the stand-in exports' layers


def write_gguf(path: Path, layers: int) -> Path:
    """A tiny GGUF of ``layers`` blocks, a tensor each."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    for layer in range(layers):
        writer.add_tensor(f"blk.{layer}.attn_q.weight", np.ones((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass
class StandInModel:
    """What the run asks of a model: its exports (a folder named by its stage count)."""

    root: Path
    name: str = "stand-in"
    hf_dir: Path = Path()

    def export(self, nodes: int, weights: str) -> Path:
        return self.root / f"{nodes}-stages"


@pytest.fixture
def working(tmp_path: Path) -> LlamaBinaries:
    return find_binaries(fake_llama_cpp(tmp_path / "working-bin"))


@pytest.fixture
def stand_ins(tmp_path: Path, working: LlamaBinaries, monkeypatch: pytest.MonkeyPatch) -> None:
    """zctl's side of a run stood in for: its exports, tokenizer and greedy tokens, and a
    fake llama-server that keeps working in zctl serve's place."""

    @contextmanager
    def zctl_stand_in(export_dir: Path, nodes: list[Node], cpu_sets: str, delay_ms: float,
                      home: Path) -> Iterator[LlamaServed]:
        with llama_served(working, home / "zctl.gguf", GgufLayout(4, {}), [(0, 4)], nodes[:1],
                          0.0, home / "logs") as served:
            served.name = "zctl"
            yield served

    monkeypatch.setattr(cli, "bench_model", lambda name, cache: StandInModel(tmp_path / "exports"))
    monkeypatch.setattr(cli, "export_ranges", lambda export_dir: SPLITS[export_dir.name])
    monkeypatch.setattr(cli, "token_encoder", lambda export_dir: lambda text: [1, 2, 3])
    monkeypatch.setattr(cli, "zctl_served", zctl_stand_in)
    monkeypatch.setattr(greedy, "zctl_greedy", lambda export_dir, ids, tokens: list(range(tokens)))


def run_with(binaries: LlamaBinaries, cache: Path, ggufs: dict[tuple[str, str], Path]) -> cli.Run:
    run = cli.Run(PLAN, cli.Llama(binaries, None, {}), cache, None)
    run.ggufs.update({key: GgufFile(path, "Q4_1", "a test's") for key, path in ggufs.items()})
    return run


@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated", "missing"])
def test_a_damaged_gguf_cannot_be_read_and_says_so(tmp_path, damage) -> None:
    good = write_gguf(tmp_path / "good.gguf", 4).read_bytes()
    path = tmp_path / "damaged.gguf"
    contents = {"empty": b"", "garbage": b"not a GGUF" * 20, "truncated": good[:len(good) // 3]}
    if damage in contents:
        path.write_bytes(contents[damage])
    with pytest.raises(GgufFailure, match="cannot be read as a GGUF"):
        gguf_layout(path)
    assert gguf_layout(tmp_path / "good.gguf").num_layers == 4


def test_a_damaged_gguf_is_llama_cpps_failure_and_the_case_goes_on(
        tmp_path, working, stand_ins) -> None:
    (tmp_path / "damaged.gguf").write_bytes(b"not a GGUF" * 20)
    run = run_with(working, tmp_path / "peers", {("m", "int4"): tmp_path / "damaged.gguf"})
    record = run.case(Case("m", "int4", 2, "shared", 0.0))
    failure = record["failures"]["llama.cpp"]
    assert "Q4_1 GGUF" in failure["error"] and "GGUF magic invalid" in failure["error"]
    assert len(record["figures"]["zctl"]["one_stream.p16"]) == 1  # zctl's side was measured
    assert len(record["figures"]["zctl"]["serve.c1"]) == 1
    assert run.records == [record]


def test_a_gguf_whose_layers_cannot_take_the_split_is_llama_cpps_failure(
        tmp_path, working, stand_ins) -> None:
    other = write_gguf(tmp_path / "two-layers.gguf", 2)  # the split's ranges cover 4 layers
    run = run_with(working, tmp_path / "peers", {("m", "int4"): other})
    record = run.case(Case("m", "int4", 2, "shared", 0.0))
    error = record["failures"]["llama.cpp"]["error"]
    assert "cannot take zctl's split of two-layers.gguf" in error and "cover 4 of 2" in error
    assert len(record["figures"]["zctl"]["one_stream.p16"]) == 1


def test_a_llama_bench_that_prints_no_figures_is_recorded_and_the_case_completes(
        tmp_path, stand_ins) -> None:
    binaries = find_binaries(fake_llama_cpp(tmp_path / "bin", bench=BENCH_EMPTY_JSON))
    run = run_with(binaries, tmp_path / "peers", {("m", "int4"): write_gguf(tmp_path / "4.gguf", 4)})
    record = run.case(Case("m", "int4", 1, "shared", 0.0))
    assert record["failures"] == {}  # both systems served the case
    assert len(record["figures"]["llama.cpp"]["one_stream.p16"]) == 1
    assert "holds no run's avg_ts" in record["llama_bench"]["error"]
    assert "llama-bench: no runs" in record["llama_bench"]["log_tail"]


def test_the_greedy_check_against_a_working_llama_server_agrees(
        tmp_path, working, stand_ins) -> None:
    run = run_with(working, tmp_path / "peers", {("m", "fp32"): write_gguf(tmp_path / "f32.gguf", 4)})
    check = run.greedy("m")
    assert check["match"] and check["matched"] == check["tokens"] == greedy.GREEDY_TOKENS


def test_a_llama_server_that_dies_during_the_greedy_check_is_its_failure_with_its_log(
        tmp_path, stand_ins) -> None:
    dying = find_binaries(fake_llama_cpp(tmp_path / "dying-bin", die_after=1))
    run = run_with(dying, tmp_path / "peers", {("m", "fp32"): write_gguf(tmp_path / "f32.gguf", 4)})
    check = run.greedy("m")
    assert check["error"] == "llama-server -np 1 exited with 3"
    assert "fake crash" in check["log_tail"]


def test_a_greedy_answer_without_token_ids_is_llama_cpps_failure_with_the_servers_log(
        tmp_path, stand_ins) -> None:
    tokenless = find_binaries(fake_llama_cpp(tmp_path / "bin", completion_token_ids=False))
    run = run_with(tokenless, tmp_path / "peers",
                   {("m", "fp32"): write_gguf(tmp_path / "f32.gguf", 4)})
    check = run.greedy("m")
    assert check["error"].startswith("llama-server's greedy answer holds no token ids: ")
    assert '"content"' in check["error"]
    assert "load_tensors: offloaded 0/31 layers" in check["log_tail"]


def test_a_llama_cpp_that_dies_mid_run_fails_its_greedy_check_and_cases_and_the_run_completes(
        tmp_path, zctl_home, working, stand_ins, monkeypatch) -> None:
    """The whole command: every llama-server dies on its first request (the greedy check's,
    then each case's warm-up); the run prints its object, llama.cpp's failures in it."""
    f32 = write_gguf(tmp_path / "f32.gguf", 4)
    monkeypatch.setattr(cli, "shipped_gguf", lambda model: None)
    monkeypatch.setattr(cli, "pinned_tree", lambda *args: tmp_path / "no-source")
    monkeypatch.setattr(cli, "paired_gguf", lambda name, weights, *args: GgufFile(
        f32, "F32", "a test's"))
    dying = fake_llama_cpp(tmp_path / "dying-bin", die_after=1)
    app = typer.Typer()
    app.command()(cli.main)
    result = CliRunner(env={"COLUMNS": "400"}).invoke(app, [
        "--json", "--llama-cpp", str(dying), "--amx", "off", "--models", "smollm2-135m",
        "--weights", "int4", "--topologies", "1", "--delays", "0", "--prompts", "16",
        "--tokens", "4", "--clients", "1", "--requests", "2", "--rounds", "1", "--greedy-check"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    check = out["greedy"]["smollm2-135m"]
    assert check["error"] == "llama-server -np 1 exited with 3" and "fake crash" in check["log_tail"]
    assert out["targets"]["greedy/smollm2-135m"] == {
        "value": None, "target": 1.0, "met": False,
        "figure": "greedy/smollm2-135m: matched / tokens"}
    [record] = out["cases"]
    assert record["case"] == "smollm2-135m/int4/1n/0ms"
    failure = record["failures"]["llama.cpp"]
    assert failure["error"] == "llama-server -np 1 exited with 3", failure
    assert "fake crash" in failure["log_tail"]
    assert len(record["figures"]["zctl"]["one_stream.p16"]) == 1
