"""Scripted WAN experiments: `run FILE` measures a scenario's grid on local clusters into CSV and plots.

Scenario files (tools/experiments/*.toml; their format: tools/experiment/scenario.py) name
the topologies (stages, every hop's latency, jitter, bandwidth, relay) and the workloads
(decoding, draft length K, streams, the last stage's payload); tools/experiment/cli.py runs
them.
"""

from tools.experiment.cli import main as main
