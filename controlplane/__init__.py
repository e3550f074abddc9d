"""Control plane: node membership, version checks, shard placement and pipeline wiring."""
