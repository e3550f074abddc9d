"""Live fuzzing: hostile messages to every socket a running local cluster listens on.

``zctl bench fuzz``: starts a local cluster on loopback (exact numerics) and its HTTP
API, runs a reference generation through the generation service and the API, then sends
``--messages`` hostile messages (tools.robustness.fuzz_messages) to each listening socket in turn:
the coordinator's control ROUTER, the generation service's ROUTER, every stage's data
PULL and the HTTP API; then messages just over each socket's size cap, and raw ZMTP
frames whose length field is over it. After each socket: every process alive, the
pipeline serving, and the reference generation again, token for token. Then a second
cluster with CURVE: clients with a fresh, unknown key pair (and plain-text ones) send
valid messages to its control ROUTER and data PULLs, and must get nothing back (no
answer, no finished handshake), while it keeps serving the same tokens.

    python -m tools.robustness.fuzz --json
    python -m tools.robustness.fuzz --model ~/.cache/zctl/exports/smollm2-135m-int8-2stages

Targets: 0 crashes on every socket, the cluster serving after each, the outputs
unchanged, and 0 answers to an unknown CURVE key.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
import zmq

from tools.harness.cluster import local_cluster, served_cluster
from tools.harness.load import served_model
from tools.harness.models import export_or_cached
from tools.harness.options import Json, fail
from tools.harness.report import err, run_record
from tools.robustness.fuzz_messages import (
    ModelShape,
    control_seeds,
    data_frame,
    frame_seed,
    http_case,
    json_message,
    over_cap,
    over_cap_body,
    service_seeds,
)
from tools.robustness.fuzz_send import Tally, curve_probe, fuzz_http, fuzz_zmq, jsonable, seeded, zmtp_dropped

PROMPT = "Tell me about the lighthouse on the hill."
REFERENCE_TOKENS = 16


@dataclass(frozen=True)
class Target:
    """A listening socket: what it is (control, service, data, api), where, its cap."""

    name: str
    kind: str
    address: str
    cap: int


@dataclass
class Cluster:
    record: Any  # zctl.launcher.record.ClusterRecord
    export_dir: Path
    model: str  # the name the API serves it by ("" without the API)


def exact_runtime() -> Any:
    from zctl.launcher.processes import runtime_spec

    return runtime_spec("f32", None, "CPU", "f32", dynamic_quantization=False)


@contextmanager
def running_cluster(export_dir: Path, root: Path, curve: bool, api: bool) -> Iterator[Cluster]:
    """A local cluster (as many nodes as the export has stages), serving: with its API in
    front (``served_cluster``, its zctl home ``root``), or without (its state in ``root``)."""
    from zctl.manifest import load_manifest

    nodes = len(load_manifest(export_dir, verify_files=False).stages)
    if api:
        with served_cluster(export_dir, nodes, exact_runtime(), root, curve=curve,
                            heal_after=None) as record:
            yield Cluster(record, export_dir, asyncio.run(served_model(record.api)).id)
    else:
        with local_cluster(export_dir, nodes, exact_runtime(), root, curve=curve,
                           heal_after=None) as record:
            yield Cluster(record, export_dir, "")


def reference(cluster: Cluster) -> dict[str, Any]:
    """The fixed prompt's greedy tokens and text through the generation service, and its
    text through the API (when it runs)."""
    import httpx

    from zctl.engine.requests import GenerationDone, GenerationRequest
    from zctl.service.client import generate_many

    request = GenerationRequest(uuid.uuid4().hex[:16], PROMPT, REFERENCE_TOKENS, ignore_eos=True,
                                temperature=0.0)
    done = [m for m in generate_many(cluster.record.serve, [request], 120, 60)
            if isinstance(m, GenerationDone)][-1]
    out: dict[str, Any] = {"tokens": done.tokens, "text": done.text, "error": done.error}
    if cluster.model:
        answer = httpx.post(f"{cluster.record.api}/v1/chat/completions", timeout=120, json={
            "model": cluster.model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": REFERENCE_TOKENS, "temperature": 0, "zctl": {"ignore_eos": True}})
        out["api_text"] = (answer.json()["choices"][0]["message"]["content"]
                           if answer.status_code == 200 else f"HTTP {answer.status_code}")
    return out


def checked_reference(cluster: Cluster) -> dict[str, Any]:
    """The reference generation again, or what stopped it (the cluster no longer serves)."""
    from controlplane.client import ClusterUnreachable
    from zctl.service.errors import ServiceUnavailable

    try:
        return reference(cluster)
    except (ClusterUnreachable, ServiceUnavailable, OSError, KeyError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "tokens": None}


def listening_sockets(cluster: Cluster) -> list[Target]:
    """Every socket the cluster listens on, with its inbound size cap."""
    from controlplane.client import query_status
    from controlplane.coordinator import CoordinatorConfig
    from dataplane.wire.transport import DEFAULT_OPTIONS
    from zctl.launcher.record import control_curve
    from zctl.serve.app import MAX_BODY_BYTES
    from zctl.service.server import MAX_REQUEST_BYTES

    record = cluster.record
    status = query_status(record.control, 10, control_curve(record))
    control_cap = CoordinatorConfig.__dataclass_fields__["max_message_bytes"].default
    targets = [Target("control ROUTER", "control", record.control, control_cap),
               Target("service ROUTER", "service", record.serve, MAX_REQUEST_BYTES)]
    for node in sorted(status.nodes, key=lambda n: (n.stage is None, n.stage or 0)):
        targets.append(Target(f"data PULL stage {node.stage} ({node.node_id})", "data",
                              node.data_addr, DEFAULT_OPTIONS.max_message_bytes))
    if record.api:
        targets.append(Target("HTTP API", "api", record.api, MAX_BODY_BYTES))
    return targets


def health(cluster: Cluster) -> dict[str, Any]:
    """Which processes are alive, whether the pipeline serves and the API answers 200."""
    import httpx

    from controlplane.client import ClusterUnreachable, query_status
    from zctl.launcher.record import alive, control_curve

    record = cluster.record
    dead = [pid for pid in record.pids if not alive(pid)]
    try:
        pipeline = query_status(record.control, 10, control_curve(record)).pipeline
    except ClusterUnreachable as exc:
        pipeline = f"unreachable: {exc}"
    api_ok = True
    if record.api:
        try:
            api_ok = httpx.get(f"{record.api}/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            api_ok = False
    return {"dead": dead, "serving": pipeline == "serving" and api_ok, "pipeline": pipeline}


def fuzz_target(target: Target, count: int, seed: int, shape: ModelShape, model: str) -> Tally:
    """``count`` hostile messages to one socket, then a few just over its cap."""
    rng = seeded(seed, target.name)
    over = max(3, count // 1000)
    if target.kind == "api":
        return fuzz_http(target.address, count, lambda: http_case(rng, model, target.cap),
                         lambda: over_cap_body(rng, model, target.cap), over)
    if target.kind == "data":
        return fuzz_zmq(target.address, zmq.PUSH, count, lambda: data_frame(rng, shape),
                        None, 0)  # its 2 GiB cap is tried with a raw frame head (zmtp_caps)
    seeds = control_seeds() if target.kind == "control" else service_seeds()
    return fuzz_zmq(target.address, zmq.DEALER, count,
                    lambda: json_message(rng, seeds, target.cap),
                    lambda: over_cap(rng, target.cap), over)


def zmtp_caps(target: Target) -> dict[str, bool]:
    """Whether the socket drops a peer announcing a frame of cap + 1 bytes, and of 2**63."""
    peer = "PUSH" if target.kind == "data" else "DEALER"
    return {f"announced {size} bytes dropped": zmtp_dropped(target.address, peer, size)
            for size in (target.cap + 1, (1 << 63) - 1)}


def model_shape(export_dir: Path) -> ModelShape:
    from zctl.manifest import load_manifest

    model = load_manifest(export_dir, verify_files=False).model
    return ModelShape(model.hidden_size, model.vocab_size)


def fuzz_cluster(cluster: Cluster, count: int, seed: int) -> dict[str, Any]:
    """Every listening socket fuzzed in turn, the cluster checked after each."""
    expected = reference(cluster)
    if expected["error"] or expected.get("api_text", expected["text"]) != expected["text"]:
        raise RuntimeError(f"the reference generation failed before any fuzzing: {expected}")
    shape = model_shape(cluster.export_dir)
    sockets: dict[str, Any] = {}
    for target in listening_sockets(cluster):
        err.print(f"fuzzing {target.name} at {target.address} ({count} messages) ...")
        tally = fuzz_target(target, count, seed, shape, cluster.model)
        caps = zmtp_caps(target) if target.kind != "api" else {}
        after = health(cluster)
        again = checked_reference(cluster)
        internal = sum(v for k, v in tally.statuses.items() if k >= 500 and k != 503)
        sockets[target.name] = {
            **jsonable(tally), "address": target.address, "cap_bytes": target.cap,
            **({"caps": caps} if caps else {}), "crashes": len(after["dead"]) + internal,
            "serving_after": after["serving"], "pipeline_after": after["pipeline"],
            "outputs_unchanged_after": again == expected, "kv_slots_after": kv_slots(cluster)}
    return {"reference": expected, "sockets": sockets,
            "outputs_unchanged": all(s["outputs_unchanged_after"] for s in sockets.values()),
            "processes_alive": not health(cluster)["dead"],
            "coordinator_counters": coordinator_counters(cluster)}


def kv_slots(cluster: Cluster, settle_s: float = 6.0) -> dict[str, int]:
    """KV slots each node's stage holds, by its heartbeats (what forged steps for streams
    no generation uses, or requests left mid-way, leave behind): read until every node
    reports none, for up to ``settle_s`` (a heartbeat may predate the reference
    generation's end), so a count left here is held."""
    from controlplane.client import query_status
    from zctl.launcher.record import control_curve

    record = cluster.record
    end = time.monotonic() + settle_s
    while True:
        status = query_status(record.control, 10, control_curve(record))
        held = {n.node_id: n.kv_slots for n in status.nodes}
        if not any(v > 0 for v in held.values()) or time.monotonic() > end:
            return held
        time.sleep(0.25)


def coordinator_counters(cluster: Cluster) -> dict[str, int]:
    from controlplane.client import query_status
    from zctl.launcher.record import control_curve

    record = cluster.record
    return dict(query_status(record.control, 10, control_curve(record)).counters)


def curve_keys(root: Path, cluster: Cluster) -> dict[str, bytes]:
    """Each listening data PULL's (and the control ROUTER's) real public key."""
    from controlplane.client import query_status
    from controlplane.security import key_dir, read_public_key
    from zctl.launcher.record import control_curve

    record = cluster.record
    coordinator = read_public_key(key_dir(root / "coordinator") / "coordinator.key")
    keys = {record.control: coordinator}
    for node in query_status(record.control, 10, control_curve(record)).nodes:
        index = int(node.host.rsplit(".", 1)[1]) - 1  # 127.0.0.(i + 1) is local node i
        keys[node.data_addr] = coordinator if node.local else read_public_key(
            key_dir(root / f"node{index}") / "node.key")
    return keys


def curve_phase(cluster: Cluster, root: Path, expected: dict[str, Any], seed: int) -> dict[str, Any]:
    """Valid messages from an unknown key pair and in plain text to every CURVE socket."""
    from controlplane.messages import StatusRequest, to_frames

    rng = random.Random(seed)
    shape = model_shape(cluster.export_dir)
    results: dict[str, Any] = {}
    for address, key in curve_keys(root, cluster).items():
        control = address == cluster.record.control
        frames = ([to_frames(StatusRequest())] * 5 + control_seeds() if control
                  else [frame_seed(rng, shape) for _ in range(20)])
        kind = zmq.DEALER if control else zmq.PUSH
        name = "control ROUTER" if control else f"data PULL {address}"
        for client, server_key in (("unknown key", key), ("plain text", None)):
            probe = curve_probe(address, kind, frames, server_key)
            results[f"{name}, {client}"] = {"sent": len(frames), "replies": probe.replies,
                                            "handshakes": probe.handshakes,
                                            "refused_handshakes": probe.refusals}
    after = health(cluster)
    again = checked_reference(cluster)
    return {"probes": results,
            "unknown_key_replies": sum(p["replies"] + p["handshakes"] for p in results.values()),
            "serving_after": after["serving"], "processes_alive": not after["dead"],
            "outputs_unchanged": again["tokens"] == expected["tokens"],
            "service_router": "not CURVE: it binds 127.0.0.1 only (the API and zctl run on "
                              "the coordinator's machine)"}


def main(
    messages: Annotated[int, typer.Option(help="hostile messages per socket")] = 10_000,
    seed: Annotated[int, typer.Option(help="seed of the messages (same seed, same run)")] = 0,
    model: Annotated[str, typer.Option(
        help="an export directory, or a model whose fp32 export is made (random-tiny, "
             "smollm2-135m, an HF directory)")] = "random-tiny",
    nodes: Annotated[int, typer.Option(help="stages (= processes) of a model exported here")] = 2,
    curve: Annotated[bool, typer.Option(help="also probe a CURVE cluster with unknown keys")] =
        True,
    as_json: Json = False,
) -> None:
    if messages < 1 or not 2 <= nodes <= 3:
        fail("--messages >= 1 and --nodes 2 or 3")
    export_dir = export_or_cached(model, nodes, "fp32")
    from zctl.paths import zctl_home

    root = zctl_home() / "fuzz" / uuid.uuid4().hex[:8]
    with running_cluster(export_dir, root / "plain", curve=False, api=True) as cluster:
        report = fuzz_cluster(cluster, messages, seed)
    if curve:
        with running_cluster(export_dir, root / "curve", curve=True, api=False) as cluster:
            report["curve"] = curve_phase(cluster, root / "curve", report["reference"], seed)
    report = {**run_record(), "model": str(export_dir), "settings": {
        "messages": messages, "seed": seed, "curve": curve}, **report}
    report["crashes"] = sum(s["crashes"] for s in report["sockets"].values())
    report["curve_unknown_key_replies"] = report.get("curve", {}).get("unknown_key_replies")
    if as_json:
        print(json.dumps(report))
    else:
        print_report(report)


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"live fuzzing ({report['cpu']}, {report['date']}, {report['commit']})")
    for column in ("socket", "messages", "replies", "over cap", "crashes", "serving after",
                   "outputs unchanged"):
        table.add_column(column)
    for name, s in report["sockets"].items():
        table.add_row(name, str(s["messages"]), str(s["replies"]), str(s["over_cap"]),
                      str(s["crashes"]), str(s["serving_after"]), str(s["outputs_unchanged_after"]))
    console = Console()
    console.print(table)
    console.print(f"crashes: {report['crashes']}; outputs unchanged: {report['outputs_unchanged']}; "
                  f"processes alive: {report['processes_alive']}")
    if "curve" in report:
        c = report["curve"]
        console.print(f"CURVE: unknown key and plain-text clients got {c['unknown_key_replies']} "
                      f"answers or handshakes; serving after: {c['serving_after']}; outputs "
                      f"unchanged: {c['outputs_unchanged']}")


if __name__ == "__main__":
    typer.run(main)
