"""The Redis store on a three-master Redis Cluster of real redis-server processes (started
here, on loopback ports, and killed at the end): the wire fixtures pass, queues spread over the
nodes, and a queue shares its slot with its dead-letter queues."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pinpriq.conformance import run_suite
from pinpriq.redis.keys import queue_keys
from pinpriq.redis.store import RedisStore
from tests.redis_servers import RedisServer, need_redis, start_cluster
from tests.test_redis_store import (
    HOST,
    RUN_ON_REDIS,
    STEP_TIMEOUT,
    SYNC,
    connect,
    front_end,
    pop,
    push,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisServer]]:
    need_redis()
    nodes = start_cluster(Path(tmp_path_factory.mktemp("cluster")))
    yield nodes
    for node in nodes:
        node.stop()


def cluster_url(nodes: list[RedisServer]) -> str:
    return "redis-cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in nodes[:2])


async def test_every_fixture_passes_on_a_cluster(cluster: list[RedisServer]) -> None:
    async with front_end(cluster_url(cluster)) as (_, port):
        results = await run_suite(RUN_ON_REDIS, HOST, port, step_timeout=STEP_TIMEOUT)
    assert [r.line() for r in results if not r.passed] == []


async def test_queues_spread_over_the_nodes(cluster: list[RedisServer]) -> None:
    names = [b"queue-%d" % n for n in range(60)] + [b"", b"{", b"}{x}", b"\xff\x00"]
    url = cluster_url(cluster)
    async with front_end(url) as (server, a), front_end(url) as (_, b):
        pusher, popper = await connect(a), await connect(b)
        await pusher.send(b"".join(push(name, b"k", name) for name in names))
        await pusher.request(SYNC)
        held = [len(queues_on(node)) for node in cluster]
        assert all(held), f"queues per node: {held}"
        # The admin listener's figures come from a scan of every node.
        store = server.batched
        assert isinstance(store, RedisStore)
        await store.refresh_snapshot()
        assert sorted(name for name, _, _ in store.sizes()) == sorted(names)
        assert len(store) == len(names)
        for name in names:
            assert await popper.request(pop(name)) == [(b"k", name)]
    assert [queues_on(node) for node in cluster] == [[], [], []]  # queues are forgotten


def queues_on(node: RedisServer) -> list[str]:
    """The data keys of the queues a node holds (one per queue)."""
    return node.cli("--scan", "--pattern", "pq:*:d").split()


def test_a_queue_shares_its_slot_with_its_dead_letter_queues(
    cluster: list[RedisServer],
) -> None:
    for name in (b"jobs", b"", b"a{b}c", b"x.dead"):
        slots = {
            cluster[0].cli("CLUSTER", "KEYSLOT", key.decode("latin-1"))
            for queue in (name, name + b".dead", name + b".dead.dead")
            for key in queue_keys(queue)
        }
        assert len(slots) == 1, (name, slots)
