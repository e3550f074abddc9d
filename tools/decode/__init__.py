"""Decoding one stream, and what it costs: our stage shards against openvino_genai
(``parity``), a local cluster against it (``cluster``), the data plane's framework
overhead per hop (``overhead``), an idle gap before a step (``idle_gap``), concurrent
streams (``microbatch``), static NPU shards (``static``), weight formats (``quality``),
CURVE on a hop (``curve``), an A/B of one setting (``cluster_ab``), the export's time and
memory (``export``), minimal reproductions of a one-token step's time in the CPU plugin's
kernels and the stage runner against llama-bench (``kernel_repro``).
"""
