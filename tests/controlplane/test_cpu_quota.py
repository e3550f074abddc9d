"""The CPU quota a process is under, read from fake cgroup trees (v1, v2, nested)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.cpu_quota import (
    CpuQuota,
    cgroup_dirs,
    current_share,
    parse_cfs,
    parse_cpu_max,
    parse_mountinfo,
    parse_proc_cgroup,
    read_quota,
)

V1_CGROUP = "9:name=systemd:/\n4:memory:/box\n2:cpu,cpuacct:/bench/node\n0::/\n"
V2_CGROUP = "0::/user.slice/node\n"


def _mountinfo(tmp_path: Path, *mounts: tuple[str, str, str, str]) -> str:
    """mountinfo lines of (root, mount point below tmp_path, type, super options)."""
    lines = [f"{30 + i} 23 0:{40 + i} {root} {tmp_path / point} rw,relatime shared:1 - "
             f"{fstype} {fstype} {options}" for i, (root, point, fstype, options)
             in enumerate(mounts)]
    return "\n".join(["22 1 8:1 / / rw - ext4 /dev/sda1 rw", *lines]) + "\n"


def _proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc-self"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return proc


def _write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text + "\n")


def test_proc_cgroup_lines_give_hierarchy_controllers_and_path() -> None:
    assert parse_proc_cgroup(V1_CGROUP + "garbage\n") == [
        (9, frozenset({"name=systemd"}), "/"), (4, frozenset({"memory"}), "/box"),
        (2, frozenset({"cpu", "cpuacct"}), "/bench/node"), (0, frozenset(), "/")]


def test_only_cgroup_mounts_are_taken_with_their_controllers(tmp_path: Path) -> None:
    text = _mountinfo(tmp_path, ("/", "cg/cpu,cpuacct", "cgroup", "rw,cpu,cpuacct"),
                      ("/", "cg/unified", "cgroup2", "rw"))
    mounts = parse_mountinfo(text + "36 31 0:33 / /sys/fs/cgroup/mem\\040x rw - cgroup cgroup "
                             "rw,memory\n")
    assert [(m.version, m.controllers) for m in mounts] == [
        (1, frozenset({"rw", "cpu", "cpuacct"})), (2, frozenset()), (1, frozenset({"rw", "memory"}))]
    assert mounts[2].mountpoint == "/sys/fs/cgroup/mem x"  # mountinfo's octal escape


def test_cpu_max_and_cfs_files_parse_or_say_what_is_wrong() -> None:
    assert parse_cpu_max("50000 100000\n") == (50000, 100000)
    assert parse_cpu_max("max 100000") == (None, 100000)
    assert parse_cfs("10000", "20000") == (10000, 20000)
    assert parse_cfs("-1\n", "100000\n") == (None, 100000)
    for bad in ("", "50000", "fifty 100000", "50000 0", "-5 100000"):
        with pytest.raises(ValueError, match="cpu.max"):
            parse_cpu_max(bad)
    with pytest.raises(ValueError, match="cfs_quota_us"):
        parse_cfs("lots", "100000")
    with pytest.raises(ValueError, match="not positive"):
        parse_cfs("1000", "0")


def test_a_v1_quota_on_the_process_s_cgroup_is_read(tmp_path: Path) -> None:
    mountinfo = _mountinfo(tmp_path, ("/", "cg/cpu", "cgroup", "rw,cpu,cpuacct"))
    _write(tmp_path / "cg/cpu", cpu_cfs_quota_us="-1", cpu_cfs_period_us="100000")
    _write(tmp_path / "cg/cpu/bench", cpu_cfs_quota_us="-1", cpu_cfs_period_us="100000")
    _write(tmp_path / "cg/cpu/bench/node", cpu_cfs_quota_us="10000", cpu_cfs_period_us="20000")
    quota = read_quota(_proc(tmp_path, V1_CGROUP, mountinfo))
    assert quota is not None
    assert (quota.share, quota.period_s) == (0.5, 0.02)
    assert quota.where.endswith("bench/node/cpu.cfs_quota_us")


def test_a_parent_s_tighter_v2_limit_holds_its_child(tmp_path: Path) -> None:
    mountinfo = _mountinfo(tmp_path, ("/", "cg", "cgroup2", "rw"))
    _write(tmp_path / "cg", cgroup_controllers="cpu memory")  # the root has no cpu.max
    _write(tmp_path / "cg/user.slice", cpu_max="150000 100000")
    _write(tmp_path / "cg/user.slice/node", cpu_max="max 100000")
    quota = read_quota(_proc(tmp_path, V2_CGROUP, mountinfo))
    assert quota == CpuQuota(1.5, 0.1, str(tmp_path / "cg/user.slice/cpu.max"))


def test_a_cgroup_namespace_s_mount_root_is_taken_off_the_path(tmp_path: Path) -> None:
    # the mount shows cgroup /bench at its mount point: /bench/node is its node/ directory
    mountinfo = _mountinfo(tmp_path, ("/bench", "cg", "cgroup2", "rw"))
    _write(tmp_path / "cg/node", cpu_max="25000 100000")
    (version, directory, mountpoint), = cgroup_dirs("0::/bench/node\n", mountinfo)
    assert (version, directory, mountpoint) == (2, tmp_path / "cg/node", tmp_path / "cg")
    assert read_quota(_proc(tmp_path, "0::/bench/node\n", mountinfo)).share == 0.25


def test_no_quota_anywhere_and_no_cgroup_files_read_as_none(tmp_path: Path) -> None:
    mountinfo = _mountinfo(tmp_path, ("/", "cg/cpu", "cgroup", "rw,cpu"),
                           ("/", "cg/unified", "cgroup2", "rw"))
    _write(tmp_path / "cg/cpu/bench/node", cpu_cfs_quota_us="-1", cpu_cfs_period_us="100000")
    proc = _proc(tmp_path, V1_CGROUP, mountinfo)
    assert read_quota(proc) is None and current_share(proc) == 0.0  # unified: no cpu.max
    assert read_quota(tmp_path / "no-such-proc") is None


def test_a_cgroup_file_that_cannot_be_a_quota_is_a_clear_error(tmp_path: Path) -> None:
    mountinfo = _mountinfo(tmp_path, ("/", "cg", "cgroup2", "rw"))
    _write(tmp_path / "cg/user.slice/node", cpu_max="half 100000")
    proc = _proc(tmp_path, V2_CGROUP, mountinfo)
    with pytest.raises(ValueError, match="cpu.max reads 'half 100000'"):
        read_quota(proc)
    assert current_share(proc) is None  # not known: a kept profile is not judged by it
    with pytest.raises(ValueError, match="share must be positive"):
        CpuQuota(0.0, 0.1)
