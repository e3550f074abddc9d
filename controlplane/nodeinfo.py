"""What a node says about itself: persistent id, devices, memory, versions, addresses.

The node id is made on a node's first start and kept in ``<state_dir>/node_id`` so a
restarted node reclaims its place. Probing OpenVINO is guarded: a device that will not
report its memory is still listed, with memory unknown.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from controlplane.checks import NODE_ID_RE
from controlplane.records import DeviceInfo
from zctl.endpoints import split_bind_address

log = logging.getLogger("zctl.controlplane")
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_DATA_PORT = 10000  # a fresh data port is chosen from here up to the ephemeral range


class NodeIdentityError(RuntimeError):
    """The node id file exists but cannot be used."""


def load_or_create_node_id(state_dir: Path) -> str:
    """Read ``<state_dir>/node_id``; on first start create it (host name + random suffix)."""
    path = state_dir / "node_id"
    if path.exists():
        try:
            node_id = path.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise NodeIdentityError(f"cannot read the node id from {path}: {exc}") from None
        if not NODE_ID_RE.match(node_id):
            raise NodeIdentityError(
                f"{path} holds {node_id[:80]!r}, not a node id (1-64 characters of "
                f"[A-Za-z0-9._-]); delete the file to give this node a new identity")
        return node_id
    state_dir.mkdir(parents=True, exist_ok=True)
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())
    node_id = f"{(host or 'node')[:40].strip('-_') or 'node'}-{uuid.uuid4().hex[:8]}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(node_id + "\n")
    os.replace(tmp, path)
    log.info("new node id %s written to %s", node_id, path)
    return node_id


def openvino_version() -> str:
    import openvino

    return str(openvino.get_version())


def zctl_version() -> str:
    try:
        return metadata.version("zctl")
    except metadata.PackageNotFoundError:
        return "unknown"


def short_version(full: str) -> str:
    """'2026.4.1-22982-e213a147257-releases/2026/4' -> '2026.4.1'."""
    return full.split("-", 1)[0]


def describe_versions(ours: str, theirs: str) -> tuple[str, str]:
    """Short release numbers, or the full build strings when the releases are equal."""
    if short_version(ours) != short_version(theirs):
        return short_version(ours), short_version(theirs)
    return ours, theirs


def probe_devices(core: Any | None = None) -> list[DeviceInfo]:
    """The devices OpenVINO sees, with memory where the plugin reports it."""
    if core is None:
        from dataplane.runtime.ov_core import shared_core

        core = shared_core()
    devices = []
    for name in core.available_devices:
        full_name = ""
        memory: int | None = None
        try:
            full_name = str(core.get_property(name, "FULL_DEVICE_NAME"))
        except RuntimeError:
            pass
        if name.startswith("GPU"):
            try:
                memory = int(core.get_property(name, "GPU_DEVICE_TOTAL_MEM_SIZE"))
            except (RuntimeError, TypeError, ValueError):
                memory = None
        elif name == "CPU":
            memory = int(psutil.virtual_memory().total)
        devices.append(DeviceInfo(name=name, full_name=full_name, memory_bytes=memory))
    return devices


def ram(limit: int = 0) -> tuple[int, int]:
    """(total, available) system RAM in bytes; with ``limit`` (bytes > 0: what the node's
    owner lends zctl's stages), neither is more than that."""
    vm = psutil.virtual_memory()
    total, free = int(vm.total), int(vm.available)
    return (min(total, limit), min(free, limit)) if limit > 0 else (total, free)


def route_host(target_host: str) -> str:
    """The local address this machine uses to reach ``target_host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target_host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def endpoint_host(endpoint: str) -> str:
    """'tcp://10.0.0.5:5555' -> '10.0.0.5', 'tcp://[::1]:5555' -> '::1', and of an address
    to bind 'tcp://127.0.0.1:*' -> '127.0.0.1' (``split_bind_address``); ValueError if
    ``endpoint`` is no tcp://HOST:PORT address."""
    return split_bind_address(endpoint)[0]


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def ephemeral_ports(path: Path = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's range of ephemeral ports (Linux's default where it cannot be read)."""
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def fresh_port(host: str, ephemeral: tuple[int, int] | None = None) -> int:
    """A free port below the kernel's ephemeral range, else any free one.

    A data port is chosen when a node starts and bound only when a stage is wired, maybe
    seconds later. A port from the ephemeral range can be taken in between as the source
    port of an outgoing connection (one of the node's own), and the stage then cannot
    bind; below the range only an explicit bind takes it."""
    low, _ = ephemeral or ephemeral_ports()
    rng = random.Random()
    for _ in range(64):
        if low - 1 <= LOWEST_DATA_PORT:
            break
        port = rng.randrange(LOWEST_DATA_PORT, low)
        if _port_free(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def choose_data_port(host: str, state_dir: Path, port: int = 0) -> int:
    """The data-plane port: the configured one, else the one used last time, else a free one
    (``fresh_port``).

    Reusing the last port keeps the pipeline wiring unchanged when a node restarts.
    """
    if port:
        return port
    path = state_dir / "data_port"
    try:
        last = int(path.read_text().strip())
    except (OSError, ValueError):
        last = 0
    if last and _port_free(host, last):
        return last
    chosen = fresh_port(host)
    state_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{chosen}\n")
    return chosen
