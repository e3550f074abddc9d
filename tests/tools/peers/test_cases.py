"""The cases of a run, and a case's runner: alternation and failures."""

from __future__ import annotations

import pytest

from tools.peers.cases import Case, CasePlan, CaseResult, CaseRunner, case_matrix
from tools.peers.processes import PeerFailure


def test_the_matrix_leaves_out_a_core_each_for_more_nodes_than_cores() -> None:
    cases, skipped = case_matrix(["smollm2-135m"], ["int4"], ["1", "2-split", "3-split",
                                                             "3-shared"], [0, 10], cores=2)
    keys = [c.key for c in cases]
    assert keys == ["smollm2-135m/int4/1n/0ms", "smollm2-135m/int4/2n-split/0ms",
                    "smollm2-135m/int4/2n-split/10ms", "smollm2-135m/int4/3n-shared/0ms",
                    "smollm2-135m/int4/3n-shared/10ms"]
    assert set(skipped) == {"smollm2-135m/int4/3n-split/0ms", "smollm2-135m/int4/3n-split/10ms"}
    assert "need 3 cores" in skipped["smollm2-135m/int4/3n-split/0ms"]
    with pytest.raises(ValueError, match="unknown topology"):
        case_matrix(["m"], ["int4"], ["4-split"], [0], cores=8)


def test_level_requests_default_to_twice_the_clients() -> None:
    assert CasePlan().level_requests(1) == 8 and CasePlan().level_requests(16) == 32
    assert CasePlan(requests=5).level_requests(16) == 5


class System:
    """A system that measures a constant and may fail after some measurements."""

    def __init__(self, name: str, value: float, fail_after: int = 0) -> None:
        self.name, self.value, self.fail_after = name, value, fail_after
        self.base_url = self.model = ""
        self.measured = 0

    def prepare(self, slots: int, context: int | None = None) -> None:
        pass

    def check(self) -> None:
        if self.fail_after and self.measured >= self.fail_after:
            raise PeerFailure(f"{self.name} exited with 3", "fake crash")


def test_the_order_alternates_and_a_failure_ends_only_that_system() -> None:
    order = []
    zctl, llama = System("zctl", 2.0), System("llama.cpp", 1.0, fail_after=3)

    def measure(system: System) -> dict:
        order.append(system.name)
        system.measured += 1
        return {"decode_tok_s": system.value, "ttft_ms": 1.0}

    result = CaseResult(Case("m", "int4", 2, "split", 0.0))
    runner = CaseRunner(result, [zctl, llama])
    runner.alternate("one_stream.p128", [measure] * 4)
    runner.alternate("serve.c1", [measure])
    assert order[:6] == ["zctl", "llama.cpp", "llama.cpp", "zctl", "zctl", "llama.cpp"]
    assert result.failures["llama.cpp"] == {"error": "llama.cpp exited with 3",
                                            "log_tail": "fake crash"}
    assert len(result.figures["zctl"]["one_stream.p128"]) == 4  # zctl went on
    assert len(result.figures["zctl"]["serve.c1"]) == 1
    assert len(result.figures["llama.cpp"]["one_stream.p128"]) == 2


def test_a_request_error_is_a_failure_of_that_system() -> None:
    result = CaseResult(Case("m", "int4", 1, "shared", 0.0))
    runner = CaseRunner(result, [System("zctl", 1.0)])
    runner.alternate("one_stream.p128", [lambda s: {"error": "http 500: boom"}])
    assert "http 500: boom" in result.failures["zctl"]["error"]
    assert result.record()["case"] == "m/int4/1n/0ms"
