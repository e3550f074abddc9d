"""A data plane of stage-worker processes (zctl.launcher.data_plane) without starting any:
a stage-worker's arguments, and the exports it refuses before a process starts. (The data
planes themselves: tests/e2e/test_local_clusters.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from dataplane.runtime.config import RuntimeSpec
from zctl.launcher.data_plane import STATEFUL_WORKERS, local_data_plane, worker_command
from zctl.launcher.record import ClusterError

STATEFUL = RuntimeSpec(precision="f32", kv_cache_precision="f32", dynamic_quantization=False)


def test_a_worker_command_carries_the_runtime() -> None:
    argv = worker_command(Path("/e"), 2, "tcp://127.0.0.3:7001", "tcp://127.0.0.1:7000",
                          RuntimeSpec(precision=None, num_threads=2, kv_cache_precision="u8",
                                      dynamic_quantization=False))
    assert argv[:3] == ["-m", "dataplane.worker", "/e"] and argv[-1] == "--no-dynamic-quantization"
    assert dict(zip(argv[3:-1:2], argv[4:-1:2], strict=True)) == {
        "--stage": "2", "--bind": "tcp://127.0.0.3:7001", "--send-to": "tcp://127.0.0.1:7000",
        "--device": "CPU", "--precision": "default", "--kv-cache-precision": "u8",
        "--threads": "2"}
    plain = worker_command(Path("/e"), 1, "b", "s", RuntimeSpec())
    assert "--threads" not in plain and "--no-dynamic-quantization" not in plain
    assert plain[plain.index("--kv-cache-precision") + 1] == "default"
    with pytest.raises(ClusterError, match="stateful"):
        worker_command(Path("/e"), 1, "b", "s", RuntimeSpec(paged_attention=True))
    assert "paged attention" in STATEFUL_WORKERS


def test_the_data_plane_of_one_stage_or_of_paged_stages_is_refused(tiny_exports) -> None:
    with pytest.raises(ClusterError, match="one-stage"), \
            local_data_plane(tiny_exports.get([(0, 4)]), STATEFUL):
        pass
    with pytest.raises(ClusterError, match="stateful"), \
            local_data_plane(tiny_exports.get([(0, 2), (2, 4)]), RuntimeSpec(paged_attention=True)):
        pass
