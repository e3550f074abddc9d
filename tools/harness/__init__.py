"""What the benchmarks share, so that a fix lands once: their models and cached exports
(``models``), the openvino_genai baseline (``baseline``), the HTTP load client (``load``),
local clusters through the product's launcher (``cluster``), requests through a cluster's
generation service (``service``), the greedy reference loop (``greedy``), estimators
(``stats``), command-line options (``options``) and printing results (``report``).
"""
