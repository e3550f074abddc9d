"""``python -m tools.repeatable [--models M,..] [--settings S,..] [--json]`` (``zctl bench
repeatable``)."""

import typer

from tools.repeatable.cli import main

typer.run(main)
