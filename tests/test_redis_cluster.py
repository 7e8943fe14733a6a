"""The Redis store on a three-master Redis Cluster of real redis-server processes (started
here, on loopback ports, and killed at the end): the wire fixtures pass, queues spread over the
nodes, and a queue shares its slot with its dead-letter queues."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from pinpriq.conformance import run_suite
from pinpriq.redis.keys import queue_keys
from pinpriq.redis.store import RedisStore
from pinpriq.wire import DelayedPush, encode
from tests.rawpeer import subscribe
from tests.redis_servers import RedisServer, need_redis, start_cluster
from tests.test_redis_store import (
    FIXTURES,
    HOST,
    READY,
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
        results = await run_suite(FIXTURES, HOST, port, step_timeout=STEP_TIMEOUT)
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


async def test_a_move_between_slots_goes_group_by_group(cluster: list[RedisServer]) -> None:
    slot = {
        name: cluster[0].cli("CLUSTER", "KEYSLOT", queue_keys(name).data.decode())
        for name in (b"from", b"to")
    }
    assert slot[b"from"] != slot[b"to"]
    async with front_end(cluster_url(cluster)) as (server, port):
        peer = await connect(port)
        await peer.send(
            push(b"to", b"old", b"already there", prio=3)
            + push(b"from", b"g", b"first", prio=3)
            + push(b"from", b"h", b"second", prio=3, ttl_ms=60_000)
            + push(b"from", b"g", b"rider", prio=0)
            + push(b"from", b"lone", b"prio 0", prio=0)
        )
        await peer.request(SYNC)
        store = server.broker.store
        assert isinstance(store, RedisStore)
        assert await store.move_async(b"from", b"to", 2) == 3  # h, then g's whole group
        assert await store.move_async(b"from", b"to", 0) == 1
        assert await peer.request(pop(b"to")) == [(b"h", b"second")]
        assert await peer.request(pop(b"to")) == [(b"g", b"first"), (b"g", b"rider")]
        assert await peer.request(pop(b"to")) == [(b"old", b"already there")]
        assert await peer.request(pop(b"to")) == []
        # Nothing left on its way: every group's ``:m`` entry was deleted.
        assert [node.cli("--scan", "--pattern", "pq:*:m").split() for node in cluster] == [
            [],
            [],
            [],
        ]


async def test_a_move_cut_between_its_halves_is_finished_once_by_a_scan(
    cluster: list[RedisServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with front_end(cluster_url(cluster)) as (server, port):
        peer = await connect(port)
        await peer.send(push(b"cut-from", b"k", b"job") + push(b"cut-from", b"k", b"rider", prio=0))
        await peer.request(SYNC)
        store = server.broker.store
        assert isinstance(store, RedisStore)
        out_keys = store._move_keys(b"cut-from")
        # The first half only, as a front end that dies right after it leaves it.
        (packets,) = await store.call_all([("move_out", out_keys, [0, b"dead:m1", b"cut-to"])])
        assert len(packets) == 10
        assert await peer.request(pop(b"cut-from")) == []
        await store.finish_moves()  # too recent: a live front end may still be on it
        assert await peer.request(pop(b"cut-to")) == []
        monkeypatch.setattr("pinpriq.redis.store.MOVE_ABANDONED_MS", 0)
        await store.finish_moves()
        await store.finish_moves()  # nothing left to finish
        # And the second half sent again (the dead front end's call arriving late) is skipped.
        await store._move_in(b"cut-to", b"dead:m1", packets)
        assert await peer.request(pop(b"cut-to")) == [(b"k", b"job"), (b"k", b"rider")]
        assert await peer.request(pop(b"cut-to")) == []


async def test_delayed_packets_on_a_cluster(cluster: list[RedisServer]) -> None:
    url = cluster_url(cluster)
    async with front_end(url) as (server, a), front_end(url) as (_, b):
        pusher, subscriber = await connect(a), await connect(b)
        await subscriber.send(subscribe(b"later") + READY)
        await subscriber.request(SYNC)
        await pusher.send(
            encode(DelayedPush(b"later", b"k", b"due", 0, 1, 300))
            + encode(DelayedPush(b"popped", b"k", b"due", 0, 1, 1000))
            + encode(DelayedPush(b"held", b"k", b"in a minute", 0, 1, 60_000))
            + SYNC
        )
        assert await pusher.reply() == []
        assert await pusher.request(pop(b"popped")) == []  # not before it is due
        store = server.broker.store
        assert isinstance(store, RedisStore)
        await store.refresh_snapshot()  # the scan finds them on their nodes
        assert store.queue_info(b"held").delayed == 1
        assert store.delayed_bytes > 0
        with trio.fail_after(10):  # B hears of it, times it, and is woken when it is due
            assert await subscriber.reply() == [(b"k", b"due")]
        await trio.sleep(1.05)
        assert await pusher.request(pop(b"popped")) == [(b"k", b"due")]
