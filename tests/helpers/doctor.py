"""What zctl doctor looks at, made up: a coordinator's status record, an export directory
with the files its manifest lists (no real model in them), a node's cached shard, a port
nothing listens on."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from controlplane.records import ClusterStatus, NodeStatus, StageStatus
from zctl.manifest import ExportManifest, ModelSpec, StageSpec, sha256_file, write_manifest

OV = "2026.4.1-22982-e213a147257-releases/2026/4"
GiB = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def node(node_id: str, stage: int | None, **kw: object) -> NodeStatus:
    fields: dict = dict(node_id=node_id, host="10.0.0.2", state="serving", stage=stage,
                        data_addr=f"tcp://10.0.0.2:{5000 + (stage or 0)}", last_seen_s=0.3,
                        devices=[], ram_free=4 * GiB, ram_total=8 * GiB, openvino=OV,
                        zctl="0.1.0", cached_shards=1, local=node_id == "coord",
                        last_sent_s=0.2)
    fields.update(kw)
    return NodeStatus(**fields)


def cluster(nodes: list[NodeStatus], pipeline: str = "serving", **kw: object) -> ClusterStatus:
    stages = [StageStatus(0, 0, 17, "a" * 64, 100 << 20, "coord", "serving"),
              StageStatus(1, 17, 30, "b" * 64, 80 << 20, "n1", nodes[-1].state)]
    fields: dict = dict(coordinator_id="coord", session="s", endpoint="tcp://10.0.0.1:5550",
                        protocol=1, openvino=OV, zctl="0.1.0", export_dir="/x", model="m",
                        pipeline=pipeline, epoch=1, uptime_s=1.0, plan_error="", nodes=nodes,
                        stages=stages, refused=[], counters={}, time_s=1000.0,
                        heartbeat_interval=1.0, liveness=3)
    fields.update(kw)
    return ClusterStatus(**fields)


def fake_export(root: Path, stages: int = 2, size: int = 4096) -> ExportManifest:
    """An export directory with the files a manifest lists (no real model in them)."""
    root.mkdir(parents=True)
    files, specs = {}, []
    for i in range(stages):
        for ext in ("xml", "bin"):
            (root / f"stage{i}.{ext}").write_bytes(bytes([i]) * size)
            files[f"stage{i}.{ext}"] = sha256_file(root / f"stage{i}.{ext}")
        specs.append(StageSpec(i, 2 * i, 2 * i + 2, f"stage{i}.xml", f"stage{i}.bin", ("x",),
                               ("y",), (), i == 0, i == stages - 1))
    model = ModelSpec("tiny", "llama", 2 * stages, 64, 4, 2, 16, 100, (1.0,), 1.0, 128, 1, (2,))
    manifest = ExportManifest(model, tuple(specs), "fp32", None, "f32", True, {}, files)
    write_manifest(root, manifest)
    return manifest


def cache_shard(state: Path, export: Path, manifest: ExportManifest, index: int) -> Path:
    """The shard of stage ``index`` as a node caches it (<state>/shards/<hash>/)."""
    target = state / "shards" / manifest.stage_hash(index)
    target.mkdir(parents=True)
    spec = manifest.stages[index]
    for name in ("manifest.json", spec.xml, spec.bin):
        shutil.copyfile(export / name, target / name)
    return target
