"""Local clusters of processes (zctl.launcher.local): a node started again after it was
lost, the OpenAI API given its key, the data plane alone (stage 0 here, stage workers on
127.0.0.x), and the arguments of a stage-worker process."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from dataplane.runtime.config import RuntimeSpec
from zctl.launcher.local import (
    STATEFUL_WORKERS,
    ClusterError,
    ClusterRecord,
    alive,
    free_port,
    local_data_plane,
    runtime_spec,
    start_api,
    start_local_cluster,
    start_local_node,
    stop_processes,
    wait_serving,
    worker_command,
    write_record,
    zctl_process,
)

EXACT = runtime_spec("f32", None, "CPU", "f32", dynamic_quantization=False)
STATEFUL = RuntimeSpec(precision="f32", kv_cache_precision="f32", dynamic_quantization=False)


def _generate(serve: str, tokens: int = 6) -> list[int]:
    from zctl.engine.requests import GenerationDone, GenerationRequest
    from zctl.service.client import generate_stream

    request = GenerationRequest(uuid.uuid4().hex[:16], "the sky is", tokens, ignore_eos=True)
    done = [m for m in generate_stream(serve, request) if isinstance(m, GenerationDone)][-1]
    assert not done.error, done.error
    return list(done.tokens)


def _until_not_serving(record: ClusterRecord, timeout_s: float = 60.0) -> None:
    """Wait until the coordinator has seen the pipeline break."""
    import time

    from controlplane.client import query_status

    deadline = time.monotonic() + timeout_s
    while query_status(record.control, timeout=5.0).pipeline == "serving":
        assert time.monotonic() < deadline, "the coordinator never saw the node go"
        time.sleep(0.2)


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


def test_node_zero_is_the_coordinator(tmp_path: Path) -> None:
    record = ClusterRecord("tcp://127.0.0.1:1", "", "", [])
    with pytest.raises(ClusterError, match="node 0 is the coordinator"):
        start_local_node(record, 0, tmp_path)
    assert not zctl_process(os.getpid())  # pytest is none of zctl's own processes


@pytest.mark.slow
def test_the_data_plane_alone_generates_what_one_process_does(tiny_exports,
                                                               tmp_path: Path) -> None:
    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.config import RuntimeSpec
    from zctl.engine.scheduler import generate_greedy

    export_dir = tiny_exports.get([(0, 1), (1, 3), (3, 4)])
    prompt = [int(t) for t in np.random.default_rng(3).integers(5, 200, 12)]
    local = list(generate_greedy(LocalChain.load(str(export_dir), RuntimeSpec(
        precision="f32", kv_cache_precision="f32", dynamic_quantization=False)), prompt, 10))
    with local_data_plane(export_dir, STATEFUL, tmp_path) as head:
        assert head.num_stages == 3
        assert list(generate_greedy(head, prompt, 10)) == local
        assert head.timing_summary()["stage2.compute"]["p50"] > 0  # every stage's figures
        logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["stage1.log", "stage2.log"]


@pytest.mark.slow
def test_the_data_plane_with_the_default_runtime_equals_the_local_chain(tiny_exports, dp_hosts,
                                                                        tmp_path: Path) -> None:
    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.config import RuntimeSpec
    from zctl.engine.scheduler import generate_greedy

    export = tiny_exports.get([(0, 2), (2, 4)])
    local = LocalChain.load(str(export), RuntimeSpec())
    with local_data_plane(export, RuntimeSpec(), tmp_path) as pipe:
        got = list(generate_greedy(pipe, [0, 17, 42], 8))
        assert pipe.stats.errors == 0
    assert got == list(generate_greedy(local, [0, 17, 42], 8)) and len(got) == 8


@pytest.mark.slow
def test_a_lost_node_started_again_rejoins_and_the_cluster_serves(tiny_exports,
                                                                   tmp_path: Path) -> None:
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    record = start_local_cluster(export_dir, 2, EXACT, tmp_path, heal_after=None)
    try:
        wait_serving(record, 120)
        assert all(zctl_process(pid) for pid in record.pids)
        before = _generate(record.serve)
        os.killpg(record.pids[1], signal.SIGKILL)
        os.waitpid(record.pids[1], 0)
        _until_not_serving(record)
        pid, log = start_local_node(record, 1, tmp_path)
        record.pids.append(pid)
        assert log == str(tmp_path / "logs" / "node1.log") and alive(pid)
        wait_serving(record, 120)
        assert _generate(record.serve) == before
    finally:
        stop_processes(record.pids)
    assert not any(alive(pid) for pid in record.pids)


@pytest.mark.slow
def test_the_api_requires_the_key_it_is_given(tiny_exports, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))  # where zctl serve finds it
    monkeypatch.setenv("ZCTL_API_KEY", "from-the-shell")
    record = start_local_cluster(tiny_exports.get([(0, 2), (2, 4)]), 2, EXACT, tmp_path)
    try:
        wait_serving(record, 120)
        write_record(record)
        keyed = start_api(record, f"127.0.0.1:{free_port('127.0.0.1')}", api_key="sesame")
        record.pids = keyed.pids
        assert zctl_process(keyed.pids[-1])
        assert "sesame" not in Path(f"/proc/{keyed.pids[-1]}/cmdline").read_text()
        models = f"{keyed.api}/v1/models"
        assert httpx.get(models, timeout=10).status_code == 401
        assert httpx.get(models, timeout=10, headers={
            "Authorization": "Bearer from-the-shell"}).status_code == 401
        assert httpx.get(models, timeout=10, headers={
            "Authorization": "Bearer sesame"}).status_code == 200
        open_api = start_api(record, f"127.0.0.1:{free_port('127.0.0.1')}", api_key="")
        record.pids = open_api.pids
        assert httpx.get(f"{open_api.api}/v1/models", timeout=10).status_code == 200
        shell = start_api(record, f"127.0.0.1:{free_port('127.0.0.1')}")
        record.pids = shell.pids
        assert httpx.get(f"{shell.api}/v1/models", timeout=10).status_code == 401
    finally:
        stop_processes(record.pids)
