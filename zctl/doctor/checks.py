"""``zctl doctor``'s checks, in order: this machine, the cluster, the API.

The checks: this machine's OpenVINO devices and the CPU features that change numerics;
versions here, on the coordinator and on every enrolled node; the control port (a status
round trip), each node's heartbeats both ways as the coordinator sees them, each data
pipe (the coordinator's record and a TCP connect from here); the clock offset to the
coordinator; the hashes of the local exports and shard caches; free memory against the
stages placed here; the HTTP API's /health. Without a cluster the local checks still run.
The verdicts are ``zctl.doctor.verdicts``'s, the facts ``zctl.doctor.probes``'s; the
command that prints them is ``zctl.cli.doctor``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zctl.doctor import probes
from zctl.doctor import verdicts as dx
from zctl.doctor.verdicts import Check
from zctl.endpoints import split_address

DEFAULT_API = "http://127.0.0.1:8000"  # where zctl serve listens by default


@dataclass
class DoctorOptions:
    """Where to find the cluster and the API (as ``zctl cluster status`` finds a cluster)."""

    endpoint: str | None = None
    curve_server_key: Path | None = None
    curve_keys: Path | None = None
    state_dirs: list[Path] = field(default_factory=list)
    api: str = DEFAULT_API
    api_explicit: bool = False
    timeout: float = 3.0
    lan: bool = True  # the LAN discovery checks (multicast, announced clusters)
    browse_s: float = 2.0  # how long those listen for announcements


@dataclass
class _Cluster:
    """What the cluster section found: its checks, and the status if there was one."""

    checks: list[Check]
    status: Any = None  # a ClusterStatus


def run_checks(opts: DoctorOptions) -> list[Check]:
    """Every check, in order: this machine, the cluster, the API."""
    from controlplane.messages import PROTOCOL_VERSION
    from controlplane.nodeinfo import openvino_version, ram, zctl_version
    from zctl.paths import export_cache_dir, zctl_home

    versions = (_openvino_version(openvino_version), zctl_version(), PROTOCOL_VERSION)
    home = zctl_home()
    here = probes.node_ids(probes.state_dirs(home, opts.state_dirs))
    checks = [dx.versions_here_check(*versions)]
    devices, error = probes.openvino_devices()
    checks += dx.device_checks(devices, error)
    cpu = next((d for d in devices if d.name == "CPU"), None)
    checks.append(dx.cpu_features_check(probes.cpu_flags(), cpu.capabilities if cpu else ()))
    cluster = _cluster_checks(opts, versions, here)
    exports = probes.export_dirs(export_cache_dir())
    if cluster.status is not None and Path(cluster.status.export_dir).is_dir() and \
            Path(cluster.status.export_dir).resolve() not in {e.resolve() for e in exports}:
        exports.append(Path(cluster.status.export_dir))
    checks += _integrity_checks(home, exports, opts.state_dirs)
    served = Path(cluster.status.export_dir) if cluster.status is not None else \
        next(iter(exports), None)
    if served is not None and served.is_dir():
        checks.append(dx.grammar_check(probes.grammar_probe(served, _label(served, home))))
    total, available = ram()
    if cluster.status is not None:
        needs = probes.stage_needs_here(cluster.status, here)
        checks.append(dx.memory_check(available, total, needs))
    else:
        need = probes.largest_export_need(exports)
        checks.append(dx.memory_check(available, total, [need] if need else [],
                                      without="no cluster status and no local export"))
    checks += cluster.checks
    if opts.lan:
        checks += _lan_checks(opts, here, cluster.status)
    checks.append(dx.api_check(opts.api, probes.http_health(opts.api), opts.api_explicit))
    return checks


def _lan_checks(opts: DoctorOptions, here: dict[str, Path], status: Any) -> list[Check]:
    """Multicast on each LAN interface, the clusters announced, their endpoints, node ids."""
    from controlplane.messages import PROTOCOL_VERSION
    from zctl.discovery.browser import browse
    from zctl.discovery.interfaces import local_interfaces
    from zctl.discovery.records import JOIN_BY_ADDRESS

    interfaces = local_interfaces()
    checks = [dx.multicast_check(probes.multicast_loops(probes.lan_interfaces(interfaces)))]
    try:
        sightings = browse(PROTOCOL_VERSION, opts.browse_s)
    except OSError as exc:
        return [*checks, Check("LAN clusters", dx.FAIL, f"cannot listen for announcements: "
                                                        f"{exc}; {JOIN_BY_ADDRESS}")]
    found = sightings.announcements
    reach = probes.tcp_connect_all([a.control for a in found], min(opts.timeout, 2.0))
    members = [(n.node_id, n.host) for n in status.nodes] if status is not None else []
    return [*checks, dx.clusters_check(found, sightings.refused), dx.same_name_check(found),
            *dx.endpoint_checks(found, {c: "" if f.ok else f.error for c, f in reach.items()}),
            dx.node_id_check(here, [i.address for i in interfaces], found, members)]


def _openvino_version(get: Any) -> str:
    try:
        return str(get())
    except Exception as exc:  # noqa: BLE001 - doctor reports a broken install, not raises
        return f"not importable ({type(exc).__name__})"


def _integrity_checks(home: Path, exports: list[Path], extra: list[Path]) -> list[Check]:
    out = [dx.integrity_check(probes.check_export(e, _label(e, home))) for e in exports]
    for state in probes.state_dirs(home, extra):
        if (state / "shards").is_dir():
            out.append(dx.integrity_check(probes.check_shard_cache(state / "shards",
                                                                   _label(state, home))))
    if not out:
        out.append(Check("shard files", dx.PASS, f"no export or shard cache under {home} "
                                                 "(nothing to check)"))
    return out


def _label(path: Path, home: Path) -> str:
    """A path as short as it stays clear: relative to ZCTL_HOME (or its exports) if inside."""
    for base in (home / "exports", home):
        try:
            return str(path.resolve().relative_to(base.resolve()))
        except ValueError:
            continue
    return str(path)


def _cluster_checks(opts: DoctorOptions, versions: tuple[str, str, int],
                    here: dict[str, Path]) -> _Cluster:
    """The coordinator's status and everything judged from it; a skip (warn) without a
    cluster, a fail when the one named does not answer."""
    from controlplane.client import ClusterUnreachable, query_status_timed
    from zctl.launcher.record import ClusterError, alive, read_record

    try:
        record = read_record()
    except ClusterError as exc:
        return _Cluster([Check("cluster", dx.FAIL, str(exc))])
    if opts.endpoint is None and record is None:
        return _Cluster([dx.skipped_cluster_check(
            "no cluster is up here (no cluster.json) and no --endpoint was given")])
    if opts.endpoint is None and record is not None and record.pids and not alive(record.pids[0]):
        return _Cluster([dx.skipped_cluster_check(
            f"cluster.json names a coordinator (pid {record.pids[0]}) that is not running; "
            "give --endpoint to ask one elsewhere")])
    target = opts.endpoint or record.control  # type: ignore[union-attr]
    try:
        curve = _curve(opts, record)
    except ValueError as exc:
        return _Cluster([Check("control port", dx.FAIL, f"{target}: CURVE keys: {exc}")])
    try:
        timed = query_status_timed(target, opts.timeout, curve)
    except (ClusterUnreachable, OSError, RuntimeError) as exc:
        try:  # a TCP connect tells nothing listening from a peer that does not answer
            split_address(target)
            tcp = probes.tcp_connect(target, min(opts.timeout, 2.0))
        except ValueError:
            tcp = None
        return _Cluster([dx.control_check(target, None, str(exc), tcp, curve=curve is not None)])
    status = timed.status
    on_coordinator = status.coordinator_id in here
    note = " (the coordinator runs on this machine: one clock)" if on_coordinator else ""
    addresses = [n.data_addr for n in status.nodes if n.stage is not None]
    checks = [dx.control_check(target, timed.rtt_s),
              dx.clock_check(timed.sent, status.time_s, timed.received, note=note),
              dx.pipeline_check(status),
              *dx.version_checks(status, *versions),
              *dx.refusal_checks(status),
              *dx.heartbeat_checks(status),
              *dx.data_pipe_checks(status, probes.tcp_connect_all(addresses), on_coordinator)]
    return _Cluster(checks, status)


def _curve(opts: DoctorOptions, record: Any) -> Any:
    """The CURVE client as ``zctl cluster status`` picks it (ValueError on bad options)."""
    from controlplane.security import CurveClient, SecurityError
    from zctl.launcher.record import control_curve

    if bool(opts.curve_server_key) != bool(opts.curve_keys):
        raise ValueError("--curve-server-key and --curve-keys go together")
    try:
        if opts.curve_server_key and opts.curve_keys:
            return CurveClient.from_files(opts.curve_server_key, opts.curve_keys)
        return control_curve(record) if opts.endpoint is None else None
    except SecurityError as exc:
        raise ValueError(str(exc)) from None


def recorded_api() -> str:
    """The API that ``cluster up --api`` started with the cluster up here ("" if none):
    it must answer."""
    from zctl.launcher.record import ClusterError, read_record

    try:
        record = read_record()
    except ClusterError:
        return ""
    return record.api if record is not None else ""
