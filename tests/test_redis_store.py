"""The Redis store against a real redis-server: the wire fixtures, two front ends sharing
queues, the checks at start, and a differential test against the built-in store."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
from coredis.exceptions import ConnectionError as RedisConnectionError

from pinpriq.conformance import DEFAULT_FIXTURES, Requires, load_fixtures, run_suite
from pinpriq.redis import lua
from pinpriq.redis.connect import open_store
from pinpriq.redis.keys import queue_keys
from pinpriq.redis.spec import parse_store
from pinpriq.redis.store import RedisStore, redis_client
from pinpriq.server import PinpriqServer
from pinpriq.wire import Pop, Push
from tests.rawpeer import (
    Peer,
    ack,
    leased_subscribe,
    pop,
    push,
    release,
    reserve,
    subscribe,
    touch,
)
from tests.redis_servers import RedisServer, free_port, need_redis
from tests.test_conformance import PASSING_STEP_TIMEOUT

SYNC = b"\x21"
READY = b"\x41"

#: Every fixture, the lease ones included (decision 19: leases work on the Redis store too).
FIXTURES = load_fixtures(DEFAULT_FIXTURES)
#: A fixture step's bound: a hang detector, not a speed limit (see test_conformance).
STEP_TIMEOUT = PASSING_STEP_TIMEOUT
HOST = "127.0.0.1"


#: Client connections the test opened (``connect``), closed when its front ends stop.
_PEERS: list[Peer] = []


@asynccontextmanager
async def front_end(url: str, **options: Any) -> AsyncIterator[tuple[PinpriqServer, int]]:
    """A pinpriq server on the Redis store at ``url``, listening on an ephemeral port."""
    async with open_store(parse_store(url)) as (store, deliveries):
        server = PinpriqServer(store, deliveries=deliveries, max_memory=0, **options)
        try:
            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(partial(server.serve, 0, host=HOST))
                yield server, listeners[0].socket.getsockname()[1]
                nursery.cancel_scope.cancel()
        finally:
            while _PEERS:
                await _PEERS.pop().aclose()


async def test_every_fixture_passes_on_the_redis_store(redis_url: str) -> None:
    async with front_end(redis_url) as (_, port):
        results = await run_suite(FIXTURES, HOST, port, step_timeout=STEP_TIMEOUT)
    failed = [r.line() for r in results if not r.passed]
    assert failed == []
    assert {r.name for r in results if r.skipped} == {
        f.name for f in FIXTURES if f.requires is Requires.TOKEN
    }


async def start_front_end(url: str, *options: str) -> tuple[trio.Process, int]:
    """A front end in its own process (to be killed), and its port once it listens."""
    port = free_port()
    front = await trio.lowlevel.open_process(
        [sys.executable, "-m", "pinpriq.cli.server", "--store", url, "--port", str(port),
         "--http-port", "off", *options],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    with trio.fail_after(10):
        while True:
            try:
                (await connect(port)).socket_stream.socket.close()
                return front, port
            except OSError:
                await trio.sleep(0.05)


async def test_a_lease_held_through_a_front_end_killed_returns_at_its_deadline(
    redis_url: str,
) -> None:
    front, a = await start_front_end(redis_url)
    try:
        async with front_end(redis_url) as (_, b):
            worker, pusher, waiter = await connect(a), await connect(b), await connect(b)
            await pusher.send(push(b"jobs", b"k", b"job") + push(b"jobs", b"j", b"other"))
            await pusher.request(SYNC)
            await worker.send(reserve(b"jobs", 1500) + reserve(b"jobs", 1500))
            assert await worker.lease() == (1, 1, [(b"j", b"other")])
            assert await worker.lease() == (2, 1, [(b"k", b"job")])
            # Leased on A: B finds nothing to reserve while the leases hold.
            await waiter.send(reserve(b"jobs"))
            assert await waiter.lease() == (0, 0, [])
            # A leased subscriber on B waits for the queue: a lease comes back to it.
            subscriber = await connect(b)
            await subscriber.send(leased_subscribe(b"jobs", 60_000) + READY)
            front.send_signal(signal.SIGKILL)
            await front.wait()
            with trio.fail_after(15):  # the deadline, then B's timer or its scan (5 s)
                lease_id, attempt, delivered = await subscriber.lease()
            assert attempt == 2
            # And the other is reservable through B (a reserve ends due leases first).
            with trio.fail_after(15):
                while True:
                    await waiter.send(reserve(b"jobs", 60_000))
                    other_id, other_attempt, reserved = await waiter.lease()
                    if other_id:
                        break
                    await trio.sleep(0.05)
            assert other_attempt == 2
            assert sorted(delivered + reserved) == [(b"j", b"other"), (b"k", b"job")]
            await subscriber.send(ack(lease_id))
            assert await subscriber.lease() == (lease_id, 1, [])
            await waiter.send(ack(other_id))
            assert await waiter.lease() == (other_id, 1, [])
            assert await pusher.request(pop(b"jobs")) == []
    finally:
        if front.returncode is None:
            front.send_signal(signal.SIGKILL)
            await front.wait()


async def test_an_ack_on_one_front_end_removes_the_group_for_good(redis_url: str) -> None:
    async with two_front_ends(redis_url) as (a, b):
        worker, other = await connect(a), await connect(b)
        await worker.send(push(b"q", b"k", b"1") + push(b"q", b"k", b"2", prio=0))
        await worker.send(reserve(b"q", 200))
        assert await worker.lease() == (1, 1, [(b"k", b"1"), (b"k", b"2")])
        await worker.send(ack(1) + ack(1))
        assert await worker.lease() == (1, 1, [])  # live: acked
        assert await worker.lease() == (1, 0, [])  # gone
        await trio.sleep(0.4)  # past the deadline it no longer has
        await other.send(reserve(b"q"))
        assert await other.lease() == (0, 0, [])
        assert await other.request(pop(b"q")) == []


async def test_an_ack_right_after_its_reserve_shares_its_round_trip(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that writes a reserve and the ack of the id it will get at once pays one round
    trip to Redis, not two; after two reserves, which lease an id names depends on what they
    find, so the ack waits for them."""
    async with front_end(redis_url) as (server, port):
        store = server.batched
        assert isinstance(store, RedisStore)
        worker = await connect(port)
        assert await worker.request(push(b"q", b"k", b"1") + push(b"q", b"n", b"2") + SYNC) == []
        pipelines: list[list[str]] = []
        real_pipeline = store._pipeline

        async def counted(calls: Any) -> list[Any]:
            pipelines.append([name for name, _, _ in calls])
            return await real_pipeline(calls)

        monkeypatch.setattr(store, "_pipeline", counted)
        await worker.send(reserve(b"q") + ack(1))
        assert await worker.lease() == (1, 1, [(b"n", b"2")])
        assert await worker.lease() == (1, 1, [])  # live: acked
        assert pipelines == [["reserve", "lease_op"]]
        await worker.send(reserve(b"none") + touch(2, 60_000))  # finds nothing: no lease 2
        assert await worker.lease() == (0, 0, [])
        assert await worker.lease() == (2, 0, [])
        pipelines.clear()
        await worker.send(reserve(b"none") + reserve(b"q") + ack(2))
        assert await worker.lease() == (0, 0, [])
        assert await worker.lease() == (2, 1, [(b"k", b"1")])
        assert await worker.lease() == (2, 1, [])  # the second reserve's lease: acked
        assert pipelines == [["reserve", "reserve"], ["lease_op"]]
        assert await worker.request(pop(b"q")) == []  # both acked: gone for good


async def test_release_touch_and_close_send_packets_back_through_redis(redis_url: str) -> None:
    async with two_front_ends(redis_url) as (a, b):
        worker, other = await connect(a), await connect(b)
        await worker.send(push(b"q", b"k", b"v", prio=3))
        await worker.send(reserve(b"q", 300))
        assert await worker.lease() == (1, 1, [(b"k", b"v")])
        await worker.send(touch(1, 5000))
        assert await worker.lease() == (1, 1, [])
        await trio.sleep(0.5)  # past the first deadline: the touch holds it
        await other.send(reserve(b"q"))
        assert await other.lease() == (0, 0, [])
        await worker.send(release(1, 300))  # back after 300 ms, as attempt 2
        assert await worker.lease() == (1, 1, [])
        await other.send(reserve(b"q"))
        assert await other.lease() == (0, 0, [])
        with trio.fail_after(10):
            while True:
                await other.send(reserve(b"q", 60_000))
                lease_id, attempt, packets = await other.lease()
                if lease_id:
                    break
                await trio.sleep(0.05)
        assert (lease_id, attempt, packets) == (1, 2, [(b"k", b"v")])
        await other.aclose()  # its leases go back at once, not at their deadline
        with trio.fail_after(5):
            while True:
                await worker.send(reserve(b"q"))
                lease_id, attempt, packets = await worker.lease()
                if lease_id:
                    break
                await trio.sleep(0.05)
        assert (attempt, packets) == (3, [(b"k", b"v")])


async def test_a_group_goes_to_the_dead_letter_queue_after_max_deliveries(
    redis_url: str,
) -> None:
    async with front_end(redis_url, max_deliveries=2) as (_, port):
        worker = await connect(port)
        await worker.send(push(b"q", b"k", b"v", ttl_ms=60_000) + push(b"q", b"k", b"w", prio=0))
        await worker.send(reserve(b"q") + release(1))
        assert await worker.lease() == (1, 1, [(b"k", b"v"), (b"k", b"w")])
        assert await worker.lease() == (1, 1, [])
        await worker.send(reserve(b"q", 100))
        assert await worker.lease() == (2, 2, [(b"k", b"v"), (b"k", b"w")])
        await trio.sleep(0.3)  # its deadline ends attempt 2: to q.dead
        await worker.send(reserve(b"q"))
        assert await worker.lease() == (0, 0, [])
        await worker.send(reserve(b"q.dead"))
        assert await worker.lease() == (3, 1, [(b"k", b"v"), (b"k", b"w")])


@pytest.mark.parametrize("emptied_by", ["reserve", "pop", "purge"])
async def test_a_packet_pushed_while_others_are_leased_pops_before_them(
    redis_url: str, emptied_by: str
) -> None:
    """Decision 15: a leased packet goes back in its place in push order, so a packet pushed
    while it was leased is newer, even when the queue emptied meanwhile (by the reserve, a pop
    of the rest or a purge). The queue's sequence numbers run ahead of Redis's clock here, as
    after the clock stepped back (or a batch, whose numbers run a microsecond a packet ahead):
    a push that had forgotten them would take an older number than the leased packet's, or
    the same one, and the packet going back would overwrite it."""
    async with front_end(redis_url) as (server, port):
        store = server.batched
        assert isinstance(store, RedisStore)
        ahead = b"%016d" % ((time.time() + 3600) * 1_000_000)
        await store.client.hset(queue_keys(b"q").data, {lua.META: ahead})
        worker = await connect(port)
        rest = b"" if emptied_by == "reserve" else push(b"q", b"b", b"rest", prio=9)
        await worker.send(push(b"q", b"a", b"leased", prio=5) + rest)
        await worker.send(reserve(b"q", 60_000))
        assert await worker.lease() == (1, 1, [(b"a", b"leased")])
        if emptied_by == "pop":
            assert await worker.request(pop(b"q")) == [(b"b", b"rest")]
        elif emptied_by == "purge":
            assert await store.purge_async(b"q") == 1
        await worker.send(push(b"q", b"c", b"new", prio=5) + release(1))
        assert await worker.lease() == (1, 1, [])
        assert await worker.request(pop(b"q")) == [(b"c", b"new")]
        assert await worker.request(pop(b"q")) == [(b"a", b"leased")]


def packets_held(redis: RedisServer, queue: bytes) -> int:
    """The packets ``queue`` holds, read from Redis (layout 5: its ``:d`` hash's fields less
    its meta field and key-group markers)."""
    data = queue_keys(queue).data.decode()
    meta = redis.cli("HGET", data, lua.META.decode())
    return lua.packets_held(int(redis.cli("HLEN", data)), meta.encode() or None)


async def connect(port: int) -> Peer:
    peer = Peer(await trio.open_tcp_stream(HOST, port))
    _PEERS.append(peer)
    return peer


@asynccontextmanager
async def two_front_ends(url: str) -> AsyncIterator[tuple[int, int]]:
    async with front_end(url) as (_, a), front_end(url) as (_, b):
        yield a, b


async def test_a_packet_pushed_through_one_front_end_pops_through_another(redis_url: str) -> None:
    async with two_front_ends(redis_url) as (a, b):
        pusher, popper = await connect(a), await connect(b)
        await pusher.send(push(b"q", b"k1", b"old", prio=2) + push(b"q", b"k2", b"low", prio=9))
        await pusher.send(push(b"q", b"k1", b"rider", prio=0) + push(b"q", b"k3", b"new", prio=2))
        await pusher.request(SYNC)
        # Priority, then newest; the key group with its prio-0 rider, in push order.
        assert await popper.request(pop(b"q")) == [(b"k3", b"new")]
        assert await popper.request(pop(b"q")) == [(b"k1", b"old"), (b"k1", b"rider")]
        assert await popper.request(pop(b"q")) == [(b"k2", b"low")]
        assert await popper.request(pop(b"q")) == []


async def test_a_subscriber_on_another_front_end_is_woken_at_once(redis_url: str) -> None:
    async with two_front_ends(redis_url) as (a, b):
        subscriber, pusher = await connect(b), await connect(a)
        await subscriber.send(subscribe(b"jobs") + READY)
        await subscriber.request(SYNC)  # subscribed and waiting before the push
        for n in range(5):
            await subscriber.send(READY)
            await subscriber.request(SYNC)
            # Nothing polls: without the push's wake-up through Redis this delivery never
            # comes, and the reply's time limit fails the test. How fast it comes is a
            # benchmark's question (benchmarks/redis_wake_latency.py), not a test's.
            await pusher.send(push(b"jobs", b"k%d" % n, b"p"))
            with trio.fail_after(10):
                assert await subscriber.reply() == [(b"k%d" % n, b"p")]


async def test_the_message_handler_sends_the_delivery_pop_itself(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push through another front end wakes a lone-queue waiter here with a pop written by
    the task that read the pub/sub message (``RedisStore.pop_early``), whose result the
    delivery takes: none is left over, and none is sent for a queue nobody waits on."""
    early: list[bytes] = []
    pop_early = RedisStore.pop_early

    def counted(store: RedisStore, queue: bytes) -> None:
        early.append(queue)
        pop_early(store, queue)

    monkeypatch.setattr(RedisStore, "pop_early", counted)
    async with front_end(redis_url) as (_, a), front_end(redis_url) as (server, b):
        store = server.batched
        assert isinstance(store, RedisStore)
        subscriber, pusher = await connect(b), await connect(a)
        await subscriber.send(subscribe(b"jobs") + READY * 3)
        await subscriber.request(SYNC)
        for n in range(3):
            await pusher.send(push(b"jobs", b"k%d" % n, b"p"))
            with trio.fail_after(10):
                assert await subscriber.reply() == [(b"k%d" % n, b"p")]
        assert early == [b"jobs"] * 3
        assert not store._early  # each taken by its delivery


async def test_an_early_pop_nobody_took_goes_back_to_its_queue(redis_url: str) -> None:
    """The waiter a message woke may leave before its delivery runs: the packets its early
    pop took go back (``drop_early``), and the next pop gets them."""
    async with front_end(redis_url) as (server, port):
        store = server.batched
        assert isinstance(store, RedisStore)
        client = await connect(port)
        await client.request(push(b"jobs", b"k", b"kept", prio=3) + SYNC)
        store.pop_early(b"jobs")  # as if a waiter were woken, then left
        assert await store.drop_early(keep=()) == [b"jobs"]
        assert await client.request(pop(b"jobs")) == [(b"k", b"kept")]


async def test_rediss_reaches_a_tls_redis_through_the_direct_connections(
    tmp_path: Path, ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rediss://``: the script calls and the pub/sub messages take ``direct.py``'s sockets
    over TLS (checking Redis's certificate, trusted here through ``SSL_CERT_FILE``), as coredis
    does for the rest. Redis's TLS port speaks nothing else, so a plain socket would fail."""
    need_redis()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "redis.crt"))
    cert.private_key_pem.write_to_path(str(tmp_path / "redis.key"))
    tls_port = free_port()
    redis = RedisServer(
        tmp_path / "data",
        "--appendonly", "no",
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(tmp_path / "redis.crt"),
        "--tls-key-file", str(tmp_path / "redis.key"),
        "--tls-ca-cert-file", str(tmp_path / "ca.pem"),
        "--tls-auth-clients", "no",
    )  # fmt: skip
    redis.start()
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
    url = f"rediss://127.0.0.1:{tls_port}/0"
    try:
        with trio.fail_after(30):  # a plain socket to the TLS port gets no answer: no hang
            async with front_end(url) as (server, a), front_end(url) as (_, b):
                store = server.batched
                assert isinstance(store, RedisStore)
                assert store.direct is not None
                subscriber, pusher = await connect(b), await connect(a)
                await subscriber.send(subscribe(b"jobs") + READY)
                await subscriber.request(SYNC)
                await pusher.send(push(b"jobs", b"k", b"woken") + push(b"q", b"k", b"popped"))
                assert await subscriber.reply() == [(b"k", b"woken")]
                assert await pusher.request(pop(b"q")) == [(b"k", b"popped")]
    finally:
        redis.stop()


async def test_subscribers_on_both_front_ends_get_each_packet_once(redis_url: str) -> None:
    async with two_front_ends(redis_url) as (a, b):
        subs = [await connect(a), await connect(b), await connect(a), await connect(b)]
        for sub in subs:
            await sub.send(subscribe(b"work") + READY * 1000)
            await sub.request(SYNC)
        pushers = [await connect(a), await connect(b)]
        for n in range(200):
            await pushers[n % 2].send(push(b"work", b"%d" % n, b""))
        received: list[bytes] = []
        all_in = trio.Event()

        async def collect(sub: Peer) -> None:
            while True:
                received.extend(key for key, _ in await sub.reply())
                if len(received) >= 200:
                    all_in.set()

        with trio.move_on_after(10):  # a bound for a loaded CI machine; ~0.7 s here
            async with trio.open_nursery() as nursery:
                for sub in subs:
                    nursery.start_soon(collect, sub)
                await all_in.wait()
                nursery.cancel_scope.cancel()
        assert sorted(received) == sorted(b"%d" % n for n in range(200))
        for sub in subs:
            await sub.expect_silence(0.05)


async def test_waiting_subscribers_on_one_front_end_are_served_in_arrival_order(
    redis_url: str,
) -> None:
    async with two_front_ends(redis_url) as (a, b):
        first, second = await connect(a), await connect(a)
        for sub in (first, second):
            await sub.send(subscribe(b"fifo") + READY)
            await sub.request(SYNC)
        pusher = await connect(b)
        # One at a time: two pushes that land before the front end hears of the first are
        # both queued when it pops, and the newer is the better packet (decision 2).
        await pusher.send(push(b"fifo", b"1", b""))
        assert await first.reply() == [(b"1", b"")]
        await pusher.send(push(b"fifo", b"2", b""))
        assert await second.reply() == [(b"2", b"")]


async def test_ttl_runs_on_redis_and_expired_packets_are_swept(
    redis_url: str, redis_server: RedisServer
) -> None:
    async with two_front_ends(redis_url) as (a, b):
        pusher, popper = await connect(a), await connect(b)
        await pusher.send(push(b"t", b"gone", b"", ttl_ms=50) + push(b"t", b"stays", b"", prio=9))
        await pusher.request(SYNC)
        await trio.sleep(0.2)  # a Redis-side deadline: a short, bounded wait
        # Swept by the pushing front end's timer, without a pop: only one packet is held.
        assert packets_held(redis_server, b"t") == 1
        assert await popper.request(pop(b"t")) == [(b"stays", b"")]


async def test_a_sync_acknowledged_push_survives_a_front_end_killed(
    redis_url: str, tmp_path: Path
) -> None:
    port = free_port()
    front = await trio.lowlevel.open_process(
        [sys.executable, "-m", "pinpriq.cli.server", "--store", redis_url, "--port", str(port),
         "--http-port", "off"],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with trio.fail_after(10):
            while True:
                try:
                    pusher = await connect(port)
                    break
                except OSError:
                    await trio.sleep(0.05)
        await pusher.send(b"".join(push(b"keep", b"%d" % n, b"x") for n in range(100)))
        assert await pusher.request(SYNC) == []
    finally:
        front.send_signal(signal.SIGKILL)
        await front.wait()
    async with front_end(redis_url) as (_, other):
        popper = await connect(other)
        got = [await popper.request(pop(b"keep")) for _ in range(101)]
    assert [key for reply in got for key, _ in reply] == [b"%d" % n for n in range(99, -1, -1)]


async def test_a_full_redis_holds_pushes_and_still_serves_pops(tmp_path: Path) -> None:
    need_redis()
    redis = RedisServer(tmp_path / "full", "--maxmemory", "3mb").start()
    try:
        async with front_end(redis.url) as (_, port):
            pusher, popper = await connect(port), await connect(port)
            payload = b"x" * 60_000
            pushed = 0
            while True:  # until Redis refuses and the server holds the push
                await pusher.send(push(b"big", b"%d" % pushed, payload) + SYNC)
                with trio.move_on_after(0.5) as held:
                    assert await pusher.reply() == []
                if held.cancelled_caught:
                    break
                pushed += 1
            assert 10 < pushed < 200
            stuck = pushed  # the push the server holds
            # Pops run while Redis is full, and free the room the held push waits for.
            for _ in range(10):
                assert len(await popper.request(pop(b"big"))) == 1
            with trio.fail_after(5):
                assert await pusher.reply() == []  # the sync after the held push
            assert packets_held(redis, b"big") == stuck + 1 - 10
    finally:
        redis.stop()


#: A script that holds Redis for a second: past ``busy-reply-threshold``, Redis answers every
#: other command with BUSY meanwhile.
_BUSY_SECOND = """
local started = redis.call('TIME')
while true do
  local now = redis.call('TIME')
  if (now[1] - started[1]) * 1000000 + now[2] - started[2] > 1000000 then return 1 end
end
"""


async def test_a_script_holding_redis_busy_makes_calls_wait_not_fail(tmp_path: Path) -> None:
    """While a script runs past ``busy-reply-threshold`` (a long move, a huge pop on a slow
    machine, another application's script), Redis answers BUSY to every other command, which
    it has not run: the front end waits and sends them again, as for a Redis that is loading,
    and its clients get their answers once the script ends."""
    need_redis()
    redis = RedisServer(tmp_path / "busy", "--appendonly", "no", "--busy-reply-threshold", "10")
    redis.start()
    try:
        async with front_end(redis.url) as (_, port):
            client = await connect(port)
            await client.request(push(b"q", b"k", b"p") + SYNC)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(trio.to_thread.run_sync, redis.cli, "EVAL", _BUSY_SECOND, "0")
                )
                while True:  # Redis is the one who can tell when it is busy
                    if (await trio.to_thread.run_sync(redis.cli, "PING")).startswith("BUSY"):
                        break
                    await trio.sleep(0.01)
                with trio.fail_after(10):
                    assert await client.request(pop(b"q")) == [(b"k", b"p")]
    finally:
        redis.stop()


async def test_redis_restarted_under_load_loses_nothing_synced(tmp_path: Path) -> None:
    need_redis()
    redis = RedisServer(tmp_path / "aof", "--appendonly", "yes", "--appendfsync", "always")
    redis.start()
    try:
        async with front_end(redis.url) as (_, port):
            pusher = await connect(port)
            acknowledged: list[bytes] = []

            async def push_batches() -> None:
                for batch in range(40):
                    keys = [b"%d-%d" % (batch, n) for n in range(10)]
                    await pusher.send(b"".join(push(b"durable", k, b"x") for k in keys) + SYNC)
                    assert await pusher.reply() == []  # held while Redis is down
                    acknowledged.extend(keys)
                    await trio.sleep(0.01)

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(push_batches)
                    await trio.sleep(0.1)
                    redis.stop()  # SIGKILL, mid-stream
                    await trio.sleep(0.3)
                    redis.start()  # same port, same directory: replays its AOF
            popper = await connect(port)
            left: list[bytes] = []
            while reply := await popper.request(pop(b"durable")):
                left.extend(key for key, _ in reply)
        assert len(acknowledged) == 400
        # Every acknowledged push is there; a batch cut by the kill may be there twice.
        assert set(acknowledged) <= set(left)
    finally:
        redis.stop()


async def test_a_pop_whose_reply_was_lost_answers_with_what_it_took(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis ran a pop, then the connection broke before its reply came (a restart, a reset):
    the front end sends the call again, and gets the packet removed for its consumer, not the
    next one. Until issue 22 the packet removed first was lost."""
    async with front_end(redis_url) as (server, port):
        store = server.batched
        assert isinstance(store, RedisStore)
        peer = await connect(port)
        pushes = push(b"q", b"a", b"old") + push(b"q", b"b", b"new")
        assert await peer.request(pushes + SYNC) == []
        real_pipeline = store._pipeline
        lost: list[Any] = []

        async def reply_lost_once(calls: Any) -> list[Any]:
            replies = await real_pipeline(calls)
            if not lost and any(name == "pop" for name, _, _ in calls):
                lost.append(replies)  # Redis ran it; the front end never hears
                raise RedisConnectionError("connection reset by peer")
            return replies

        monkeypatch.setattr(store, "_pipeline", reply_lost_once)
        assert await peer.request(pop(b"q")) == [(b"b", b"new")]
        assert lost
        assert await peer.request(pop(b"q")) == [(b"a", b"old")]
        # Each result is kept only until the front end says it has it.
        await store.confirm_results()
        assert await store.client.exists([queue_keys(b"q").results]) == 0


async def test_redis_killed_mid_pipeline_loses_no_confirmed_packet(tmp_path: Path) -> None:
    """Pushes confirmed by a sync and pops pipelined 16 at a time while Redis (appendfsync
    always) is killed with SIGKILL and restarted three times: every confirmed packet is popped
    by a consumer or still queued at the end."""
    need_redis()
    redis = RedisServer(tmp_path / "aof", "--appendonly", "yes", "--appendfsync", "always")
    redis.start()
    try:
        async with front_end(redis.url) as (_, port):
            pusher, popper = await connect(port), await connect(port)
            confirmed: list[bytes] = []
            popped: list[bytes] = []
            pushing_done = trio.Event()

            async def push_batches() -> None:
                for batch in range(60):
                    keys = [b"%d-%d" % (batch, n) for n in range(8)]
                    await pusher.send(b"".join(push(b"q", k, b"x") for k in keys) + SYNC)
                    assert await pusher.reply() == []
                    confirmed.extend(keys)
                    await trio.sleep(0.005)
                pushing_done.set()

            async def pop_batches() -> None:
                while not pushing_done.is_set():
                    await popper.send(pop(b"q") * 16)
                    for _ in range(16):
                        popped.extend(key for key, _ in await popper.reply())

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(push_batches)
                    nursery.start_soon(pop_batches)
                    for _ in range(3):
                        await trio.sleep(0.1)
                        redis.stop()  # SIGKILL, with pipelines of pops in flight
                        await trio.sleep(0.2)
                        redis.start()  # same port and directory: replays its AOF
                while reply := await popper.request(pop(b"q")):
                    popped.extend(key for key, _ in reply)
        assert len(confirmed) == 480
        assert set(confirmed) <= set(popped)
    finally:
        redis.stop()


async def test_a_batch_held_for_its_output_keeps_its_own_replies(redis_url: str) -> None:
    # 80 pops of 100 KB packets in one batch pass the output bound (4 MiB): the server holds
    # the batch until the client reads, while another connection's batches run in between.
    async with front_end(redis_url) as (_, port):
        loader, reader, other = await connect(port), await connect(port), await connect(port)
        big = b"x" * 60_000
        for n in range(80):
            await loader.send(push(b"big", b"%02d" % n, big + b"%02d" % n, prio=1))
        await loader.request(SYNC)
        await reader.send(pop(b"big") * 80 + SYNC)
        await trio.sleep(0.2)  # the reader's batch is held now, its client not reading
        for n in range(20):
            await other.send(push(b"side", b"s%d" % n, b"") + pop(b"side"))
            assert await other.reply() == [(b"s%d" % n, b"")]
        got = [await reader.reply() for _ in range(80)]
        assert [packets[0][0] for packets in got] == [b"%02d" % n for n in range(79, -1, -1)]
        assert await reader.reply() == []  # the sync


async def test_pipelined_lease_frames_answer_in_order(redis_url: str) -> None:
    async with front_end(redis_url) as (_, port):
        worker = await connect(port)
        await worker.send(b"".join(push(b"q", b"k%d" % n, b"%d" % n, prio=n + 1) for n in range(3)))
        # One chunk: three reserves, then frames naming their ids, a release among them.
        await worker.send(
            reserve(b"q") * 3
            + ack(1)
            + touch(2, 60_000)
            + release(3)
            + ack(3)
            + ack(2)
            + reserve(b"q")
            + SYNC
        )
        assert [await worker.lease() for _ in range(3)] == [
            (1, 1, [(b"k0", b"0")]),  # prio 1 first
            (2, 1, [(b"k1", b"1")]),
            (3, 1, [(b"k2", b"2")]),
        ]
        assert [await worker.lease() for _ in range(4)] == [
            (1, 1, []),
            (2, 1, []),
            (3, 1, []),
            (3, 0, []),  # released just before: no longer live
        ]
        assert await worker.lease() == (2, 1, [])
        assert await worker.lease() == (4, 2, [(b"k2", b"2")])  # back, its second attempt
        assert await worker.reply() == []  # the sync


def commands_run(redis: RedisServer) -> int:
    """Commands Redis has run, by ``INFO commandstats``, less its FCALLs (the functions'
    ``redis.call``s count themselves) and INFO itself."""
    total = 0
    for line in redis.cli("INFO", "commandstats").splitlines():
        name, _, fields = line.removeprefix("cmdstat_").partition(":")
        if line.startswith("cmdstat_") and name not in ("fcall", "info"):
            total += int(fields.split(",")[0].removeprefix("calls="))
    return total


async def test_one_packet_calls_make_few_redis_calls(
    redis_url: str, redis_server: RedisServer
) -> None:
    """Issue 22: at one packet a call, each ``redis.call`` adds to Redis's cost of the call.
    Layouts 5 and 6 make six for a push (TIME, one HMGET and one HSET of the queue's hash,
    ZADD, EXISTS of the waiting mark, HLEN for the figures) and eight for a pop of a lone key
    whose previous result the front end confirms (EXISTS, ZRANGE, HMGET, HDEL, ZREM, HLEN,
    HSET and HDEL of the kept results; no PEXPIRE); layout 4 made nine and eleven. No
    background task runs: the store is driven directly."""
    async with redis_client("127.0.0.1", redis_server.port) as client:
        store = RedisStore(client, cluster=False)
        await store.load_scripts()
        await store.run([Push(b"q", b"k%d" % n, b"p", 0, 5) for n in range(3)])
        before = commands_run(redis_server)
        await store.run([Push(b"q", b"k3", b"p", 0, 5)])
        pushed = commands_run(redis_server)
        assert pushed - before == 6
        assert await store.run([Pop(b"q")]) == deque([[(b"k3", b"p")]])
        popped = commands_run(redis_server)
        assert await store.run([Pop(b"q")]) == deque([[(b"k2", b"p")]])
        assert commands_run(redis_server) - popped == 8
        assert await client.pttl(queue_keys(b"q").results) > 0  # the first pop's PEXPIRE


def command_calls(redis: RedisServer, command: str) -> int:
    """How many times Redis has run ``command`` (``INFO commandstats``)."""
    for line in redis.cli("INFO", "commandstats").splitlines():
        if line.startswith(f"cmdstat_{command}:"):
            return int(line.split(":")[1].split(",")[0].removeprefix("calls="))
    return 0


async def test_a_batch_counts_each_queue_it_pushes_to_once(
    redis_url: str, redis_server: RedisServer
) -> None:
    """Issue 22, per pipeline, not per call: of a batch's push calls only each queue's last
    counts the queue (``HLEN``) for the figures, which still come out right."""
    async with redis_client("127.0.0.1", redis_server.port) as client:
        store = RedisStore(client, cluster=False)
        await store.load_scripts()
        before = command_calls(redis_server, "hlen")
        await store.run(
            [
                Push(b"a", b"1", b"p", 0, 5),
                Push(b"b", b"2", b"p", 0, 5),
                Push(b"a", b"3", b"p", 0, 5),
            ]
        )
        assert command_calls(redis_server, "hlen") - before == 2  # a's second call, and b's
        assert {name: packets for name, packets, _ in store.sizes()} == {b"a": 2, b"b": 1}
