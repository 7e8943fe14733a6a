"""``pinpriq/redis/direct.py``'s shared connection: the pipelines of every task ready in one
event-loop turn go to Redis in one write, each caller gets its own replies, and a broken socket
fails exactly the callers in flight (against a real redis-server)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from coredis.exceptions import ConnectionError as RedisConnectionError

from pinpriq.redis import direct
from pinpriq.redis.direct import DirectConnection
from tests.redis_servers import RedisServer


@asynccontextmanager
async def connection(redis_server: RedisServer) -> AsyncIterator[DirectConnection]:
    options: dict[str, Any] = {
        "tls": False, "db": 0, "username": None, "password": None, "connect_timeout": 5.0,
    }  # fmt: skip
    shared = DirectConnection("127.0.0.1", redis_server.port, **options)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(shared.run)
        try:
            yield shared
        finally:
            nursery.cancel_scope.cancel()
            shared.close()


def count_writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every write to Redis, in order."""
    writes: list[bytes] = []
    write = direct._Link.write

    async def counted(link: direct._Link, data: bytes) -> None:
        writes.append(data)
        await write(link, data)

    monkeypatch.setattr(direct._Link, "write", counted)
    return writes


async def test_the_pipelines_of_tasks_ready_in_one_turn_go_in_one_write(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    replies: dict[int, list[Any]] = {}

    async def caller(n: int, shared: DirectConnection) -> None:
        replies[n] = await shared.pipeline([(b"ECHO", b"%d-%d" % (n, i)) for i in range(3)])

    with trio.fail_after(10):
        async with connection(redis_server) as shared:
            await shared.pipeline([(b"PING",)])  # connected
            writes = count_writes(monkeypatch)
            async with trio.open_nursery() as nursery:
                for n in range(8):  # all ready in this turn: they queue before the sender runs
                    nursery.start_soon(caller, n, shared)
    assert len(writes) == 1  # one write for the eight; each task once wrote its own
    assert writes[0].count(b"ECHO") == 24
    assert replies == {n: [b"%d-%d" % (n, i) for i in range(3)] for n in range(8)}


async def test_a_caller_cancelled_in_flight_leaves_the_others_their_own_replies(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(10):
        async with connection(redis_server) as shared:
            with trio.move_on_after(0.05):  # its reply comes after it stopped waiting
                await shared.pipeline([(b"DEBUG", b"SLEEP", b"0.3"), (b"ECHO", b"lost")])
            assert await shared.pipeline([(b"ECHO", b"mine")]) == [b"mine"]


async def test_a_broken_socket_fails_the_callers_in_flight_and_the_next_call_reconnects(
    redis_server: RedisServer,
) -> None:
    outcomes: list[Any] = []

    async def call(shared: DirectConnection, command: tuple[bytes, ...]) -> None:
        try:
            outcomes.append(await shared.pipeline([command]))
        except RedisConnectionError as error:
            outcomes.append(error)

    def cli(*args: str) -> Any:
        return trio.to_thread.run_sync(lambda: redis_server.cli(*args))

    with trio.fail_after(10):
        async with connection(redis_server) as shared:
            async with trio.open_nursery() as nursery:
                # Redis reads nothing more from a socket blocked in BLPOP: the echo waits behind.
                nursery.start_soon(call, shared, (b"BLPOP", b"never-pushed", b"0"))
                while True:  # Redis is the one who can tell when the BLPOP holds the socket
                    if "cmd=blpop" in await cli("CLIENT", "LIST"):
                        break
                    await trio.sleep(0.01)
                nursery.start_soon(call, shared, (b"ECHO", b"behind it"))  # queued or sent
                await cli("CLIENT", "KILL", "TYPE", "normal")
            assert len(outcomes) == 2
            assert all(isinstance(outcome, RedisConnectionError) for outcome in outcomes), outcomes
            assert await shared.pipeline([(b"ECHO", b"again")]) == [b"again"]


async def test_a_socket_closed_under_the_sender_fails_its_callers_not_the_front_end(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(10):
        async with connection(redis_server) as shared:
            for _ in range(20):  # the sender or the reader meets the closed socket first
                assert await shared.pipeline([(b"PING",)]) == [b"PONG"]
                shared._link.close()  # as the reader does when Redis goes away
                with pytest.raises(RedisConnectionError):
                    await shared.pipeline([(b"PING",)])
