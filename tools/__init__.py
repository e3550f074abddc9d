"""zctl's benchmarks: what each measurement of docs/measurements.md runs. Not installed with
the product; ``zctl bench NAME`` runs one from a source checkout (``python -m tools.<module>``).

- ``harness``: what every benchmark shares (models and their cached exports, the
  openvino_genai baseline, the HTTP load client, local clusters, estimators, printing);
- ``decode``: one stream's decode path (parity with openvino_genai, a cluster's cost, the
  framework's overhead per hop, micro-batching, static shards, weight formats, export);
- ``spec``: speculative decoding (its speedup against theory, pipelined speculation, the
  ceiling of prompt lookup);
- ``serving``: the HTTP API under load (concurrent clients, long prompts, structured
  output, scoring);
- ``robustness``: faults, hostile input and long runs (chaos, fuzzing, soak);
- ``wan``: scripted experiments over emulated WAN links, and their scenarios;
- ``plan``: the planner's predicted tok/s against the measured, case by case.
"""
