"""tools.decode.overhead: the figures it derives from a run, the bytes of one decode step's
frames as the data plane counts them, the stages' runtime per thread setting."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def test_host_ms_per_token_is_decode_time_minus_stage_time() -> None:
    from tools.decode.overhead import host_ms_per_token
    from zctl.engine.stats import GenerationStats

    stats = GenerationStats(new_tokens=3, decode_ms=30.0, stage_ms=[[6.0, 7.5], [6.5, 7.0]])
    assert host_ms_per_token(stats) == 30.0 / 2 - 13.5
    assert host_ms_per_token(GenerationStats(new_tokens=1)) == 0.0


class _Metrics:
    def __init__(self) -> None:
        self.bytes = [1000, 500]  # hop 0-1, the last hop: counted since the pipe started

    def hop_bytes(self) -> list[int]:
        return list(self.bytes)


class _Pipe:
    """Counts one decode step's frames as the data plane's metrics do."""

    def __init__(self) -> None:
        self.metrics = _Metrics()
        self.steps: list[tuple[int, int]] = []

    def step(self, stream: int, tokens: Any, positions: Any) -> Any:
        self.steps.append((int(tokens[0]), int(positions[0])))
        self.metrics.bytes = [self.metrics.bytes[0] + 2437, self.metrics.bytes[1] + 179]
        return SimpleNamespace(tokens=[5])


def test_a_decode_steps_frames_are_what_the_data_plane_counted_for_one_step() -> None:
    from tools.decode.overhead import step_frame_bytes

    pipe = _Pipe()
    assert step_frame_bytes(pipe, 3, 40, hidden_size=576) == {
        "forward_header": 2437 - 576 * 4, "forward_payload": 576 * 4,
        "reply_header": 179 - 8, "reply_payload": 8}
    assert pipe.steps == [(3, 40)]  # one greedy step of the token at its position


def test_the_stages_runtime_per_thread_setting() -> None:
    from tools.decode.overhead import runtime_config, runtime_spec_of

    assert runtime_spec_of("default").num_threads is None
    spec = runtime_spec_of("2")
    assert spec.num_threads == 2 and not spec.paged_attention  # what stage workers run
    assert runtime_config("2").num_threads == 2 and runtime_config("2").precision == spec.precision
