"""Console: the ``zctl`` Typer command line and its Rich views."""
