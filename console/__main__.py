"""``python -m console`` runs the zctl command line."""

from console.cli import app

app()
