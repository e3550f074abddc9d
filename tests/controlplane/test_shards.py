"""Shard transfers under damage (controlplane.shards): a corrupted chunk is rejected and
fetched again, one that keeps failing fails the transfer, the file hash catches what chunk
hashes cannot, and a damaged cache is fetched again."""

from __future__ import annotations

from tests.helpers.control import Cluster, corrupting, node, wait_for
from zctl.manifest import sha256_file


def test_corrupted_chunk_is_rejected_and_retried(cp_cluster: Cluster) -> None:
    source = corrupting(cp_cluster.export, bad={("stage1.bin", 2): 2})
    coord = cp_cluster.coordinator(source=source)
    agent = cp_cluster.agent(coord.endpoint)
    status = coord.wait_serving(20)
    assert agent.counters["chunks_rejected"] == 2
    offer = source.offer_for(1)
    chunks = sum(-(-f.size // offer.chunk_size) for f in offer.files)
    assert status.counters["chunks_served"] == chunks + 2
    cached = cp_cluster.root / "n1" / "shards" / offer.shard_hash
    for spec in offer.files:
        assert sha256_file(cached / spec.name) == spec.sha256


def test_chunk_that_keeps_failing_fails_the_transfer(cp_cluster: Cluster) -> None:
    source = corrupting(cp_cluster.export, bad={("stage1.xml", 0): 100})
    coord = cp_cluster.coordinator(source=source)
    agent = cp_cluster.agent(coord.endpoint, chunk_retries=2)
    wait_for(lambda: coord.status().pipeline == "failed", what="failed transfer")
    me = node(coord.status(), agent.node_id)
    assert me.state == "failed" and "chunk 0 of stage1.xml failed 3 times" in me.error
    assert not (cp_cluster.root / "n1" / "shards" / source.offer_for(1).shard_hash).exists()


def test_file_hash_catches_what_chunk_hashes_cannot(cp_cluster: Cluster) -> None:
    source = corrupting(cp_cluster.export, bad={("stage1.bin", 1): 1}, recompute=True)
    coord = cp_cluster.coordinator(source=source)
    agent = cp_cluster.agent(coord.endpoint)
    wait_for(lambda: coord.status().pipeline == "failed", what="failed transfer")
    error = node(coord.status(), agent.node_id).error
    assert "stage1.bin of shard" in error and "arrived with sha256" in error
    assert agent.cache.hashes() == []


def test_damaged_cache_is_fetched_again(cp_cluster: Cluster) -> None:
    coord = cp_cluster.coordinator()
    agent = cp_cluster.agent(coord.endpoint)
    coord.wait_serving(20)
    agent.stop()
    cached = cp_cluster.root / "n1" / "shards" / coord.hashes[1] / "stage1.bin"
    data = bytearray(cached.read_bytes())
    data[100] ^= 0xFF
    cached.write_bytes(bytes(data))
    served = coord.status().counters["chunks_served"]
    cp_cluster.agent(coord.endpoint)
    status = coord.wait_serving(20)
    assert status.counters["chunks_served"] > served
    assert sha256_file(cached) == coord.manifest.files["stage1.bin"]
