"""Load shapes that a server meets in the wild, each against a live in-process server.

Each test puts one awkward client (or two thousand) beside well-behaved ones and checks that
the well-behaved ones get exact results and are not stalled, and that the awkward one is served
correctly in the end. ``trio.fail_after`` bounds are hang detectors, generous by orders of
magnitude; nothing here asserts how fast anything is.

The server under test in the buffer tests has small socket buffers (set on the listening socket,
which accepted sockets inherit), so that "more than the kernel can hold" is a few megabytes and
not the tens of megabytes loopback autotuning allows.
"""

from __future__ import annotations

import resource
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial

import pytest
import trio

from pinpriq.broker import OUTPUT_HIGH_WATER
from pinpriq.server import PinpriqServer
from tests.conftest import LiveServer
from tests.rawpeer import READY, Peer, pop, push, subscribe

#: Socket buffer size asked for on both ends of the buffer tests (Linux doubles it).
SMALL_BUFFER = 64 * 1024
#: The most bytes a small-buffered socket pair holds in flight: the kernel doubles the size
#: asked for, and there are two sockets (a sender's and a receiver's) on the path.
KERNEL_SLACK = 2 * 2 * 2 * SMALL_BUFFER


async def start_tight(nursery: trio.Nursery, server: PinpriqServer) -> LiveServer:
    """Serve ``server`` on a loopback port whose accepted sockets have small buffers."""
    listeners = await nursery.start(partial(server.serve, 0, host="127.0.0.1"))
    for listener in listeners:
        listener.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
        listener.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    return LiveServer(server, listeners[0].socket.getsockname()[1], nursery)


@pytest.fixture
async def tight(nursery: trio.Nursery) -> AsyncIterator[LiveServer]:
    """A live server whose accepted sockets have small send and receive buffers."""
    live = await start_tight(nursery, PinpriqServer())
    yield live
    for peer in live.peers:
        await trio.aclose_forcefully(peer.stream)


def shrink_buffers(peer: Peer) -> None:
    """Small client-side buffers too, so a client that stops reading fills them quickly."""
    peer.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
    peer.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)


async def round_trips(peer: Peer, queue: bytes, count: int | None, stop: trio.Event) -> int:
    """Exact push/pop round trips on a queue of the caller's own, ``count`` of them or until
    ``stop``; each must finish within a generous bound. Returns how many were done."""
    done = 0
    while (count is None or done < count) and not stop.is_set():
        with trio.fail_after(5):  # a loopback round trip takes well under a millisecond
            await peer.send(
                push(queue, b"old%d" % done, b"o" * (done % 500), prio=2)
                + push(queue, b"new%d" % done, b"n%d" % done, prio=1)
            )
            assert await peer.request(pop(queue)) == [(b"new%d" % done, b"n%d" % done)]
            assert await peer.request(pop(queue)) == [(b"old%d" % done, b"o" * (done % 500))]
        done += 1
    return done


async def run_workers(
    live: LiveServer, count: int, rounds: int | None, stop: trio.Event
) -> list[int]:
    """``count`` clients doing round trips concurrently; returns the rounds each did."""
    peers = [await live.connect() for _ in range(count)]
    done = [0] * count

    async def work(i: int) -> None:
        done[i] = await round_trips(peers[i], b"worker-%d" % i, rounds, stop)

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(work, i)
    for peer in peers:
        await peer.aclose()
    return done


async def wait_until(condition: Callable[[], bool], what: str, seconds: float = 10) -> None:
    """Poll ``condition`` (server state has no events to wait on); fail naming ``what``."""
    with trio.move_on_after(seconds):
        while not condition():  # noqa: ASYNC110
            await trio.sleep(0.01)
    assert condition(), f"gave up after {seconds} s waiting until {what}"


async def all_closed(live: LiveServer) -> None:
    for peer in live.peers:
        await peer.aclose()
    await wait_until(lambda: live.server.connections == 0, "the server has no connections")
    live.store.check_invariants()


# -- 2,000 idle connections -------------------------------------------------------------------

IDLE_CONNECTIONS = 2000
#: File descriptors the test needs: two per in-process connection, plus pytest's own and slack.
FDS_NEEDED = 2 * IDLE_CONNECTIONS + 256
IDLE_SUB_QUEUE = b"idle subscribers"


@pytest.fixture
def open_file_limit() -> Iterator[None]:
    """Raise the soft RLIMIT_NOFILE for the test (restored after), or skip if the hard limit
    cannot allow it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FDS_NEEDED:
        pytest.skip(
            f"{IDLE_CONNECTIONS} in-process connections need {FDS_NEEDED} file descriptors, "
            f"but the hard RLIMIT_NOFILE is {hard} (raise it with ulimit -Hn as root)"
        )
    if soft != resource.RLIM_INFINITY and soft < FDS_NEEDED:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FDS_NEEDED, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def open_idle_connections(live: LiveServer) -> tuple[list[Peer], list[Peer]]:
    """Open the idle connections, 100 at a time: a third silent, a third halfway through a push
    frame, a third subscribed with one credit. Returns (all of them, the subscribers)."""
    half_push = push(b"never completed", b"k", b"v" * 100)[:55]
    peers: list[Peer] = [None] * IDLE_CONNECTIONS  # type: ignore[list-item]

    async def open_one(i: int) -> None:
        peer = await live.connect()
        if i % 3 == 1:
            await peer.send(half_push)
        elif i % 3 == 2:
            await peer.send(subscribe(IDLE_SUB_QUEUE) + READY)
        peers[i] = peer

    for start in range(0, IDLE_CONNECTIONS, 100):
        async with trio.open_nursery() as nursery:
            for i in range(start, min(start + 100, IDLE_CONNECTIONS)):
                nursery.start_soon(open_one, i)
    return peers, peers[2::3]


async def test_two_thousand_idle_connections_beside_active_traffic(
    open_file_limit: None, live: LiveServer
) -> None:
    with trio.fail_after(60):
        _, subscribers = await open_idle_connections(live)
        await wait_until(
            lambda: (
                len(live.server.broker.subscriptions.waiting(IDLE_SUB_QUEUE)) == len(subscribers)
            ),
            "every idle subscriber is waiting",
        )
        # Connected is not yet accepted: the server may still be taking some from the backlog.
        await wait_until(
            lambda: live.server.connections == IDLE_CONNECTIONS, "every connection is served"
        )

        # Active clients, some connecting now, get exact results while the idle ones sit.
        done = await run_workers(live, 4, 200, trio.Event())
        assert done == [200] * 4
        assert len(live.store) == 0  # the half-sent pushes were not applied

        # The idle subscribers are still served: one packet each, every packet once. (Their
        # order of service is the order the server read their subscriptions in, unknown here.)
        pusher = await live.connect()
        keys = [b"%d" % i for i in range(len(subscribers))]
        await pusher.send(b"".join(push(IDLE_SUB_QUEUE, key, b"for an idle one") for key in keys))
        received = []
        for sub in subscribers:
            [(key, payload)] = await sub.reply()
            assert payload == b"for an idle one"
            received.append(key)
        assert sorted(received) == sorted(keys)

        await all_closed(live)
        assert live.server.broker.subscriptions.waiting(IDLE_SUB_QUEUE) == []


# -- a subscriber that never reads ------------------------------------------------------------

BIG_PAYLOAD = b"x" * 60_000
STUCK_CREDITS = 100


async def test_subscriber_that_never_reads_stalls_no_one(tight: LiveServer) -> None:
    stuck, healthy = await tight.connect(), await tight.connect()
    shrink_buffers(stuck)
    await stuck.send(subscribe(b"q") + READY * STUCK_CREDITS)
    await wait_until(
        lambda: len(tight.server.broker.subscriptions.waiting(b"q")) == 1, "stuck waits"
    )
    # The stuck subscriber is served first come, first served until its unsent output passes
    # the server's bound; then it receives nothing more and the healthy one takes the rest.
    pushes = 3 * STUCK_CREDITS
    await healthy.send(subscribe(b"q") + READY * pushes)
    owed_to_stuck = STUCK_CREDITS * (len(BIG_PAYLOAD) + 10)
    assert owed_to_stuck > 4 * KERNEL_SLACK, "the test must overflow the socket buffers"

    healthy_keys: list[bytes] = []
    healthy_total: list[int] = []  # known once every push is delivered

    async def read_healthy() -> None:
        while not healthy_total or len(healthy_keys) < healthy_total[0]:
            [(key, payload)] = await healthy.reply()
            assert payload == BIG_PAYLOAD
            healthy_keys.append(key)

    async def push_all(pusher: Peer, keys: range) -> None:
        for i in keys:
            await pusher.send(push(b"q", b"%d" % i, BIG_PAYLOAD))
        assert await pusher.request(pop(b"nothing here")) == []  # the pusher is not stalled

    with trio.fail_after(30):
        pushers = [await tight.connect() for _ in range(2)]
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_healthy)
            nursery.start_soon(round_trips_until, tight, stop)
            async with trio.open_nursery() as pushing:
                pushing.start_soon(push_all, pushers[0], range(0, pushes, 2))
                pushing.start_soon(push_all, pushers[1], range(1, pushes, 2))
            stop.set()
            # Every push is taken, most by the healthy subscriber; the stuck one's spent credits
            # (white-box) say how many went to it.
            await wait_until(lambda: len(tight.store) == 0, "every push is delivered")
            stuck_peer = f"127.0.0.1:{stuck.local_port}"
            [conn] = [c for c in tight.server._connections.values() if c.peer == stuck_peer]
            healthy_total.append(pushes - (STUCK_CREDITS - conn.session.credits))
            await wait_until(lambda: len(healthy_keys) == healthy_total[0], "healthy reads all")
            nursery.cancel_scope.cancel()  # the reader is done, or idle between replies
        assert await round_trips(await tight.connect(), b"after", 10, trio.Event()) == 10

        # The stuck subscriber, reading at last, finds its deliveries whole and in order.
        stuck_keys = []
        while len(stuck_keys) + len(healthy_keys) < pushes:
            [(key, payload)] = await stuck.reply()
            assert payload == BIG_PAYLOAD
            stuck_keys.append(key)
        await stuck.expect_silence()
    assert 0 < len(stuck_keys) < STUCK_CREDITS  # bounded by the output bound, not its credits
    assert sorted(stuck_keys + healthy_keys) == sorted(b"%d" % i for i in range(pushes))
    await all_closed(tight)


async def round_trips_until(live: LiveServer, stop: trio.Event) -> None:
    """Two clients doing round trips until ``stop``; each must have done some."""
    done = await run_workers(live, 2, None, stop)
    assert min(done) > 0, f"round trips per worker: {done}"


async def test_a_subscriber_that_never_reads_cannot_bypass_the_memory_cap(
    nursery: trio.Nursery,
) -> None:
    cap = 4 * 1024 * 1024
    live = await start_tight(nursery, PinpriqServer(max_memory=cap))
    try:
        await fill_past_the_cap(live, cap)
    finally:
        for peer in live.peers:
            await trio.aclose_forcefully(peer.stream)


async def fill_past_the_cap(live: LiveServer, cap: int) -> None:
    stuck, pusher = await live.connect(), await live.connect()
    shrink_buffers(stuck)
    await stuck.send(subscribe(b"q") + READY * 1000)  # 1 kB of credits
    await wait_until(
        lambda: len(live.server.broker.subscriptions.waiting(b"q")) == 1, "stuck waits"
    )
    pushes = 300  # 18 MB: four times the cap, beyond what the kernel buffers hold
    assert pushes * len(BIG_PAYLOAD) > 2 * (cap + OUTPUT_HIGH_WATER) + KERNEL_SLACK

    # Whether the server keeps the packets queued (the cap makes the pusher wait) or counts
    # the stuck connection's output against the cap, the pusher must be held back.
    with trio.move_on_after(2) as waited:
        for i in range(pushes):
            await pusher.send(push(b"q", b"%d" % i, BIG_PAYLOAD))
        await pusher.request(pop(b"nothing"))
    held = pushes - len(live.store)  # packets handed to the stuck subscriber's buffers
    assert waited.cancelled_caught, (
        f"the server took {pushes * len(BIG_PAYLOAD):,} bytes under a {cap:,}-byte cap, "
        f"{held} packets of them for a subscriber that reads nothing"
    )


# -- one byte every 100 ms --------------------------------------------------------------------

DRIBBLE_INTERVAL = 0.1


async def test_one_byte_every_100ms_stalls_no_one(hardened: LiveServer) -> None:
    live = hardened  # plain, and with a token and TLS
    dribbler, watcher = await live.connect(), await live.connect()
    frame = push(b"d", b"k", b"dribbled", ttl_ms=60_000, prio=7)
    assert len(frame) == 20  # two seconds at one byte per 100 ms

    async def dribble(stop: trio.Event) -> None:
        for i, byte in enumerate(frame):
            await dribbler.send(bytes([byte]))
            await trio.sleep(DRIBBLE_INTERVAL)
            if i < len(frame) - 1:
                # Not applied until its last byte arrives.
                assert await watcher.request(pop(b"d")) == []
        stop.set()

    with trio.fail_after(30):
        stop = trio.Event()
        done: list[int] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dribble, stop)
            done = await run_workers(live, 2, None, stop)
        # Round trips went on throughout the two seconds: a server that waited for the whole
        # frame would let through about one per dribbled byte, or none.
        assert min(done) >= len(frame), f"round trips per worker: {done}"
        assert await watcher.request(pop(b"d")) == [(b"k", b"dribbled")]
    await all_closed(live)


# -- pops pipelined without reading the replies -----------------------------------------------


async def test_unread_pipelined_pops_make_the_server_stop_reading(tight: LiveServer) -> None:
    greedy = await tight.connect()
    shrink_buffers(greedy)
    # What the server may read from a client that reads nothing: its output bound, one more
    # reply, one read, and the bytes in flight in the kernel.
    readable = OUTPUT_HIGH_WATER + len(BIG_PAYLOAD) + 65536 + KERNEL_SLACK
    pairs = 3 * readable // len(BIG_PAYLOAD)
    sent = [0]

    async def send_pairs() -> None:
        for i in range(pairs):
            await greedy.send(push(b"g", b"%d" % i, BIG_PAYLOAD) + pop(b"g"))
            sent[0] += 1

    async def sender_stalls(done: trio.Event) -> None:
        """Return once the sender has finished or made no progress for a second."""
        while not done.is_set():
            before = sent[0]
            with trio.move_on_after(1):
                await done.wait()
            if sent[0] == before:
                return

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            finished = trio.Event()

            async def sender() -> None:
                await send_pairs()
                finished.set()

            nursery.start_soon(sender)
            await sender_stalls(finished)
            assert not finished.is_set(), (
                f"the server read all {pairs * len(BIG_PAYLOAD)} bytes from a client that reads "
                f"no replies (it should stop after about {readable})"
            )
            assert sent[0] * len(BIG_PAYLOAD) < 2 * readable
            assert len(tight.store) <= 1
            # Everyone else carries on meanwhile.
            assert await run_workers(tight, 2, 50, trio.Event()) == [50, 50]

            # Reading at last, the greedy client gets every reply, in order.
            for i in range(pairs):
                assert await greedy.reply() == [(b"%d" % i, BIG_PAYLOAD)]
    await all_closed(tight)
