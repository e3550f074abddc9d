"""Commands that end on SIGTERM and SIGHUP as on Ctrl-C (zctl.cli.signals), each signal
sent to this process: the command's cleanup runs, and the exit code says the signal."""

from __future__ import annotations

import os
import signal
import time

import pytest
import typer

from tests.helpers.signals import stop_signals_at_defaults  # noqa: F401 - a fixture
from zctl.cli.signals import ends_as_on_ctrl_c

pytestmark = pytest.mark.usefixtures("stop_signals_at_defaults")


def _signalled_command(signum: int, cleaned: list[str], then: Exception | None = None):  # noqa: ANN202
    @ends_as_on_ctrl_c
    def command(name: str) -> str:
        """A command's help."""
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)  # (interrupted at once)
            return name
        finally:
            cleaned.append(name)
            if then is not None:
                raise then

    return command


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_runs_the_cleanup_and_says_itself_in_the_exit_code(signum: int,
                                                                    code: int) -> None:
    cleaned: list[str] = []
    with pytest.raises(typer.Exit) as ended:
        _signalled_command(signum, cleaned)("run")
    assert ended.value.exit_code == code and cleaned == ["run"]
    assert signal.getsignal(signum) is signal.SIG_DFL  # the handler is gone with the command


def test_ctrl_c_exits_with_130() -> None:
    @ends_as_on_ctrl_c
    def command() -> None:
        raise KeyboardInterrupt

    with pytest.raises(typer.Exit) as ended:
        command()
    assert ended.value.exit_code == 130


def test_an_error_after_the_signal_keeps_the_signals_exit_code() -> None:
    """A closed terminal (SIGHUP) fails the writes of the cleanup that follows."""
    cleaned: list[str] = []
    with pytest.raises(typer.Exit) as ended:
        _signalled_command(signal.SIGHUP, cleaned, OSError(5, "Input/output error"))("run")
    assert ended.value.exit_code == 129 and cleaned == ["run"]


def test_without_a_signal_a_command_is_itself() -> None:
    @ends_as_on_ctrl_c
    def command(name: str) -> str:
        """A command's help."""
        if name == "bad":
            raise ValueError("bad name")
        return name.upper()

    assert command("ok") == "OK" and command.__doc__ == "A command's help."
    assert command.__wrapped__.__name__ == "command"  # Typer reads the options from it
    with pytest.raises(ValueError, match="bad name"):
        command("bad")
