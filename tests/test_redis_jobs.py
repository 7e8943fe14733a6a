"""Protocol 1.2 on the Redis store, against a real redis-server: delayed packets (decision 21)
held in Redis on Redis's clock, promoted by whichever front end comes first, a front end's death
losing none of them; and moves (decision 22) on one Redis.

Delays here are short (a few hundred ms) and every wait is bounded: a test waits at least the
delay before it expects a packet, and ``fail_after`` bounds what it waits for a delivery."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import trio

from pinpriq.redis.keys import queue_keys
from pinpriq.redis.store import RedisStore
from pinpriq.wire import DelayedPush, encode
from tests.rawpeer import pop, push, release, reserve, subscribe
from tests.redis_servers import RedisServer, need_redis
from tests.test_redis_store import (
    READY,
    SYNC,
    connect,
    front_end,
    start_front_end,
    two_front_ends,
)


def later(
    queue: bytes, key: bytes, payload: bytes, delay_ms: int, *, ttl_ms: int = 0, prio: int = 1
) -> bytes:
    """A ``71`` push with a delay."""
    return encode(DelayedPush(queue, key, payload, ttl_ms, prio, delay_ms))


def no_scans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Front ends started in this process scan Redis once, at start, and do not look at their
    waited queues again: what they deliver then comes through their timers and the channel,
    not the backstops (the scan, the waiting marks' renewal)."""
    monkeypatch.setattr("pinpriq.redis.store.SNAPSHOT_INTERVAL", 3600.0)
    monkeypatch.setattr("pinpriq.redis.deliveries.REFRESH_SECONDS", 3600.0)


def store_of(server: object) -> RedisStore:
    store = server.broker.store  # type: ignore[attr-defined]
    assert isinstance(store, RedisStore)
    return store


async def test_a_delayed_packet_is_in_no_queue_until_due_then_keeps_its_push_order(
    redis_url: str,
) -> None:
    async with two_front_ends(redis_url) as (a, b):
        pusher, popper = await connect(a), await connect(b)
        await pusher.send(
            later(b"q", b"k", b"delayed", 1000, prio=5)  # its seq is taken now
            + push(b"q", b"k", b"now", prio=7)
            + push(b"q", b"other", b"newer", prio=5)
        )
        await pusher.request(SYNC)
        # Not popped, and in no key group: k's group is only the packet pushed at once.
        assert await popper.request(pop(b"q")) == [(b"other", b"newer")]
        assert await popper.request(pop(b"q")) == [(b"k", b"now")]
        assert await popper.request(pop(b"q")) == []
        await pusher.send(push(b"q", b"n", b"pushed after it", prio=5))
        await pusher.request(SYNC)
        await trio.sleep(1.05)
        # Due: pushed after it, the other prio-5 packet is newer and comes first (decision 21).
        await pusher.send(push(b"q", b"k", b"rider", prio=0))
        await pusher.request(SYNC)
        assert await popper.request(pop(b"q")) == [(b"n", b"pushed after it")]
        assert await popper.request(pop(b"q")) == [(b"k", b"delayed"), (b"k", b"rider")]
        assert await popper.request(pop(b"q")) == []


async def test_a_delayed_packets_ttl_counts_from_its_due_time(redis_url: str) -> None:
    async with front_end(redis_url) as (_, port):
        peer = await connect(port)
        # Counted from the push, the TTL would end at 1 s, when the packets fall due: they
        # would be dropped as they arrive. Counted from the due time, they live until 2 s.
        await peer.send(
            later(b"t", b"a", b"", 1000, ttl_ms=1000) + later(b"t", b"b", b"", 1000, ttl_ms=1000)
        )
        await peer.request(SYNC)
        await trio.sleep(1.05)
        assert len(await peer.request(pop(b"t"))) == 1
        await trio.sleep(1.0)  # past due + TTL
        assert await peer.request(pop(b"t")) == []


async def test_delayed_packets_are_counted_listed_and_purged(
    redis_url: str, redis_server: RedisServer
) -> None:
    async with front_end(redis_url) as (server, port):
        store = store_of(server)
        peer = await connect(port)
        await peer.send(later(b"only", b"k", b"x", 60_000) + later(b"mixed", b"k", b"x", 60_000))
        await peer.send(push(b"mixed", b"j", b"y"))
        await peer.request(SYNC)
        assert store.queue_info(b"only").delayed == 1  # told by the push reply
        await store.refresh_snapshot()  # and by a scan, as another front end sees it
        assert store.queue_info(b"only").packets == 0
        assert store.queue_info(b"only").delayed == 1
        assert store.queue_info(b"mixed")[:1] == (1,)
        assert store.queue_info(b"mixed").delayed == 1
        assert {name for name, _, _ in store.sizes()} == {b"only", b"mixed"}
        assert store.delayed_bytes > 0
        assert await store.purge_async(b"mixed") == 2
        assert store.queue_info(b"mixed").delayed == 0
        keys = queue_keys(b"mixed")
        assert redis_server.cli("EXISTS", keys.delayed.decode(), keys.due.decode()) == "0"


async def test_a_subscriber_on_another_front_end_gets_a_delayed_packet_when_due(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_scans(monkeypatch)
    async with two_front_ends(redis_url) as (a, b):
        subscriber, pusher = await connect(b), await connect(a)
        await subscriber.send(subscribe(b"jobs") + READY)
        await subscriber.request(SYNC)
        await pusher.send(later(b"jobs", b"k", b"job", 1000))
        await pusher.request(SYNC)
        await subscriber.expect_silence(0.1)  # not before it is due
        with trio.fail_after(10):
            assert await subscriber.reply() == [(b"k", b"job")]


async def test_delayed_packets_outlive_the_front_end_that_pushed_them(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_scans(monkeypatch)  # B's timer promotes them at their due time, not its next scan
    front, a = await start_front_end(redis_url)
    try:
        async with front_end(redis_url) as (_, b):
            # One subscriber waits before the push (it hears the due time), one only after
            # the pusher died (it reads the due time from Redis when it starts waiting).
            early = await connect(b)
            await early.send(subscribe(b"early") + READY)
            await early.request(SYNC)
            pusher = await connect(a)
            await pusher.send(later(b"early", b"e", b"1", 400) + later(b"late", b"l", b"2", 400))
            await pusher.request(SYNC)
            front.send_signal(signal.SIGKILL)
            await front.wait()
            late = await connect(b)
            await late.send(subscribe(b"late") + READY)
            with trio.fail_after(10):
                assert await early.reply() == [(b"e", b"1")]
                assert await late.reply() == [(b"l", b"2")]
    finally:
        if front.returncode is None:
            front.send_signal(signal.SIGKILL)
            await front.wait()


async def test_a_move_on_one_redis(redis_url: str, redis_server: RedisServer) -> None:
    async with front_end(redis_url) as (server, a), front_end(redis_url) as (_, b):
        peer, other = await connect(a), await connect(b)
        await peer.send(
            push(b"jobs", b"old", b"already there", prio=3)
            + push(b"jobs.dead", b"g", b"first", prio=3)
            + push(b"jobs.dead", b"h", b"second", prio=3, ttl_ms=60_000)
            + push(b"jobs.dead", b"g", b"rider", prio=0)
            + push(b"jobs.dead", b"lone", b"prio 0", prio=0)
            + push(b"jobs.dead", b"leased", b"x", prio=1)
            + later(b"jobs.dead", b"d", b"delayed", 60_000)
        )
        await peer.request(SYNC)
        # A leased packet, leased and released once: it stays put, and its count is kept.
        await other.send(reserve(b"jobs.dead", 60_000))
        lease_id, attempt, packets = await other.lease()
        assert (attempt, packets) == (1, [(b"leased", b"x")])
        store = store_of(server)
        # Whole groups in pop order while fewer than 2 moved: h, then g with its rider.
        assert await store.move_async(b"jobs.dead", b"jobs", 2) == 3
        # h's TTL deadline went with it.
        assert redis_server.cli("ZCARD", queue_keys(b"jobs").expiry.decode()) == "1"
        # All the rest that is queued: the prio-0 packet whose key has nothing selectable.
        assert await store.move_async(b"jobs.dead", b"jobs", 0) == 1
        assert await store.move_async(b"jobs.dead", b"jobs", 0) == 0
        # Newer than what was there, in their old relative order (newest first).
        assert await peer.request(pop(b"jobs")) == [(b"h", b"second")]
        assert await peer.request(pop(b"jobs")) == [(b"g", b"first"), (b"g", b"rider")]
        assert await peer.request(pop(b"jobs")) == [(b"old", b"already there")]
        assert await peer.request(pop(b"jobs")) == []  # the prio-0 packet is not selectable
        await other.send(release(lease_id))
        await other.lease()
        await other.send(reserve(b"jobs.dead", 60_000))
        assert (await other.lease())[1:] == (2, [(b"leased", b"x")])


async def test_a_moved_packet_starts_its_attempts_again(
    redis_url: str, redis_server: RedisServer
) -> None:
    async with front_end(redis_url) as (server, port):
        worker = await connect(port)
        await worker.send(push(b"src", b"k", b"job"))
        await worker.request(SYNC)
        await worker.send(reserve(b"src", 60_000))
        lease_id, attempt, _ = await worker.lease()
        await worker.send(release(lease_id))
        await worker.lease()
        await worker.send(reserve(b"src", 60_000))
        lease_id, attempt, _ = await worker.lease()
        assert attempt == 2
        await worker.send(release(lease_id))
        await worker.lease()
        assert await store_of(server).move_async(b"src", b"dst", 0) == 1
        # Its count in the source is gone too, not left behind under its old seq.
        assert redis_server.cli("EXISTS", queue_keys(b"src").attempts.decode()) == "0"
        await worker.send(reserve(b"dst", 60_000))
        assert (await worker.lease())[1:] == (1, [(b"k", b"job")])


async def test_subscribers_are_woken_after_redis_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The direct connections (``direct.py``: deliveries and the pub/sub messages that start
    them) connect again after Redis restarts, and a subscriber waiting since before the
    restart is still woken by a push through another front end."""
    need_redis()
    no_scans(monkeypatch)
    redis = RedisServer(tmp_path / "aof", "--appendonly", "yes", "--appendfsync", "always")
    redis.start()
    channel = queue_keys(b"jobs").channel.decode()
    try:
        async with two_front_ends(redis.url) as (a, b):
            subscriber, pusher = await connect(b), await connect(a)
            await subscriber.send(subscribe(b"jobs") + READY * 2)
            await subscriber.request(SYNC)
            await pusher.request(push(b"jobs", b"k1", b"before") + SYNC)
            with trio.fail_after(10):
                assert await subscriber.reply() == [(b"k1", b"before")]
            redis.stop()  # SIGKILL
            await trio.sleep(0.2)
            redis.start()  # same port; its AOF has the waiting mark
            with trio.fail_after(15):  # B reconnects with backoff, then subscribes again
                while True:  # Redis is the only one who can tell: ask it
                    if redis.cli("PUBSUB", "NUMSUB", channel).split()[-1] == "1":
                        break
                    await trio.sleep(0.05)
            await pusher.request(push(b"jobs", b"k2", b"after") + SYNC)
            with trio.fail_after(10):
                assert await subscriber.reply() == [(b"k2", b"after")]
    finally:
        redis.stop()


async def test_a_subscriber_arriving_while_redis_is_down_is_served_once_it_is_back(
    tmp_path: Path,
) -> None:
    need_redis()
    redis = RedisServer(tmp_path / "aof", "--appendonly", "yes", "--appendfsync", "always")
    redis.start()
    try:
        async with two_front_ends(redis.url) as (a, b):
            redis.stop()  # SIGKILL
            await trio.sleep(0.2)
            subscriber = await connect(b)
            await subscriber.send(subscribe(b"jobs") + READY)  # cannot mark it in Redis now
            await trio.sleep(0.3)
            redis.start()
            pusher = await connect(a)
            with trio.fail_after(30):  # B's renewal of its marks comes within 10 s
                await pusher.request(push(b"jobs", b"k", b"job") + SYNC)
                assert await subscriber.reply() == [(b"k", b"job")]
    finally:
        redis.stop()
