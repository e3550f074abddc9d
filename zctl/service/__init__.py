"""The engine's front door over ZeroMQ: the generation service (``server``) that runs a
``zctl.engine.core.GenerationEngine`` behind a ROUTER on the coordinator, the messages it
speaks (``messages``: the engine's own request and chunk types in the control plane's
envelope), its stats snapshot (``stats``), and its clients (``client``, synchronous;
``async_client``, on an asyncio event loop, for the HTTP server) and what they raise when
the service cannot serve (``errors``).
"""
