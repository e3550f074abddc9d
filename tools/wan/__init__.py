"""Scripted WAN experiments: `run FILE` measures a scenario's grid on local clusters into CSV and plots.

Scenario files (tools/wan/scenarios/*.toml; their format: tools/wan/scenario.py) name the
topologies (stages, every hop's latency, jitter, bandwidth, relay) and the workloads
(decoding, draft length K, streams, the last stage's payload); ``runner`` measures them on
local clusters started by the product's launcher, ``analysis`` makes the rows and ratios,
``plots`` the figures, ``kernel_links`` the tbf-shaped links, and ``cli`` is the command
(``python -m tools.wan run FILE``).
"""

from tools.wan.cli import main as main
