"""A local cluster placed by the planner, with profiles kept in the processes' state
directories (as ``zctl node profile`` keeps them) rather than measured: a node whose
profile says it is four times slower is left out as a spare, with the planner's reason in
the status; a much faster node that joins the serving cluster takes the stages over
(a re-plan), and the node it replaces becomes a spare."""

from __future__ import annotations

import json
import time
from pathlib import Path

from controlplane.client import query_status
from controlplane.nodeinfo import load_or_create_node_id, openvino_version
from controlplane.planner.export_shape import export_shape
from controlplane.planner.measured import profile_dict
from controlplane.planner.profile import GRAPH_VERSION
from controlplane.profile_store import ProfileStore
from controlplane.records import ClusterStatus, ProfileRecord
from dataplane.runtime.config import RuntimeSpec
from zctl.launcher.local import start_local_cluster, start_local_node, stop_processes, wait_serving
from zctl.manifest import load_manifest

MEMORY_MB = 1000  # each process lends this much: with the profiles' layers, two layers fit
LAYER_BYTES = 350_000_000


def keep_profile(state_dir: Path, export: Path, layer_s: float) -> str:
    """Write a profile of the export's model into ``state_dir``; the node id there."""
    manifest = load_manifest(export)
    shape = export_shape(manifest, export)
    record = ProfileRecord(shape.fingerprint(), manifest.weight_format, "CPU",
                           openvino_version(), [layer_s * (1 + 0.2 * i) for i in range(4)],
                           [layer_s * (1 + 0.2 * i) for i in range(4)], 5000.0, 3e-4,
                           LAYER_BYTES, 0, "injected by the test", measured_at=time.time(),
                           graph=GRAPH_VERSION, engine_decode_s=[1e-4] * 4)
    store = ProfileStore(state_dir)
    path = store.path(shape, record.weights, record.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile_dict(record)))
    return load_or_create_node_id(state_dir)


def wait_for(control: str, what: str, done, timeout_s: float = 90.0) -> ClusterStatus:  # noqa: ANN001
    end = time.monotonic() + timeout_s
    while True:
        status = query_status(control, timeout=5)
        if done(status):
            return status
        assert time.monotonic() < end, f"{what}: {json.dumps(status.to_dict())[:3000]}"
        time.sleep(0.3)


def runs(status: ClusterStatus) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for stage in status.stages:
        out.setdefault(stage.node_id or "", []).append(stage.index)
    return out


def test_the_planner_places_a_local_cluster_and_re_plans_when_a_faster_node_joins(
        tiny_exports, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    export = tiny_exports.get([(0, 1), (1, 2), (2, 3), (3, 4)])
    root = tmp_path / "local"
    head = keep_profile(root / "coordinator", export, 2e-3)
    fast = keep_profile(root / "node1", export, 2e-3)
    slow = keep_profile(root / "node2", export, 8e-3)  # four times slower
    faster = keep_profile(root / "node3", export, 2e-4)
    record = start_local_cluster(export, 3, RuntimeSpec(), root, memory_mb=MEMORY_MB,
                                 heal_after=0.0)
    pids = list(record.pids)
    try:
        wait_serving(record, 120)
        status = query_status(record.control, timeout=5)
        assert status.placement.startswith("by the planner"), status.placement
        assert runs(status) == {head: [0, 1], fast: [2, 3]}
        assert set(status.left_out) == {slow} and status.left_out[slow]
        assert next(n for n in status.nodes if n.node_id == slow).state == "idle"

        pid, _ = start_local_node(record, 3, root, memory_mb=MEMORY_MB)
        pids.append(pid)
        status = wait_for(record.control, "the faster node takes the stages over", lambda s: (
            s.pipeline == "serving" and runs(s) == {head: [0, 1], faster: [2, 3]}))
        assert "re-planned" in status.placement, status.placement
        states = {n.node_id: n.state for n in status.nodes}
        assert states[fast] == "idle" and states[slow] == "idle"
    finally:
        stop_processes(pids)


def test_a_re_plan_on_a_join_keeps_a_running_generation_exactly(tiny_exports, tmp_path: Path,
                                                                monkeypatch) -> None:  # noqa: ANN001
    """A faster node joins while a long greedy generation runs: the re-plan is applied
    between steps (the generation pauses while the pipeline is re-wired) and the
    generation ends with the tokens of a run nothing happened to."""
    import uuid

    from dataplane.head.local_chain import LocalChain
    from tests.helpers.generating import generating_client
    from zctl.engine.requests import GenerationChunk, GenerationDone, GenerationRequest
    from zctl.engine.scheduler import generate_greedy
    from zctl.engine.tokenizer import ChatTokenizer
    from zctl.launcher.processes import link_shape

    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    export = tiny_exports.get([(0, 1), (1, 2), (2, 3), (3, 4)])
    exact = RuntimeSpec(precision="f32", kv_cache_precision="f32", dynamic_quantization=False)
    tokens = 420
    expected = list(generate_greedy(LocalChain.load(str(export), exact),
                                    ChatTokenizer(export).encode("the sky is"), tokens))
    root = tmp_path / "local"
    head = keep_profile(root / "coordinator", export, 2e-3)
    # memory puts two layers on each process; the node first placed is so slow that the
    # faster one is worth far more than the re-plan's 10% despite the hops' 60 ms a token
    slow = keep_profile(root / "node1", export, 2e-2)
    faster = keep_profile(root / "node2", export, 2e-4)
    delay = 30  # per hop, two a token: ~25 s of generation, outlasting the join and re-plan
    record = start_local_cluster(export, 2, exact, root, memory_mb=MEMORY_MB,
                                 link_delay_ms=delay)
    pids = list(record.pids)
    try:
        wait_serving(record, 120)
        assert runs(query_status(record.control, timeout=5)) == {head: [0, 1], slow: [2, 3]}
        request = GenerationRequest(uuid.uuid4().hex[:16], "the sky is", tokens,
                                    ignore_eos=True, temperature=0.0)
        messages: list = []
        thread = generating_client(record.serve, [request], messages)
        pid, _ = start_local_node(record, 2, root, memory_mb=MEMORY_MB, link=link_shape(delay))
        pids.append(pid)
        thread.join(180)
        assert not thread.is_alive()
        (done,) = [m for m in messages if isinstance(m, GenerationDone)]
        assert done.error == "" and done.tokens == expected
        status = wait_for(record.control, "the re-plan", lambda s: s.pipeline == "serving")
        assert "re-planned" in status.placement, status.placement
        assert runs(status) == {head: [0, 1], faster: [2, 3]}, status.placement
        notes = [m.note for m in messages if isinstance(m, GenerationChunk) and m.note]
        assert notes and notes[-1].startswith("resumed after "), notes  # it was re-wired
    finally:
        stop_processes(pids)
