"""Many hostile connections against a live server: random bytes, cut frames, abrupt resets.

The decoder's own fuzzing is in test_wire.py; this file checks what only a running server can
get wrong: per-connection state (reader, writer, subscriber, decoder) that must be torn down
however a connection ends, and other clients that must not notice. Each run is seeded; a failure
names its seed, and ``PINPRIQ_FUZZ_SEED=N`` replays that one seed alone.

Random bytes can form valid frames, including pushes that add packets and subscriptions with
credits, so the well-behaved clients use queue names that random data cannot realistically
produce, and the leftovers check decodes every chaos stream itself to know which queues it could
have subscribed to.

Each seed runs twice: against a plain server, and against one with a token and TLS on, where the
chaos clients speak TLS but present no token. There none of them gets in: nothing they send is
applied, and the well-behaved (authenticated) clients carry on as before.
"""

from __future__ import annotations

import enum
import logging
import os
import random
import socket
import ssl
import struct

import pytest
import trio

from pinpriq.wire import FrameDecoder, ProtocolError, Subscribe
from tests.conftest import LiveServer
from tests.rawpeer import READY, Peer, pop, push, subscribe, unsubscribe

#: Chaos connections per seed, all open at once at some point (they start within 0.3 s).
CHAOS_CONNECTIONS = 100
#: Queue names the chaos clients use on purpose (random bytes add others).
CHAOS_QUEUES = [b"", b"q", b"fuzz", b"\x00\xff", b"x" * 300]
#: The well-behaved clients' queues: 32 fixed bytes that random data will not spell out.
GOOD_QUEUE = b"\xffwell-behaved pushes and pops\xff\x00"
GOOD_SUB_QUEUE = b"\xffwell-behaved subscription \xff\x00"
#: Hang detector for one seed; a run takes about a second.
SEED_SECONDS = 20
SEEDS = [int(os.environ["PINPRIQ_FUZZ_SEED"])] if "PINPRIQ_FUZZ_SEED" in os.environ else [1, 2, 3]


class Ending(enum.Enum):
    CLOSE = "close"  # an orderly close, possibly mid-frame
    RESET = "reset"  # SO_LINGER 0: the kernel sends RST, unread data is thrown away
    HALF_CLOSE = "half-close"  # send EOF, then read until the server closes


def random_frame(rng: random.Random) -> bytes:
    queue = rng.choice(CHAOS_QUEUES)
    kind = rng.choices(["push", "pop", "sub", "unsub", "ready"], weights=[6, 4, 2, 1, 3])[0]
    if kind == "push":
        key = rng.choice([b"", b"k", b"key%d" % rng.randrange(5)])
        payload = rng.randbytes(rng.choice([0, 1, 10, 300, 5000]))
        ttl = rng.choice([0, 0, 1, 50, 65535])
        return push(queue, key, payload, ttl_ms=ttl, prio=rng.choice([0, 1, 2, 255]))
    if kind == "pop":
        return pop(queue)
    if kind == "sub":
        return subscribe(queue)
    if kind == "unsub":
        return unsubscribe(queue)
    return READY * rng.randint(1, 5)


def garbage(rng: random.Random) -> bytes:
    """Bytes that are rarely a valid stream: uniform noise, or valid opcodes with noise after
    them, so that length fields get random (often huge) values."""
    if rng.random() < 0.5:
        return rng.randbytes(rng.randint(1, 40))
    opcode = rng.choice([0x70, 0x50, 0x73, 0x75, 0x41])
    return bytes([opcode]) + rng.randbytes(rng.randint(0, 12))


def chaos_stream(rng: random.Random) -> bytes:
    """Valid frames mixed with frames cut short (which misframe what follows) and garbage."""
    parts = []
    for _ in range(rng.randint(1, 30)):
        roll = rng.random()
        if roll < 0.75:
            parts.append(random_frame(rng))
        elif roll < 0.88:
            frame = random_frame(rng)
            parts.append(frame[: rng.randrange(len(frame))])
        else:
            parts.append(garbage(rng))
    return b"".join(parts)


def subscribed_queues(stream: bytes) -> set[bytes]:
    """Every queue the server could have subscribed this stream to: it decodes the same bytes
    with the same frame boundaries, up to the first bad opcode."""
    decoder = FrameDecoder()
    decoder.feed(stream)
    queues = set()
    try:
        for frame in decoder:
            if isinstance(frame, Subscribe):
                queues.add(frame.queue)
    except ProtocolError:
        pass
    return queues


def reset(stream: trio.SocketStream) -> None:
    """Make the coming close an abortive one (RST instead of FIN)."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def read_all(stream: trio.abc.Stream, done: trio.Event | None = None) -> None:
    try:
        while await stream.receive_some(65536):
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    if done is not None:
        done.set()


async def chaos_client(
    port: int, rng: random.Random, stream_bytes: bytes, tls: ssl.SSLContext | None = None
) -> None:
    """Send a prefix of ``stream_bytes`` in random chunks and end the connection one way or
    another. Reads replies concurrently, or never. With ``tls``, over TLS (which has no
    half-close: that ending is a plain close there)."""
    await trio.sleep(rng.uniform(0, 0.3))  # staggered, so connections overlap in many ways
    cut = rng.choice([len(stream_bytes), rng.randint(0, len(stream_bytes))])
    ending = rng.choice(list(Ending))
    reads = rng.random() < 0.6
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream: trio.abc.Stream = tcp
    if tls is not None:
        stream = trio.SSLStream(tcp, tls, server_hostname="127.0.0.1")
    server_closed = trio.Event()
    async with tcp, trio.open_nursery() as nursery:
        if reads:
            nursery.start_soon(read_all, stream, server_closed)
        try:
            pos = 0
            while pos < cut:
                size = rng.choice([1, 2, 7, 100, 4096])
                await stream.send_all(stream_bytes[pos : min(cut, pos + size)])
                pos += size
                await trio.sleep(rng.choice([0, 0, 0, 0.001, 0.01]))
            if ending is Ending.HALF_CLOSE and tls is None:
                await tcp.send_eof()
                if not reads:
                    nursery.start_soon(read_all, stream, server_closed)
                await server_closed.wait()
        except (trio.BrokenResourceError, trio.BusyResourceError):
            pass  # the server closed on garbage, or we reset
        if ending is Ending.RESET:
            reset(tcp)
        nursery.cancel_scope.cancel()


async def good_pusher_popper(peer: Peer, rounds_done: list[int], stop: trio.Event) -> None:
    """Exact push/pop round trips on a queue of its own until told to stop."""
    while not stop.is_set():
        i = rounds_done[0]
        await peer.send(
            push(GOOD_QUEUE, b"low%d" % i, b"L", prio=9)
            + push(GOOD_QUEUE, b"grp%d" % i, b"g0", prio=0)
            + push(GOOD_QUEUE, b"grp%d" % i, b"g1", prio=3)
            + push(GOOD_QUEUE, b"top%d" % i, b"T" * (i % 3000), prio=1, ttl_ms=60_000)
        )
        assert await peer.request(pop(GOOD_QUEUE)) == [(b"top%d" % i, b"T" * (i % 3000))]
        assert await peer.request(pop(GOOD_QUEUE)) == [(b"grp%d" % i, b"g1"), (b"grp%d" % i, b"g0")]
        assert await peer.request(pop(GOOD_QUEUE)) == [(b"low%d" % i, b"L")]
        assert await peer.request(pop(GOOD_QUEUE)) == []
        rounds_done[0] += 1


async def good_subscription(
    sub: Peer, pusher: Peer, rounds_done: list[int], stop: trio.Event
) -> None:
    """A subscriber granted one credit at a time receives exactly what is pushed for it."""
    await sub.send(subscribe(GOOD_SUB_QUEUE))
    while not stop.is_set():
        i = rounds_done[1]
        await pusher.send(push(GOOD_SUB_QUEUE, b"s%d" % i, b"payload %d" % i))
        await sub.send(READY)
        assert await sub.reply() == [(b"s%d" % i, b"payload %d" % i)]
        rounds_done[1] += 1


async def wait_for_connections(live: LiveServer, count: int, seconds: float = 5) -> None:
    """Wait until the server serves ``count`` connections; fail naming the count if it does
    not within ``seconds`` (a generous bound: it takes milliseconds)."""
    # Polled: the server has no event for its connection count, and a closed socket reaches
    # its reader through the kernel, so waiting for idle tasks would not be enough.
    with trio.move_on_after(seconds):
        while live.server.connections != count:  # noqa: ASYNC110
            await trio.sleep(0.01)
    assert live.server.connections == count, (
        f"the server still serves {live.server.connections} connections, expected {count}"
    )


@pytest.mark.parametrize("seed", SEEDS)
async def test_hostile_connections_leave_nothing_behind(
    hardened: LiveServer, seed: int, caplog: pytest.LogCaptureFixture
) -> None:
    live = hardened
    secure = live.server.token is not None
    caplog.set_level(logging.WARNING, logger="pinpriq.server")
    rng = random.Random(seed)
    streams = [chaos_stream(rng) for _ in range(CHAOS_CONNECTIONS)]
    client_rngs = [random.Random(rng.getrandbits(64)) for _ in streams]
    good, sub, sub_pusher = await live.connect(), await live.connect(), await live.connect()
    rounds_done = [0, 0]
    stop = trio.Event()
    with trio.fail_after(SEED_SECONDS):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(good_pusher_popper, good, rounds_done, stop)
            nursery.start_soon(good_subscription, sub, sub_pusher, rounds_done, stop)
            async with trio.open_nursery() as chaos:
                for client_rng, stream_bytes in zip(client_rngs, streams, strict=True):
                    chaos.start_soon(
                        chaos_client, live.port, client_rng, stream_bytes, live.client_tls
                    )
            stop.set()
        # The good clients kept working throughout, and the chaos reached the parser.
        assert min(rounds_done) > 0, f"seed {seed}: good clients made no progress"
        closed_on_garbage = sum("unknown opcode" in r.getMessage() for r in caplog.records)
        refused = sum("before auth" in r.getMessage() for r in caplog.records)
        if secure:  # none got in, so none reached the parser beyond its first byte
            assert closed_on_garbage == 0, f"seed {seed}: an unauthenticated client got in"
            assert refused > 0, f"seed {seed}: no connection was refused for lack of auth"
        else:
            assert closed_on_garbage > 0, f"seed {seed}: no connection was closed for bad bytes"
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, f"seed {seed}: the server logged errors: {errors}"
        print(f"seed {seed}: {closed_on_garbage} closed on garbage; good rounds {rounds_done}")

        # The server is done with every chaos connection, and forgot it.
        await wait_for_connections(live, 3)
        if secure:  # nothing a chaos client sent was applied
            assert len(live.store) == 0
        queues = set().union(*map(subscribed_queues, streams))
        waiting = {
            q[:40]: len(waiters)
            for q in queues | {GOOD_SUB_QUEUE}
            if (waiters := live.server.broker.subscriptions.waiting(q))
        }
        assert not waiting, f"seed {seed}: subscribers left waiting on queues: {waiting}"
        live.store.check_invariants()

        # And still serves a well-behaved client exactly.
        await good.send(push(GOOD_QUEUE, b"a", b"1", prio=2) + push(GOOD_QUEUE, b"b", b"2"))
        assert await good.request(pop(GOOD_QUEUE)) == [(b"b", b"2")]
        assert await good.request(pop(GOOD_QUEUE)) == [(b"a", b"1")]
        await sub.send(READY)
        await sub_pusher.send(push(GOOD_SUB_QUEUE, b"last", b"delivery"))
        assert await sub.reply() == [(b"last", b"delivery")]

        for peer in (good, sub, sub_pusher):
            await peer.aclose()
        await wait_for_connections(live, 0)
        assert live.server.broker.subscriptions.waiting(GOOD_SUB_QUEUE) == []
        live.store.check_invariants()
