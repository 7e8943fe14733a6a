"""``pinpriq-server --store`` as a user runs it, and what the admin listener says about a Redis
store: bad values and unusable Redis servers are one line and a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from pinpriq.admin.app import AdminApp
from pinpriq.admin.http import Request
from pinpriq.admin.stats import Sampler, queue_stats, server_stats
from pinpriq.redis import lua
from pinpriq.redis.spec import StoreError, parse_store
from pinpriq.redis.store import RedisStore
from pinpriq.wire import DelayedPush, encode
from tests.rawpeer import pop, push
from tests.redis_servers import RedisServer, free_port, need_redis
from tests.test_redis_store import SYNC, connect, front_end

SERVER = [sys.executable, "-m", "pinpriq.cli.server", "--http-port", "off"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SERVER, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("bogus://x", "expected memory, redis://"),
        ("redis://host:notaport/0", "is not HOST:PORT"),
        ("redis://a:1,b:2/0", "takes one HOST:PORT"),
        ("redis://127.0.0.1:6379/x", "database must be a number"),
        ("redis-cluster://127.0.0.1:7000/1", "no database number"),
    ],
)
def test_a_bad_store_is_one_line_and_non_zero(text: str, fragment: str) -> None:
    done = run("--store", text)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert fragment in lines[0]


def test_store_urls_parse() -> None:
    spec = parse_store("redis://:s3cret@127.0.0.1:6380/2")
    assert (spec.scheme, spec.nodes, spec.db, spec.password) == (
        "redis",
        (("127.0.0.1", 6380),),
        2,
        "s3cret",
    )
    assert "s3cret" not in spec.text
    cluster = parse_store("redis-cluster://10.0.0.1:7000,10.0.0.2:7001")
    assert cluster.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    assert parse_store("memory").scheme == "memory"
    with pytest.raises(StoreError):
        parse_store("memcached://x")


def test_an_unreachable_redis_is_one_line_and_non_zero() -> None:
    done = run("--port", "0", "--store", f"redis://127.0.0.1:{free_port()}/0")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("pinpriq-server: cannot use Redis at redis://127.0.0.1:"), done.stderr
    assert "Traceback" not in done.stderr


def test_a_redis_that_may_evict_is_refused(tmp_path: Path) -> None:
    need_redis()
    redis = RedisServer(tmp_path, "--maxmemory-policy", "allkeys-lru").start()
    try:
        done = run("--port", "0", "--store", redis.url)
    finally:
        redis.stop()
    assert done.returncode == 1
    assert "maxmemory-policy allkeys-lru" in done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr


def test_a_redis_holding_another_layouts_functions_is_refused(tmp_path: Path) -> None:
    """Front ends of two key layouts would misread each other's queues: the second refuses."""
    need_redis()
    redis = RedisServer(tmp_path).start()
    try:
        redis.cli(
            "FUNCTION",
            "LOAD",
            "#!lua name=pinpriq_1\nredis.register_function('pinpriq_1_x', function() end)",
        )
        done = run("--port", "0", "--store", redis.url)
    finally:
        redis.stop()
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert f"another pinpriq key layout (pinpriq_1; this build uses {lua.LIBRARY_NAME})" in last
    assert "Traceback" not in done.stderr


def test_a_redis_holding_queues_of_an_older_layout_is_refused(tmp_path: Path) -> None:
    """Layout 5 would misread a queue that a front end of layout 4 or older left (its
    sequence number in a ``:q`` string): refused, even once that build's library is gone."""
    need_redis()
    redis = RedisServer(tmp_path).start()
    try:
        redis.cli("SET", "pq:{qjobs}jobs:q", "1764000000000000")
        done = run("--port", "0", "--store", redis.url)
    finally:
        redis.stop()
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "holds queues of an older pinpriq key layout (pq:{qjobs}jobs:q" in last
    assert "Traceback" not in done.stderr


async def test_the_admin_listener_reads_and_purges_a_redis_store(redis_url: str) -> None:
    async with front_end(redis_url) as (server, port):
        pusher = await connect(port)
        await pusher.send(push(b"q", b"k", b"old", prio=2) + push(b"q", b"k", b"rider", prio=0))
        await pusher.send(push(b"q", b"n", b"new", prio=2) + SYNC)
        assert await pusher.reply() == []
        sampler = Sampler(server.broker, trio.current_time)
        stats = server_stats(server.broker, sampler, connections=0, ready=True)
        assert stats["store"]["kind"] == "redis"
        assert stats["store"]["not_given"]  # says which figures it cannot give
        assert "leases" in stats["store"]["per_front_end"]  # and which count this front end
        app = AdminApp(server, sampler)

        async def ask(method: str, path: bytes) -> Any:
            response = app.handle(Request(method, path, {b"x-pinpriq-action": b"1"}, b""))
            assert response.later is not None  # answered after a wait on Redis
            answered = await response.later()
            assert answered.status == 200, answered.body
            return json.loads(answered.body)

        peeked = await ask("GET", b"/queues/q/peek?n=3")
        assert [p["payload"] for p in peeked["packets"]] == ["new", "old", "rider"]
        # Protocol 1.2: a delayed packet is listed and counted, not moved; a move answers how
        # many moved (decision 22); a purge removes delayed packets too.
        await pusher.send(encode(DelayedPush(b"q", b"d", b"later", 0, 1, 60_000)) + SYNC)
        assert await pusher.reply() == []
        assert queue_stats(server.broker, b"q", sampler)["delayed"] == 1
        moved = await ask("POST", b"/queues/q/move?to=q2&n=1")
        assert moved == {"queue": "q", "to": "q2", "moved": 1}  # new: its group is one packet
        assert await pusher.request(pop(b"q2")) == [(b"n", b"new")]
        assert (await ask("POST", b"/queues/q/purge"))["purged"] == 3
        assert await pusher.request(pop(b"q")) == []


# -- figures that are right (issue 22) --------------------------------------------------------


async def test_queue_figures_follow_this_front_ends_pushes_pops_and_purges(
    redis_url: str,
) -> None:
    """Seen by a new user: ``pinpriq queues`` right after a push listed nothing, and ``pinpriq
    stats QUEUE`` still showed the packets after a purge, until the next scan (5 s)."""
    async with front_end(redis_url) as (server, port):
        store = server.batched
        assert isinstance(store, RedisStore)
        await store.refresh_snapshot()  # the scan: the next one is 5 s away
        peer = await connect(port)
        pushes = push(b"q", b"a", b"1") + push(b"q", b"b", b"2") + push(b"q", b"c", b"3")
        assert await peer.request(pushes + SYNC) == []
        assert [(q["name"], q["packets"]) for q in stats_of(server)["queues"]] == [("q", 3)]
        assert await peer.request(pop(b"q")) == [(b"c", b"3")]
        sampler = Sampler(server.broker, trio.current_time)
        assert queue_stats(server.broker, b"q", sampler)["packets"] == 2
        assert await store.purge_async(b"q") == 2
        assert queue_stats(server.broker, b"q", sampler)["packets"] == 0
        assert stats_of(server)["queues_total"] == 0


def stats_of(server: Any) -> dict[str, Any]:
    sampler = Sampler(server.broker, trio.current_time)
    return server_stats(server.broker, sampler, connections=0, ready=True)


async def test_the_memory_line_reads_redis_maxmemory(tmp_path: Path) -> None:
    """It said "0 B of no cap" on a Redis with maxmemory 4gb."""
    need_redis()
    redis = RedisServer(tmp_path, "--maxmemory", "4gb").start()
    try:
        async with front_end(redis.url) as (server, _):
            assert isinstance(server.batched, RedisStore)
            await server.batched.refresh_snapshot()
            memory = stats_of(server)["memory"]
    finally:
        redis.stop()
    assert memory["cap_bytes"] == 4 * 1024**3
    assert 0 < memory["held_bytes"] < memory["cap_bytes"]  # Redis's used_memory: a few MB


async def test_the_replication_warning_needs_a_replica(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It warned "Redis replicates asynchronously" on a Redis with no replica."""
    need_redis()
    primary = RedisServer(tmp_path / "primary").start()
    replica: RedisServer | None = None
    try:
        async with front_end(primary.url):
            pass
        assert "replicates asynchronously" not in caplog.text
        replica = RedisServer(
            tmp_path / "replica", "--replicaof", "127.0.0.1", str(primary.port)
        ).start()
        for _ in range(400):  # the replica's first sync: at most 20 s
            if "connected_slaves:1" in primary.cli("INFO", "replication"):
                break
            await trio.sleep(0.05)
        else:
            pytest.fail("the replica never connected")
        async with front_end(primary.url):
            pass
        assert "Redis replicates asynchronously (1 replicas now)" in caplog.text
    finally:
        if replica is not None:
            replica.stop()
        primary.stop()
