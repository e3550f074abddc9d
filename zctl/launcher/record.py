"""The record of a running local cluster (``cluster.json`` in the zctl home): where its
processes listen and their pids, so ``zctl cluster down``, ``run``, ``serve`` and ``doctor``
can find them, and whether a recorded pid still runs one of zctl's own processes."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zctl.paths import zctl_home

CLUSTER_FILE = "cluster.json"


class ClusterError(RuntimeError):
    """The cluster could not be started, found, or stopped; the text says why."""


@dataclass
class ClusterRecord:
    control: str  # the coordinator's ROUTER, for nodes and status
    serve: str  # the generation service, for zctl run
    export_dir: str
    pids: list[int]
    logs: list[str] = field(default_factory=list)
    local_nodes: int = 0
    started: float = 0.0
    curve_dir: str = ""  # the coordinator's state dir when CURVE is on (its key pair)
    api: str = ""  # the OpenAI API's address when cluster up --api started it
    cluster_id: str = ""  # an embedded cluster's identity (its coordinator admits its nodes only)
    owned: bool = False  # its processes end with the process that started them (embedded)


def control_curve(record: ClusterRecord | None) -> Any:
    """The CURVE client a console command talks to the coordinator with: the coordinator's
    own key pair (it admits itself), or None for a plain-text cluster."""
    if record is None or not record.curve_dir:
        return None
    from controlplane.security import CurveClient, key_dir, load_or_create_keypair

    public, secret = load_or_create_keypair(key_dir(Path(record.curve_dir)), "coordinator")
    return CurveClient(public, public, secret)


def cluster_file() -> Path:
    return zctl_home() / CLUSTER_FILE


def read_record() -> ClusterRecord | None:
    path = cluster_file()
    if not path.is_file():
        return None
    try:
        return ClusterRecord(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise ClusterError(f"{path} is damaged ({exc}): zctl cluster down stops this zctl "
                           "home's processes whose command is gone and removes it") from None


def write_record(record: ClusterRecord) -> None:
    path = cluster_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record), indent=2))
    os.replace(tmp, path)


def zctl_process(pid: int) -> bool:
    """Whether ``pid`` runs one of zctl's own processes (a coordinator, a node, the API):
    a pid in an old cluster.json may belong to some other program by now."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a == b"-m" and b in (b"zctl.launcher", b"zctl") for a, b in
               zip(argv, argv[1:], strict=False))


def alive(pid: int) -> bool:
    """Whether the process runs (an exited child not yet reaped does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc here: the signal said it exists
    return stat.rpartition(")")[2].split()[0] != "Z"
