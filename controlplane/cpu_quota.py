"""The CPU quota a process is under: a Linux cgroup's CFS bandwidth limit.

A CFS quota gives a cgroup ``quota`` microseconds of CPU time (summed over its threads and
cores) in every ``period`` microseconds; once its threads have used them they wait for the
next period. cgroup v2 states both in ``cpu.max`` (``"50000 100000"``, or ``"max 100000"``:
no limit), cgroup v1 in ``cpu.cfs_quota_us`` (-1: no limit) and ``cpu.cfs_period_us``. A
process's cgroups are named in ``/proc/self/cgroup`` and found on disk through the cgroup
mounts of ``/proc/self/mountinfo``; a limit set on a parent cgroup holds its children too,
so the tightest share along the path from the process's cgroup up to the mount counts.

The parsing is pure (text in, figures out); ``read_quota`` reads the files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

PROC_SELF = Path("/proc/self")
DEFAULT_PERIOD_S = 0.1  # the kernel's default CFS period (100 ms)


@dataclass(frozen=True)
class CpuQuota:
    """``share`` cores of CPU time (quota / period), granted per ``period_s`` seconds;
    ``where``: the file that sets it."""

    share: float
    period_s: float
    where: str = ""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.share) and self.share > 0):
            raise ValueError(f"a CPU quota's share must be positive cores, got {self.share!r}")
        if not (math.isfinite(self.period_s) and self.period_s > 0):
            raise ValueError(f"a CPU quota's period must be positive seconds, got "
                             f"{self.period_s!r}")


@dataclass(frozen=True)
class CgroupMount:
    """A cgroup hierarchy mounted at ``mountpoint``, showing the cgroup ``root`` there;
    ``version`` 1 or 2, ``controllers`` (v1's, from its mount options)."""

    root: str
    mountpoint: str
    version: int
    controllers: frozenset[str]


def parse_proc_cgroup(text: str) -> list[tuple[int, frozenset[str], str]]:
    """``/proc/<pid>/cgroup``'s lines as (hierarchy id, controllers, cgroup path); the
    cgroup v2 line is hierarchy 0 with no controllers. Malformed lines are skipped."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3 or not parts[0].isdigit() or not parts[2].startswith("/"):
            continue
        controllers = frozenset(c for c in parts[1].split(",") if c)
        out.append((int(parts[0]), controllers, parts[2]))
    return out


def parse_mountinfo(text: str) -> list[CgroupMount]:
    """The cgroup mounts among ``/proc/<pid>/mountinfo``'s lines (fields: id, parent,
    major:minor, root, mount point, options, optional fields, ``-``, type, source, super
    options)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 5 or len(fields) < sep + 2:
            continue
        fstype = fields[sep + 1]
        options = fields[sep + 3].split(",") if len(fields) > sep + 3 else []
        root, mountpoint = _unescape(fields[3]), _unescape(fields[4])
        if fstype == "cgroup2":
            mounts.append(CgroupMount(root, mountpoint, 2, frozenset()))
        elif fstype == "cgroup":
            mounts.append(CgroupMount(root, mountpoint, 1, frozenset(options)))
    return mounts


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def parse_cpu_max(text: str) -> tuple[int | None, int]:
    """cgroup v2 ``cpu.max``: (quota us, None for ``max``; period us). ValueError when it
    is not ``"<quota|max> <period>"``."""
    parts = text.split()
    if len(parts) != 2 or not parts[1].isdigit() or int(parts[1]) <= 0:
        raise ValueError(f"cpu.max reads {text.strip()!r}, not '<quota|max> <period>'")
    if parts[0] == "max":
        return None, int(parts[1])
    if not parts[0].isdigit() or int(parts[0]) <= 0:
        raise ValueError(f"cpu.max reads {text.strip()!r}: the quota is not a positive number")
    return int(parts[0]), int(parts[1])


def parse_cfs(quota_text: str, period_text: str) -> tuple[int | None, int]:
    """cgroup v1 ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``: (quota us, None for -1;
    period us). ValueError when either is not a number."""
    try:
        quota, period = int(quota_text.strip()), int(period_text.strip())
    except ValueError:
        raise ValueError(f"cpu.cfs_quota_us {quota_text.strip()!r} and cpu.cfs_period_us "
                         f"{period_text.strip()!r} are not whole microseconds") from None
    if period <= 0:
        raise ValueError(f"cpu.cfs_period_us {period} is not positive")
    return (quota if quota > 0 else None), period


def cgroup_dirs(proc_cgroup: str, mountinfo: str) -> list[tuple[int, Path, Path]]:
    """(version, the process's cgroup directory, the mount point it is under) of each
    hierarchy that can limit its CPU: cgroup v2's, and v1's with the ``cpu`` controller."""
    mounts = parse_mountinfo(mountinfo)
    out = []
    for hierarchy, controllers, path in parse_proc_cgroup(proc_cgroup):
        if hierarchy == 0 and not controllers:
            chosen = [m for m in mounts if m.version == 2]
        elif "cpu" in controllers:
            chosen = [m for m in mounts if m.version == 1 and "cpu" in m.controllers]
        else:
            continue
        for mount in chosen:
            rel = _relative(path, mount.root)
            if rel is not None:
                base = Path(mount.mountpoint)
                out.append((mount.version, base / rel if rel else base, base))
                break
    return out


def _relative(path: str, root: str) -> str | None:
    """``path`` below the mount's ``root`` ("" at the root), None when it is not below."""
    root = root.rstrip("/")
    if path == root or (not root and path == "/"):
        return ""
    if path.startswith(root + "/"):
        return path[len(root) + 1:].strip("/")
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def level_quota(version: int, directory: Path) -> CpuQuota | None:
    """The limit one cgroup directory sets itself (None: none, or no file to say)."""
    if version == 2:
        text = _read(directory / "cpu.max")
        if text is None:
            return None
        quota, period = parse_cpu_max(text)
        where = directory / "cpu.max"
    else:
        quota_text = _read(directory / "cpu.cfs_quota_us")
        period_text = _read(directory / "cpu.cfs_period_us")
        if quota_text is None or period_text is None:
            return None
        quota, period = parse_cfs(quota_text, period_text)
        where = directory / "cpu.cfs_quota_us"
    if quota is None:
        return None
    return CpuQuota(quota / period, period / 1e6, str(where))


def tightest(quotas: list[CpuQuota | None]) -> CpuQuota | None:
    """The smallest share among ``quotas`` (None: no limit among them)."""
    limits = [q for q in quotas if q is not None]
    return min(limits, key=lambda q: q.share) if limits else None


def read_quota(proc_self: Path = PROC_SELF) -> CpuQuota | None:
    """The CPU quota this process is under (module docstring), None when there is none or
    the cgroup files cannot be read; ValueError when a cgroup file says something that
    cannot be a quota."""
    proc_cgroup, mountinfo = _read(proc_self / "cgroup"), _read(proc_self / "mountinfo")
    if proc_cgroup is None or mountinfo is None:
        return None
    found: list[CpuQuota | None] = []
    for version, directory, mountpoint in cgroup_dirs(proc_cgroup, mountinfo):
        level = directory
        while True:
            found.append(level_quota(version, level))
            if level == mountpoint or level.parent == level:
                break
            level = level.parent
    return tightest(found)


def current_share(proc_self: Path = PROC_SELF) -> float | None:
    """The cores of CPU time this process's quota grants (0: no quota), None when its
    cgroup files say something that cannot be a quota (then nothing is compared)."""
    try:
        quota = read_quota(proc_self)
    except ValueError:
        return None
    return quota.share if quota else 0.0
