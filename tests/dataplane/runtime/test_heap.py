"""hold_mmap_threshold: a large buffer stays mmapped (returned to the system when freed)
after a larger one was freed, which with glibc's moving threshold it does not."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from dataplane.runtime.heap import hold_mmap_threshold

PROBE = textwrap.dedent("""
    import ctypes, sys
    from dataplane.runtime.heap import hold_mmap_threshold
    held = hold_mmap_threshold() if sys.argv[1] == "hold" else False
    if sys.argv[1] == "process":  # what a coordinator or node process does first
        from zctl.launcher.processes import _prepare
        from zctl.launcher.processes import LinkShape
        held = _prepare(LinkShape(), None, None, print) is None
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    def mmapped(p):  # glibc's chunk header: the size word before the pointer, bit 1
        return bool(ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2)
    big = libc.malloc(4 << 20)
    libc.free(big)  # glibc would now raise its threshold past 4 MB
    buffer = libc.malloc(1 << 20)
    print(held, mmapped(buffer))
    libc.free(buffer)
""")

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")


def probe(mode: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                          check=True, env=env).stdout.strip()


@pytest.mark.slow
@glibc
def test_a_held_threshold_keeps_large_buffers_mapped() -> None:
    assert probe("free") == "False False"  # the moving threshold: the buffer comes from the heap
    assert probe("hold") == "True True"
    assert probe("process") == "True True"


@glibc
def test_a_threshold_the_user_set_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert hold_mmap_threshold() is False
