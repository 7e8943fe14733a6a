"""The Redis store's documented upgrade from key layout 5 (docs/redis.md): a real redis-server
holding the queues a layout 5 library (``tests/fixtures/redis_pinpriq_5.lua``, as main 18c7d37
loaded it) wrote, then ``FUNCTION DELETE pinpriq_5`` and a front end of this build's layout.

The queues are filled through layout 5's own functions, with the KEYS and ARGV its front end
sent (unchanged since: layout 6 changed what a pop returns, not what the calls send). Before the
upgrade, copies of the database are made: one is drained by layout 5 itself (the control), one
by this build's functions after the upgrade, one by this build's front end over TCP."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from pinpriq.leases import DEAD_SUFFIX
from pinpriq.redis import lua
from pinpriq.redis.keys import PREFIX, queue_keys
from pinpriq.redis.store import redis_client
from tests.rawpeer import pop
from tests.redis_servers import RedisServer, need_redis
from tests.test_redis_cli import run
from tests.test_redis_store import connect, front_end

LAYOUT_5 = (Path(__file__).parent / "fixtures" / "redis_pinpriq_5.lua").read_text()
QUEUE = b"jobs"
HOUR_MS = 3_600_000
#: A layout 5 front end's ARGV for the lease functions: max deliveries, then whether the
#: dead-letter queue's name fits.
MAX_DELIVERIES = 20
#: Databases: the one upgraded and served by a front end, the control drained by layout 5, the
#: one drained by this build's functions.
SERVED, CONTROL, UPGRADED = 0, 1, 2


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    need_redis()
    server = RedisServer(tmp_path, "--appendonly", "no").start()
    yield server
    server.stop()


@asynccontextmanager
async def database(redis: RedisServer, db: int) -> AsyncIterator[Any]:
    async with redis_client("127.0.0.1", redis.port, db) as client:
        yield client


def lease_keys(queue: bytes) -> list[bytes]:
    """The 15 KEYS of a lease function: the queue's, then its dead-letter queue's."""
    k, d = queue_keys(queue), queue_keys(queue + DEAD_SUFFIX)
    return [*k[:4], k.delayed, k.due, k.waiting, k.leases, k.lease_due, k.attempts, *d[:5]]


def lease_args(queue: bytes, *args: bytes | int | str) -> list[bytes | int | str]:
    """A lease function's ARGV: the channels, max deliveries, whether the dead-letter queue's
    name fits, then ``args``."""
    k, d = queue_keys(queue), queue_keys(queue + DEAD_SUFFIX)
    return [k.channel, d.channel, MAX_DELIVERIES, 1, *args]


async def fill_through_layout_5(client: Any) -> None:
    """Pushes with keys, TTLs (one about to pass), priorities (0 included) and key groups, two
    delayed pushes (one due soon), and three leases, all through layout 5's functions."""
    k = queue_keys(QUEUE)
    first = [
        (b"a", b"a1", 0, 2),
        (b"b", b"b1", HOUR_MS, 1),
        (b"a", b"a2", 0, 0),  # rides with a's group
        (b"c", b"c1", 200, 9),  # its TTL passes before any pop
        (b"d", b"d1", 0, 3),
        (b"a", b"a3", 2 * HOUR_MS, 5),
        (b"e", b"e1", 0, 2),
        (b"", b"no key", 0, 2),
        (b"f", b"f1", 0, 0),  # prio 0, alone: never selectable
        (b"l", b"l1", HOUR_MS, 1),
        (b"m", b"m1", 0, 1),
        (b"n", b"n1", 0, 1),
    ]
    second = [(b"b", b"b2", 0, 4), (b"g", b"g1", 0, 2), (b"e", b"e2", HOUR_MS, 0)]
    for batch in (first, second):
        args = [k.channel, 1, *(field for packet in batch for field in packet)]
        await client.fcall("pinpriq_5_push", keys=k[:5], args=args)
    for handle in (b"old:1", b"old:2", b"old:3"):  # leases of a layout 5 front end
        reserve = lease_args(QUEUE, 65535, handle, HOUR_MS)
        leased = await client.fcall("pinpriq_5_reserve", keys=lease_keys(QUEUE), args=reserve)
        assert leased, "layout 5 reserved nothing"
    # After the reserves, so that none takes h1 however long the calls before took.
    for delayed in [(b"h", b"h1", 60_000, 1, 300), (b"i", b"i1", 0, 1, HOUR_MS)]:
        keys = [k.data, k.delayed, k.due, k.waiting]
        await client.fcall("pinpriq_5_push_delayed", keys=keys, args=list(delayed))


async def copy_database(client: Any, to: int) -> None:
    async for key in client.scan_iter(match=PREFIX + b"*"):
        assert await client.copy(key, key, db=to)


async def end_leases(client: Any, library: str) -> list[list[Any]]:
    """Release the first lease, ack the second (the third stays held); their replies."""
    name = f"{library}_lease_op"
    return [
        await client.fcall(name, keys=lease_keys(QUEUE), args=lease_args(QUEUE, op, handle, 0))
        for op, handle in (("release", b"old:1"), ("ack", b"old:2"))
    ]


async def drain(client: Any, library: str) -> list[list[tuple[Any, ...]]]:
    """Pop ``QUEUE`` with ``library``'s pop function until it is empty: each pop's packets as
    (key, payload, prio, seq, TTL deadline), as a delivery's pop returns them."""
    k = queue_keys(QUEUE)
    keys = [*k[:4], k.results, k.delayed, k.due, k.waiting, k.leases]
    pops: list[list[tuple[Any, ...]]] = []
    for call in range(100):
        args = [65535, 1, 1, b"test:%d" % call, 0, 0]
        reply = await client.fcall(f"{library}_pop", keys=keys, args=args)
        # Layout 5 answers a table a pop; layout 6 each pop's item count, then its items.
        items = reply[0] if library == "pinpriq_5" else reply[1 : 1 + int(reply[0])]
        if not items:
            return pops
        pops.append([tuple(items[i : i + 5]) for i in range(0, len(items), 5)])
    raise AssertionError("the queue never emptied")


async def contents(client: Any) -> dict[bytes, Any]:
    """Every ``pq:`` key's value but the kept pop results (``:r``, whose form is the
    layout's reply), for comparing what two drains left."""
    held: dict[bytes, Any] = {}
    async for key in client.scan_iter(match=PREFIX + b"*"):
        if key.endswith(b":r"):
            continue
        kind = await client.type(key)
        if kind == b"hash":
            held[key] = await client.hgetall(key)
        elif kind == b"zset":
            held[key] = await client.zrange(key, 0, -1, withscores=True)
        elif kind == b"set":
            held[key] = await client.smembers(key)
        else:
            held[key] = await client.get(key)
    return held


async def test_the_documented_upgrade_from_layout_5_keeps_every_packet_in_order(
    redis: RedisServer,
) -> None:
    async with database(redis, SERVED) as served:
        await served.function_load(LAYOUT_5)
        await fill_through_layout_5(served)
        for db in (CONTROL, UPGRADED):
            await copy_database(served, db)
    await trio.sleep(0.5)  # h1 is due (300 ms) and c1's TTL (200 ms) has passed, everywhere
    async with database(redis, CONTROL) as control:
        ended = await end_leases(control, "pinpriq_5")
        expected = await drain(control, "pinpriq_5")
        left = await contents(control)
    # The control is what layout 5 itself gives: h1 due and popped, c1 expired, f1 and the
    # delayed i1 left, one lease still held.
    popped = [packet[1] for packets in expected for packet in packets]
    assert b"h1" in popped
    assert b"c1" not in popped
    assert b"f1" not in popped
    assert [int(reply[0]) for reply in ended] == [1, 1]  # both leases were live
    assert len(popped) == 12, popped  # of 17: c1 expired, m1 acked; f1, i1, leased l1 stay
    # The upgrade: stop the layout 5 front ends (none run here), delete their library.
    assert redis.cli("FUNCTION", "DELETE", "pinpriq_5") == "OK"
    async with front_end(redis.url) as (_, port):  # loads this build's library
        async with database(redis, UPGRADED) as upgraded:
            assert await end_leases(upgraded, lua.LIBRARY_NAME) == ended
            assert await drain(upgraded, lua.LIBRARY_NAME) == expected  # TTL deadlines too
            assert await contents(upgraded) == left  # i1 still delayed, old:3 still leased
        async with database(redis, SERVED) as served:
            await end_leases(served, lua.LIBRARY_NAME)
        peer = await connect(port)
        for packets in expected:
            keyed = [(key, payload) for key, payload, *_ in packets]
            assert await peer.request(pop(QUEUE)) == keyed
        assert await peer.request(pop(QUEUE)) == []


async def test_a_front_end_finding_layout_5_still_loaded_says_what_to_run_and_changes_nothing(
    redis: RedisServer,
) -> None:
    """The upgrade's step a user forgets: ``FUNCTION DELETE pinpriq_5``. The front end refuses
    to start, in one line naming the command, and leaves the queues and the library as they
    were."""
    async with database(redis, SERVED) as served:
        await served.function_load(LAYOUT_5)
        await fill_through_layout_5(served)
        before = await contents(served)
        done = await trio.to_thread.run_sync(lambda: run("--port", "0", "--store", redis.url))
        assert done.returncode == 1
        last = done.stderr.strip().splitlines()[-1]
        assert "FUNCTION DELETE pinpriq_5" in last, last
        assert "Traceback" not in done.stderr
        assert await contents(served) == before
        assert list(await served.function_list()) == [b"pinpriq_5"]
