"""The planner: where a model's layers go on a fleet of unequal PCs, and how fast it runs.

Pure functions, no sockets and no OpenVINO. ``shape`` is a model's geometry,
``shape_sources`` reads it from a preset, a config.json or a GGUF header (no weights),
``memory`` what a stage holds, ``profile`` a node's and a link's figures, ``references``
the named reference figures and what a model's profile on them is, ``timing`` the model of
time (a stage's step, a hop, tok/s at 1 and N streams, TTFT), ``split`` the layers of an
order of nodes (exact dynamic programming), ``search`` the orders and subsets of the
fleet and who is left out, ``fleet`` a fleet file of PCs. docs/design.md, "Planning".
"""
