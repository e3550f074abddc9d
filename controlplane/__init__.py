"""Control plane: node membership, version checks, shard placement and pipeline wiring.

Coordinator (node 0, ROUTER) and node agents (DEALER) speak the typed, versioned
messages of ``controlplane.messages``:

- ``Coordinator(export_dir, CoordinatorConfig(...)).start()`` binds the control ROUTER,
  runs stage 0 itself and waits for nodes; ``wait_serving(timeout)`` and ``status()``.
- ``NodeAgent(AgentConfig(coordinator=endpoint)).run()`` joins, fetches its shard,
  serves the stage it is assigned, reconnects with backoff when the coordinator goes.
- ``client.query_status(endpoint)`` is ``zctl cluster status``.

The processes that run these (and local clusters of them) are ``zctl.launcher``'s.
"""
