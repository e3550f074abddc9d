"""llama.cpp's processes, with fake binaries: started on their nodes, served, and a
process that dies mid-run reported as that peer's failure with its log."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.tools.peers.fakes import BENCH_EMPTY_JSON, BENCH_HANGS, fake_llama_cpp
from tools.peers.build import find_binaries
from tools.peers.cases import Case, CasePlan, CaseResult, run_case
from tools.peers.gguf import GgufLayout
from tools.peers.measure import one_stream
from tools.peers.processes import Node, PeerFailure, llama_bench
from tools.peers.systems import case_nodes, llama_served


@pytest.fixture
def binaries(tmp_path: Path):
    return find_binaries(fake_llama_cpp(tmp_path / "bin"))


def served(binaries, tmp_path: Path, name: str):
    layout = GgufLayout(4, {})
    return llama_served(binaries, tmp_path / "model.gguf", layout, [(0, 2), (2, 4)],
                        case_nodes(2, "shared"), 0.0, tmp_path / name)


def test_llama_server_serves_with_its_rpc_server_on_the_next_address(binaries, tmp_path) -> None:
    with served(binaries, tmp_path, "logs") as llama:
        assert llama.cluster.endpoints[0].startswith("127.0.0.2:")
        llama.prepare(1, 2048)
        args = llama.cluster.server_args(1, 2048)
        assert args[args.index("--rpc") + 1] == llama.cluster.endpoints[0]
        assert args[args.index("-ngl") + 1] == "3"  # layers 2-3 and the output layer
        figures = asyncio.run(one_stream(llama.base_url, llama.model, list(range(16)), 5))
        assert figures["completion_tokens"] == 5 and figures["prompt_tokens"] == 16
        llama.cluster.rpc[0].popen.kill()
        llama.cluster.rpc[0].popen.wait()
        with pytest.raises(PeerFailure, match="ggml-rpc-server on 127.0.0.2 exited"):
            llama.check()


def test_a_llama_server_that_dies_mid_case_is_its_failure_and_the_case_goes_on(
        binaries, tmp_path) -> None:
    plan = CasePlan(prompts=(16,), tokens=4, clients=(1, 2), requests=2, rounds=2)
    result = CaseResult(Case("m", "int4", 2, "shared", 0.0))
    with served(binaries, tmp_path, "other") as other:
        other.name = "zctl"  # stands in for zctl: a server that keeps working
        other.prepare(1, 2048)
        dying = find_binaries(fake_llama_cpp(tmp_path / "dying-bin", die_after=3))
        with served(dying, tmp_path, "dying") as llama:  # warm-up, round 1, then it dies
            run_case(result, [other, llama], plan, lambda text: [1, 2, 3])
    failure = result.failures["llama.cpp"]
    assert "exited with 3" in failure["error"] and "fake crash" in failure["log_tail"]
    assert len(result.figures["zctl"]["one_stream.p16"]) == 2  # zctl's side completed
    assert [len(result.figures["zctl"][f"serve.c{c}"]) for c in (1, 2)] == [1, 1]
    assert len(result.figures["llama.cpp"]["one_stream.p16"]) == 1


def test_a_llama_bench_that_hangs_is_stopped_and_its_failure_has_its_log(tmp_path) -> None:
    binaries = find_binaries(fake_llama_cpp(tmp_path / "bin", bench=BENCH_HANGS))
    log = tmp_path / "llama-bench.log"
    with pytest.raises(PeerFailure, match="llama-bench still running after 1 s") as caught:
        llama_bench(binaries, tmp_path / "model.gguf", Node("127.0.0.1", None), 4, log,
                    timeout_s=1.0)
    assert caught.value.log_tail == "llama-bench: loading the model"


def test_a_llama_bench_that_prints_an_empty_list_is_its_failure_with_its_log(tmp_path) -> None:
    binaries = find_binaries(fake_llama_cpp(tmp_path / "bin", bench=BENCH_EMPTY_JSON))
    with pytest.raises(PeerFailure, match=r"holds no run's avg_ts and stddev_ts: \[\]") as caught:
        llama_bench(binaries, tmp_path / "model.gguf", Node("127.0.0.1", None), 4,
                    tmp_path / "llama-bench.log")
    assert caught.value.log_tail == "llama-bench: no runs"


def test_a_llama_bench_that_cannot_be_executed_is_its_failure(tmp_path) -> None:
    """A binary built for another machine (here: not an executable format) fails to
    start: that peer's failure, not the run's."""
    binaries = find_binaries(fake_llama_cpp(tmp_path / "bin"))
    bench = binaries.path("bench")
    bench.write_bytes(b"\x7fELF\x00not a real binary")  # (still executable)
    with pytest.raises(PeerFailure, match=r"llama-bench cannot be started: OSError: "
                       r"\[Errno 8\] Exec format error"):
        llama_bench(binaries, tmp_path / "model.gguf", Node("127.0.0.1", None), 4,
                    tmp_path / "llama-bench.log")
