"""dataplane.runtime.hugepages: which regions are advised, and that advising is safe."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from dataplane.runtime import hugepages
from dataplane.runtime.hugepages import HUGE_PAGE, HugePageScope, anonymous_regions, huge_page_part


def test_aligned_part_of_a_region() -> None:
    assert huge_page_part((HUGE_PAGE + 1, 4 * HUGE_PAGE + 5)) == (2 * HUGE_PAGE, 4 * HUGE_PAGE)
    assert huge_page_part((HUGE_PAGE + 1, 2 * HUGE_PAGE + 5)) is None


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
    assert scope.collapsed % HUGE_PAGE == 0  # whole huge pages of aligned parts only
    assert (data[::4096] == 7).all() and data.sum() == 7 * (16 << 20) // 4096
    start = np.frombuffer(region, dtype=np.uint8).ctypes.data
    flags = _vm_flags(start)
    if scope.collapsed:  # what was counted as collapsed is backed by huge pages now (the
        # 16 MB region is the only new mapping big enough to be advised)
        assert _smaps_field(start, "AnonHugePages") >= HUGE_PAGE, scope.collapsed
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


class FakeLibc:
    """madvise that records its calls; COLLAPSE fails on the regions in ``refuse``."""

    def __init__(self, refuse: set[int] = frozenset(), no_thp: bool = False) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.refuse, self.no_thp = refuse, no_thp
        self.madvise = self  # a ctypes function: it takes argtypes and restype

    def __call__(self, start: int, length: int, advice: int) -> int:
        self.calls.append((start, length, advice))
        if advice == hugepages.MADV_HUGEPAGE:
            return -1 if self.no_thp else 0
        return -1 if start in self.refuse else 0


def test_back_with_huge_pages_counts_exactly_the_collapsed_aligned_parts(monkeypatch) -> None:
    libc = FakeLibc(refuse={8 * HUGE_PAGE})
    monkeypatch.setattr(hugepages.ctypes, "CDLL", lambda *a, **k: libc)
    monkeypatch.setattr(hugepages, "enabled", lambda: True)
    regions = {(HUGE_PAGE + 1, 4 * HUGE_PAGE + 5),  # aligned part: 2 huge pages
               (8 * HUGE_PAGE, 11 * HUGE_PAGE),  # 3 pages, but the kernel refuses to collapse
               (20 * HUGE_PAGE + 7, 21 * HUGE_PAGE)}  # holds no whole huge page: untouched
    assert hugepages.back_with_huge_pages(regions) == 2 * HUGE_PAGE
    assert sorted(libc.calls) == [
        (2 * HUGE_PAGE, 2 * HUGE_PAGE, hugepages.MADV_HUGEPAGE),
        (2 * HUGE_PAGE, 2 * HUGE_PAGE, hugepages.MADV_COLLAPSE),
        (8 * HUGE_PAGE, 3 * HUGE_PAGE, hugepages.MADV_HUGEPAGE),
        (8 * HUGE_PAGE, 3 * HUGE_PAGE, hugepages.MADV_COLLAPSE)]
    libc = FakeLibc(no_thp=True)  # THP "never": advising fails, nothing is collapsed
    monkeypatch.setattr(hugepages.ctypes, "CDLL", lambda *a, **k: libc)
    assert hugepages.back_with_huge_pages(regions) == 0
    assert {advice for _, _, advice in libc.calls} == {hugepages.MADV_HUGEPAGE}


def _smaps_field(address: int, name: str) -> int:
    """A field of the mapping holding ``address`` in /proc/self/smaps, in bytes."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and not line.startswith("VmFlags"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            inside = start <= address < end
        elif inside and line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _vm_flags(address: int) -> str:
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and not line.startswith("VmFlags"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags"):
            return line
    return ""


class _CountingScope:
    """A HugePageScope that counts the compiles made inside it (each collapsing 2 MB)."""

    inside = False
    scopes = 0

    def __init__(self) -> None:
        self.collapsed = 0

    def __enter__(self) -> _CountingScope:
        type(self).inside = True
        return self

    def __exit__(self, *exc: object) -> None:
        type(self).inside = False
        type(self).scopes += 1
        self.collapsed = HUGE_PAGE


@pytest.mark.parametrize("runner", ["stateful", "paged", "paged one-token"])
def test_every_cpu_runner_compiles_its_weights_into_huge_pages(runner, dp_export2, monkeypatch
                                                               ) -> None:
    """The stateful and the paged runner (a cluster node's, and its one-token graph) compile
    inside a scope: a paged node without one stepped a 4-layer Qwen3-MoE stage ~10% slower
    on 4 KB pages (docs/measurements/decode.md)."""
    import openvino as ov

    import dataplane.runtime.paged as paged
    import dataplane.runtime.stateful as stateful
    from dataplane.runtime.config import RuntimeSpec

    compiled_outside: list[str] = []
    real_compile = ov.Core.compile_model

    def compile_model(core: ov.Core, *args: object, **kwargs: object) -> ov.CompiledModel:
        if not _CountingScope.inside:
            compiled_outside.append(str(args[0])[:60])
        return real_compile(core, *args, **kwargs)

    monkeypatch.setattr(ov.Core, "compile_model", compile_model)
    monkeypatch.setattr(_CountingScope, "scopes", 0)
    for module in (paged, stateful):
        monkeypatch.setattr(module, "HugePageScope", _CountingScope)

    class OneToken(RuntimeSpec):
        decode_graph = "static"

    class Dynamic(RuntimeSpec):
        decode_graph = "dynamic"

    if runner == "stateful":
        stage = stateful.StageRunner(dp_export2, 0, RuntimeSpec())
    else:
        spec = OneToken if runner == "paged one-token" else Dynamic
        stage = paged.PagedStageRunner(dp_export2, 0, spec(paged_attention=True))
        assert (stage.one_token is not None) is (runner == "paged one-token")
    assert compiled_outside == []
    assert _CountingScope.scopes == 1 + (runner == "paged one-token")
    assert stage.huge_page_bytes == _CountingScope.scopes * HUGE_PAGE
