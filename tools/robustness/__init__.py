"""How a cluster survives: faults injected mid-generation (``chaos``, nodes in network
namespaces by ``chaos_net``), hostile messages to every listening socket (``fuzz``, with
``fuzz_messages`` and ``fuzz_send``), and streams through the API for minutes (``soak``,
watched by ``soak_probe``).
"""
