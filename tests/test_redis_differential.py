"""A differential test: the same random conversation against the built-in store and the Redis
store gives the same bytes, reply for reply, on the pushing connection and on a subscriber's.

Pushes (prio 0..3, a few keys, so key groups and prio-0 riders form), pops, subscribes,
unsubscribes, credits, and packets that expire: pushed with a 5 ms TTL to a queue nobody
subscribes to, right before a 40 ms wait, so both stores have let them expire, whatever their
clocks. Each step is followed by a
sync on both connections, and everything read is compared."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio

from pinpriq.server import PinpriqServer
from tests.rawpeer import Peer, pop, push, subscribe, unsubscribe
from tests.test_redis_store import HOST, READY, SYNC, front_end

QUEUES = [b"a", b"b", b""]
SUBSCRIBED = QUEUES[:2]  # the subscriber's queues: b"" takes the packets that expire
KEYS = [b"k1", b"k2", b"k3", b"k4"]


def conversation(seed: int, steps: int = 120) -> list[tuple[str, bytes]]:
    """``(connection, bytes)`` steps; ``wait`` steps carry no bytes."""
    rng = random.Random(seed)
    out: list[tuple[str, bytes]] = []
    for _ in range(steps):
        roll = rng.random()
        queue = rng.choice(QUEUES)
        if roll < 0.45:
            ttl = rng.choice([0, 0, 60_000])
            out.append(
                ("main", push(queue, rng.choice(KEYS), b"%d" % len(out), ttl, rng.randrange(4)))
            )
        elif roll < 0.7:
            out.append(("main", pop(queue)))
        elif roll < 0.78:
            # To the one queue nobody subscribes to: a delivery within 5 ms is a race.
            out.append(("main", push(b"", rng.choice(KEYS), b"brief", 5, rng.randrange(1, 4))))
            out.append(("wait", b""))
        elif roll < 0.86:
            out.append(("sub", subscribe(rng.choice(SUBSCRIBED))))
        elif roll < 0.9:
            out.append(("sub", unsubscribe(rng.choice(SUBSCRIBED))))
        else:
            out.append(("sub", READY))
    return out


@asynccontextmanager
async def memory_server() -> AsyncIterator[tuple[PinpriqServer, int]]:
    server = PinpriqServer()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(server.serve, 0, host=HOST))
        yield server, listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()


async def transcript(port: int, steps: list[tuple[str, bytes]]) -> list[tuple[str, object]]:
    peers = {
        "main": Peer(await trio.open_tcp_stream(HOST, port)),
        "sub": Peer(await trio.open_tcp_stream(HOST, port)),
    }
    seen: list[tuple[str, object]] = []
    try:
        for name, data in steps:
            if name == "wait":
                await trio.sleep(0.04)
                continue
            await peers[name].send(data)
            if data[0] == 0x50:  # only "main" pops, and it never subscribes
                seen.append(("pop", await peers[name].reply()))  # may be empty
            for who, peer in peers.items():
                await peer.send(SYNC)
                while reply := await peer.reply():  # deliveries (never empty), then the sync
                    seen.append((who, reply))
        # Drain: pop every queue until empty, so what is left is compared too.
        for queue in QUEUES:
            while reply := await peers["main"].request(pop(queue)):
                seen.append(("left", reply))
    finally:
        for peer in peers.values():
            await peer.aclose()
    return seen


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_the_redis_store_answers_as_the_built_in_one(redis_url: str, seed: int) -> None:
    steps = conversation(seed)
    async with memory_server() as (_, port):
        expected = await transcript(port, steps)
    async with front_end(redis_url) as (_, port):
        got = await transcript(port, steps)
    assert got == expected
    # The conversation exercised what it is for: deliveries, and pops that found something.
    assert any(who == "sub" for who, _ in expected)
    assert any(who == "pop" and reply for who, reply in expected)
