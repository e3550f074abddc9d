"""``python -m tools.experiment run FILE [--out DIR] [--json]``."""

import typer

from tools.experiment.cli import main

typer.run(main)
