"""Commands that end on SIGTERM and SIGHUP (a timeout, a service manager, a closed
terminal) as they do on Ctrl-C, with an exit code that says the signal (128 + n)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from zctl.launcher.lifetime import StopSignals, exit_code_of

Command = TypeVar("Command", bound=Callable[..., Any])


def ends_as_on_ctrl_c(command: Command) -> Command:
    """``command`` (a Typer command) with SIGTERM and SIGHUP raising an interruption as
    Ctrl-C does while it runs (zctl.launcher.lifetime.StopSignals), so the same cleanup
    runs; it then exits with 128 + the signal's number (130 for Ctrl-C)."""

    @functools.wraps(command)
    def run_command(*args: Any, **kwargs: Any) -> Any:
        try:
            with StopSignals():
                return command(*args, **kwargs)
        except KeyboardInterrupt as exc:
            raise typer.Exit(exit_code_of(exc)) from None

    return run_command  # type: ignore[return-value]
