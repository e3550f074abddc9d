"""Commands that end on SIGTERM and SIGHUP (a timeout, a service manager, a closed
terminal) as they do on Ctrl-C, with an exit code that says the signal (128 + n)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from zctl.launcher.lifetime import StopSignals, exit_code_of, signal_exit_code

Command = TypeVar("Command", bound=Callable[..., Any])


def ends_as_on_ctrl_c(command: Command) -> Command:
    """``command`` (a Typer command) with SIGTERM and SIGHUP raising an interruption as
    Ctrl-C does while it runs (zctl.launcher.lifetime.StopSignals), so the same cleanup
    runs; it then exits with 128 + the signal's number (130 for Ctrl-C), whatever error
    the cleanup met after the signal."""

    @functools.wraps(command)
    def run_command(*args: Any, **kwargs: Any) -> Any:
        stop = StopSignals()
        try:
            with stop:
                return command(*args, **kwargs)
        except KeyboardInterrupt as exc:
            raise typer.Exit(exit_code_of(exc)) from None
        except Exception:
            if stop.received is None:
                raise
            # an error that followed the signal (writing to the terminal a SIGHUP closed)
            raise typer.Exit(signal_exit_code(stop.received)) from None

    return run_command  # type: ignore[return-value]
