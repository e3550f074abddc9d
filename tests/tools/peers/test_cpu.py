"""llama.cpp's instruction-set options from a /proc/cpuinfo text."""

from __future__ import annotations

import stat
from pathlib import Path

from tools.peers.cpu import AmxProbe, c_compiler, choose_isa, parse_cpu_flags, probe_amx

XEON_AMX = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse4_1 sse4_2 avx f16c fma bmi1 avx2 bmi2 avx512f avx512dq avx512cd avx512bw \
avx512vl avx_vnni avx512_bf16 avx512vbmi avx512_vnni amx_bf16 avx512_fp16 amx_tile amx_int8

processor\t: 1
flags\t\t: fpu
"""
EPYC_ZEN3 = "model name\t: AMD EPYC 7B13\nflags\t\t: sse4_2 avx f16c fma bmi2 avx2\n"
EPYC_ZEN4 = ("model name\t: AMD EPYC 9B14\nflags\t\t: sse4_2 avx f16c fma bmi2 avx2 avx512f "
             "avx512dq avx512cd avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16\n")


def on(choice) -> set[str]:
    return {k for k, v in choice.options.items() if v == "ON"}


def test_the_first_flags_line_is_read() -> None:
    flags = parse_cpu_flags(XEON_AMX)
    assert "amx_tile" in flags and "fpu" in flags
    assert parse_cpu_flags("processor: 0\n") == frozenset()


def test_a_xeon_with_amx_gets_every_avx_and_avx512_option_and_no_amx_unless_probed() -> None:
    choice = choose_isa(parse_cpu_flags(XEON_AMX))
    assert on(choice) == {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C",
                          "GGML_BMI2", "GGML_AVX_VNNI", "GGML_AVX512", "GGML_AVX512_VBMI",
                          "GGML_AVX512_VNNI", "GGML_AVX512_BF16"}
    assert choice.options["GGML_NATIVE"] == "OFF"
    assert {choice.options[k] for k in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")} == {"OFF"}
    assert "--amx probe" in choice.reasons["GGML_AMX"]
    assert "CMAKE_CXX_COMPILER" not in choice.options
    assert "avx512_vnni" in choice.reasons["GGML_AVX512_VNNI"]
    assert all(option in choice.reasons for option in on(choice) | {"GGML_NATIVE"})


def test_amx_goes_in_only_when_the_probe_found_it_usable() -> None:
    flags = parse_cpu_flags(XEON_AMX)
    usable = choose_isa(flags, AmxProbe(True, "tiles run"))
    assert {usable.options[k] for k in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")} == {"ON"}
    assert "tiles run" in usable.reasons["GGML_AMX"]
    refused = choose_isa(flags, AmxProbe(False, "the tile program died of signal 4"))
    assert refused.options["GGML_AMX_INT8"] == "OFF"
    assert "signal 4" in refused.reasons["GGML_AMX"]
    assert "CMAKE_CXX_COMPILER" not in usable.options  # the default compiler's probe ran


def test_amx_built_by_the_compiler_whose_probe_ran() -> None:
    choice = choose_isa(parse_cpu_flags(XEON_AMX), AmxProbe(True, "c++ dropped", "clang++-14"))
    assert choice.options["CMAKE_CXX_COMPILER"] == "clang++-14"
    assert choice.options["CMAKE_C_COMPILER"] == "clang-14"
    assert "c++ dropped" in choice.reasons["CMAKE_CXX_COMPILER"]
    assert c_compiler("g++-12") == "gcc-12" and c_compiler("clang++") == "clang"


def test_amd_epyc_gets_avx2_and_on_zen4_avx512() -> None:
    zen3, zen4 = choose_isa(parse_cpu_flags(EPYC_ZEN3)), choose_isa(parse_cpu_flags(EPYC_ZEN4))
    assert {"GGML_AVX2", "GGML_FMA", "GGML_F16C"} <= on(zen3)
    assert not {"GGML_AVX512", "GGML_AVX_VNNI"} & on(zen3)
    assert {"GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX512_VBMI"} <= on(zen4)
    assert "GGML_AMX" not in zen4.reasons  # no AMX on the CPU: nothing to explain


def test_avx512_extensions_need_the_whole_avx512_foundation() -> None:
    partial = choose_isa({"avx2", "avx512f", "avx512_vnni"})  # no cd/vl/dq/bw
    assert partial.options["GGML_AVX512"] == "OFF"
    assert partial.options["GGML_AVX512_VNNI"] == "OFF"


def test_the_probe_says_no_without_amx_flags() -> None:
    probe = probe_amx({"avx2"})
    assert not probe.usable and "amx" in probe.detail


def fake_compiler(folder: Path, name: str, program: str) -> str:
    """A "compiler" that writes ``program`` (a shell script run with the probe's mode as
    $1) where ``-o`` says."""
    path = folder / name
    path.write_text('#!/bin/sh\nwhile [ "$1" != -o ]; do shift; done\n'
                    f"cat > \"$2\" <<'EOF'\n#!/bin/sh\n{program}\nEOF\n"
                    'chmod +x "$2"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_compiler_that_drops_the_tile_configuration_is_told_apart_and_the_next_is_tried(
        tmp_path: Path) -> None:
    dropping = fake_compiler(tmp_path, "dropping++", '[ "$1" = fixed ] && exit 0\nkill -ILL $$')
    working = fake_compiler(tmp_path, "working++", "exit 0")
    probe = probe_amx({"amx_tile", "amx_int8"}, [dropping, working])
    assert probe.usable and probe.compiler == working
    assert "drops the configuration's stores" in probe.detail
    alone = probe_amx({"amx_tile", "amx_int8"}, [dropping])
    assert not alone.usable and alone.compiler is None


def test_a_machine_that_cannot_run_tiles_is_not_blamed_on_the_compiler(tmp_path: Path) -> None:
    dead = fake_compiler(tmp_path, "any++", "kill -ILL $$")
    refused = fake_compiler(tmp_path, "other++", "exit 2")
    probe = probe_amx({"amx_tile", "amx_int8"}, [dead, refused])
    assert not probe.usable
    assert "signal 4" in probe.detail and "drops" not in probe.detail
    assert "refused AMX tile data" in probe.detail


def test_a_missing_or_failing_compiler_is_said(tmp_path: Path) -> None:
    probe = probe_amx({"amx_tile", "amx_int8"}, [str(tmp_path / "no-such-c++")])
    assert not probe.usable and "cannot compile" in probe.detail
    assert not probe_amx({"amx_tile", "amx_int8"}, []).usable
