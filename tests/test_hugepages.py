"""dataplane.hugepages: which regions are advised, and that advising is safe."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from dataplane import hugepages
from dataplane.hugepages import HUGE_PAGE, HugePageScope, aligned, anonymous_regions


def test_aligned_part_of_a_region() -> None:
    assert aligned((HUGE_PAGE + 1, 4 * HUGE_PAGE + 5)) == (2 * HUGE_PAGE, 4 * HUGE_PAGE)
    assert aligned((HUGE_PAGE + 1, 2 * HUGE_PAGE + 5)) is None


def test_anonymous_regions_reads_maps(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0000000000-7f0000800000 rw-p 00000000 00:00 0 \n"  # 8 MB anonymous: kept
        "7f0001000000-7f0001800000 r--p 00000000 00:00 0 \n"  # read-only: skipped
        "7f0002000000-7f0002800000 rw-p 00000000 08:01 42    /lib/x.so\n"  # a file: skipped
        "00400000-00c00000 rw-p 00000000 00:00 0    [heap]\n"  # the heap: kept
        "7f0003000000-7f0003001000 rw-p 00000000 00:00 0 \n")  # too small: skipped
    assert anonymous_regions(str(maps)) == {(0x7F0000000000, 0x7F0000800000),
                                            (0x00400000, 0x00C00000)}
    assert anonymous_regions(str(tmp_path / "missing")) == set()


@pytest.mark.skipif(sys.platform != "linux", reason="Linux THP")
def test_scope_advises_what_appeared_inside_and_data_survives(monkeypatch) -> None:
    with HugePageScope() as scope:
        # a new private anonymous mapping, as a compile makes
        region = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        data = np.frombuffer(region, dtype=np.uint8)
        data[::4096] = 7
    assert scope.collapsed >= 0  # best effort: the kernel may refuse to collapse
    assert (data[::4096] == 7).all() and data.sum() == 7 * (16 << 20) // 4096
    start = np.frombuffer(region, dtype=np.uint8).ctypes.data
    flags = _vm_flags(start)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.is_file() and "[never]" not in thp.read_text():
        assert "hg" in flags  # MADV_HUGEPAGE was applied to the new region
    monkeypatch.setenv("ZCTL_HUGE_PAGES", "0")  # off: nothing is touched
    with HugePageScope() as off:
        other = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    assert off.collapsed == 0 and "hg" not in _vm_flags(
        np.frombuffer(other, dtype=np.uint8).ctypes.data)
    del data
    region.close()
    other.close()
    assert hugepages.back_with_huge_pages(set()) == 0


def _vm_flags(address: int) -> str:
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and not line.startswith("VmFlags"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags"):
            return line
    return ""
