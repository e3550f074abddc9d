"""``python -m tools.fleet [--rounds N] [--json]`` (``zctl bench fleet``)."""

import typer

from tools.fleet.cli import main

typer.run(main)
