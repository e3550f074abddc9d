"""``python -m tools.wan run FILE [--out DIR] [--json]``."""

import typer

from tools.wan.cli import main

typer.run(main)
