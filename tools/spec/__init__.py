"""Speculative decoding: acceptance and speedup against the cost model's theory
(``speedup``, with ``accounting``, ``report`` and the prompts of ``prompts``), pipelined
speculation on a cluster (``pipelined``), and the most prompt lookup can yield behind slow
hops (``draft_ceiling``).
"""
