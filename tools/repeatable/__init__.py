"""Repeatability: the same greedy request's tokens cold and cached, batched, speculative, healed.

Whether the same greedy request gets the same tokens cold and cached, alone and among
concurrent streams, with prompt lookup on and off, streamed or not, and after the
pipeline went down and came back; and what each setting costs in decode tok/s and TTFT
against today's default, measured in the same run (``python -m tools.repeatable``,
``zctl bench repeatable``; docs/measurements/repeatability.md).

Everything runs in this process: each setting's stages on a ``LocalChain`` under the
product's ``GenerationEngine``, as ``zctl serve`` runs them (paged stages, row groups, the
prefix cache). ``prompts`` holds the prompts, ``settings`` what is compared, ``cases``
the identity cases, ``costs`` the timings and ``report`` the targets and the table.
"""
