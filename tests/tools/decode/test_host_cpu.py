"""tools/decode/host_cpu: its figures on the tiny model (greedy tokens as the engine gives
them, CPU times counted), and its refusals."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tools.decode.host_cpu import idle_cpu_steps, measure


def test_measure_decodes_greedily_and_counts_cpu_time(dp_export2) -> None:
    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.config import RuntimeSpec
    from zctl.engine.scheduler import generate_greedy

    prompt = [0, 17, 42, 99]
    result = measure(LocalChain.load(str(dp_export2), RuntimeSpec()), prompt, 6, 2, 0.001)
    expected = list(generate_greedy(LocalChain.load(str(dp_export2), RuntimeSpec()), prompt, 6))
    assert result.tokens == expected
    assert result.host_cpu_ms_per_token > 0
    assert 0 <= result.idle_cpu_ms_per_step <= result.idle_cpu_ms_per_step_p90


def test_idle_window_counts_other_threads_only(dp_export2) -> None:
    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.config import RuntimeSpec

    spent = idle_cpu_steps(LocalChain.load(str(dp_export2), RuntimeSpec()), [3, 1, 4], 3, 0.001)
    assert len(spent) == 3
    assert all(ms >= 0 for ms in spent)


@pytest.mark.parametrize("args, reason", [
    (["--tokens", "1"], "--tokens must be >= 2"),
    (["--idle-ms", "0"], "--idle-ms > 0"),
])
def test_bad_options_are_refused(tmp_path, args, reason) -> None:
    import typer

    from tools.decode.host_cpu import main

    app = typer.Typer()
    app.command()(main)
    out = CliRunner().invoke(app, [str(tmp_path), *args])
    assert out.exit_code == 2
    assert reason.replace(" ", "") in "".join(out.output.split()).replace("│", "")


def test_a_directory_without_a_manifest_is_refused(tmp_path) -> None:
    import typer

    from tools.decode.host_cpu import main

    app = typer.Typer()
    app.command()(main)
    out = CliRunner().invoke(app, [str(tmp_path)])
    assert out.exit_code == 2
    assert "isnotanexport" in "".join(out.output.split()).replace("│", "")
