"""The Redis store against a real redis-server: the wire fixtures, two front ends sharing
queues, the checks at start, and a differential test against the built-in store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import trio

from pinpriq.conformance import DEFAULT_FIXTURES, Requires, load_fixtures, run_suite
from pinpriq.redis.connect import open_store, parse_store
from pinpriq.server import PinpriqServer

FIXTURES = load_fixtures(DEFAULT_FIXTURES)
HOST = "127.0.0.1"


@asynccontextmanager
async def front_end(url: str, **options: object) -> AsyncIterator[tuple[PinpriqServer, int]]:
    """A pinpriq server on the Redis store at ``url``, listening on an ephemeral port."""
    async with open_store(parse_store(url)) as (store, deliveries):
        server = PinpriqServer(store, deliveries=deliveries, max_memory=0, **options)  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(server.serve, 0, host=HOST))
            yield server, listeners[0].socket.getsockname()[1]
            nursery.cancel_scope.cancel()


async def test_every_fixture_passes_on_the_redis_store(redis_url: str) -> None:
    async with front_end(redis_url) as (_, port):
        results = await run_suite(FIXTURES, HOST, port)
    failed = [r.line() for r in results if not r.passed]
    assert failed == []
    assert {r.name for r in results if r.skipped} == {
        f.name for f in FIXTURES if f.requires is Requires.TOKEN
    }
