"""The reactor (``pinpriq/reactor.py``) over real TCP: a connection waiting for its next request
is served by the server's one epoll, and goes back to its own task for every other wait: a
blocked session, an incomplete frame, a close; eviction and shutdown take it out; a flood on one
connection does not starve another."""

from __future__ import annotations

import itertools
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from functools import partial

import pytest
import trio
import trio.testing

from pinpriq.reactor import Reactor
from pinpriq.server import RECEIVE_SIZE, PinpriqServer
from tests.conftest import LiveServer, StartServer
from tests.rawpeer import READY, SYNC, Peer, leased_subscribe, pop, push, subscribe
from tests.test_limits import PAYLOAD, capped, pushes, server_side, settle, timing_out


def reactor_of(live: LiveServer) -> Reactor:
    reactor = live.server.reactor
    assert reactor is not None
    return reactor


async def test_a_connection_between_requests_waits_in_the_reactor(live: LiveServer) -> None:
    first, second = await live.connect(), await live.connect()
    await settle()
    assert reactor_of(live).parked == 2
    for i in range(50):  # request, reply: each served by the reactor, the tasks asleep
        await first.send(push(b"q", b"k%d" % i, b"v"))
        assert await second.request(pop(b"q")) == [(b"k%d" % i, b"v")]
    await settle()
    assert reactor_of(live).parked == 2


async def test_a_request_at_a_time_is_served_while_another_waits_for_the_memory_cap(
    start_server: StartServer,
) -> None:
    live = await start_server(capped(10))
    producer, steady = await live.connect(), await live.connect()
    await producer.send(pushes(12) + pop(b"barrier"))  # two pushes wait for room
    await settle()
    assert live.server.broker.memory_full
    assert reactor_of(live).parked == 1  # the blocked producer waits in its own task
    for _ in range(5):  # the other is served all along, one request at a time
        assert await steady.request(pop(b"elsewhere")) == []
    await producer.expect_silence()
    assert len(await steady.request(pop(b"q"))) == 1
    assert len(await steady.request(pop(b"q"))) == 1
    assert await producer.reply() == []  # the barrier, once both pushes found room
    await settle()
    assert reactor_of(live).parked == 2  # and it is back in the reactor
    assert len(live.store) == 10


async def test_lone_frames_served_by_the_reactor_keep_every_rule(
    start_server: StartServer,
) -> None:
    # At pipeline 1 every request is a batch of one frame, which takes the shortest way through
    # ``Session.receive`` (no prefetch, the store's methods bound once, push runs counted
    # across batches): each rule still holds for it.
    live = await start_server(capped(3))
    producer, subscriber, leased = [await live.connect() for _ in range(3)]
    live.server.broker.take_pushes()  # start counting pushes per queue
    # A lone push wakes a waiting subscriber before the pusher's next frame is read.
    await subscriber.send(subscribe(b"w") + READY)
    await settle()
    await producer.send(push(b"w", b"k0", b"v"))
    assert await subscriber.reply() == [(b"k0", b"v")]
    # Lone pushes fill the cap; the next lone push waits, losing nothing, until a pop makes room.
    for i in (1, 2, 3):
        await producer.send(push(b"q", b"k%02d" % i, PAYLOAD))
    assert await producer.request(SYNC) == []
    assert live.server.broker.memory_full
    await producer.send(push(b"q", b"k04", PAYLOAD))
    await settle()  # served alone, not with the sync
    assert len(live.store) == 3
    await producer.send(SYNC)
    await producer.expect_silence()
    assert await subscriber.request(pop(b"q")) == [(b"k03", PAYLOAD)]
    assert await producer.reply() == []  # the sync, once the push found room
    assert len(live.store) == 3
    # A lone pop on a leased connection breaks decision 18: the connection is closed.
    await leased.send(leased_subscribe(b"elsewhere"))
    await settle()
    await leased.send(pop(b"q"))
    await leased.expect_closed()
    assert len(live.store) == 3  # the pop took nothing
    # Every lone push was counted for its queue.
    assert live.server.broker.take_pushes() == {b"w": 1, b"q": 4}


async def test_an_incomplete_frame_is_read_by_its_task_within_the_frame_timeout(
    start_server: StartServer, mock_clock: trio.testing.MockClock
) -> None:
    live = await start_server(timing_out(30))
    cut, steady = await live.connect(), await live.connect()
    frame = push(b"q", b"k", b"v")
    await cut.send(pop(b"none") + frame[:7])  # read by the reactor, which answers the pop
    assert await cut.reply() == []
    await settle()
    assert reactor_of(live).parked == 1  # the rest of the frame is awaited by its task
    await trio.sleep(20)
    await cut.send(frame[7:])
    assert await cut.request(pop(b"q")) == [(b"k", b"v")]
    await settle()
    assert reactor_of(live).parked == 2  # whole again: back in the reactor
    await cut.send(frame[:7])
    await trio.sleep(31)
    await cut.expect_closed()  # 30 s of reading one frame, counted by its task
    assert await steady.request(pop(b"q")) == []
    await settle()
    assert reactor_of(live).parked == 1


async def test_an_evicted_connection_leaves_the_reactor_and_others_carry_on(
    live: LiveServer,
) -> None:
    evicted, steady = await live.connect(), await live.connect()
    await evicted.send(push(b"q", b"k", b"v"))
    assert await steady.request(pop(b"none")) == []
    await settle()
    server_side(live.server, evicted).evict()  # as the client memory budget does
    await evicted.expect_closed()
    await settle()
    assert reactor_of(live).parked == 1
    assert live.server.connections == 1
    assert await steady.request(pop(b"q")) == [(b"k", b"v")]  # what it sent before stays


async def test_a_connection_evicted_by_its_own_chunk_in_the_reactor_closes(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    budget = 3 * RECEIVE_SIZE // 4
    live = await start_server(PinpriqServer(max_client_memory=budget))
    greedy, steady = await live.connect(), await live.connect()
    await settle()
    # Most of a read of a large push, past the budget by itself: the largest incomplete frame.
    almost = push(b"q", b"k", b"x" * 60_000)[: budget + 100]
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        await greedy.send(almost)
        await greedy.expect_closed()
    assert "client memory over its budget" in caplog.text
    assert "error" not in caplog.text
    await settle()
    assert live.server.client_memory.held == 0
    assert reactor_of(live).parked == 1
    assert await steady.request(pop(b"q")) == []  # nothing of the cut push was applied


async def test_shutdown_takes_every_connection_out_of_the_reactor(
    start_server: StartServer,
) -> None:
    server = PinpriqServer()
    live = await start_server(server)
    peers = [await live.connect() for _ in range(3)]
    for peer in peers:
        assert await peer.request(push(b"q", b"k", b"v") + SYNC) == []
    await settle()
    assert reactor_of(live).parked == 3
    server.shutdown()
    with trio.fail_after(5):
        for peer in peers:
            await peer.expect_closed()
        while server.reactor is not None:  # noqa: ASYNC110 (serve returns: the epoll closes)
            await trio.sleep(0.01)
    assert server.connections == 0


async def test_a_flooding_connection_does_not_starve_a_request_at_a_time(
    live: LiveServer, nursery: trio.Nursery
) -> None:
    flooder, steady = await live.connect(), await live.connect()
    frame = push(b"flood", b"k", b"x" * 16_000)
    rounds, per_send = 400, 4  # 25 MB of pushes, sent as fast as the server reads them

    async def flood() -> None:
        for _ in range(rounds):
            await flooder.send(frame * per_send)

    nursery.start_soon(flood)
    while not len(live.store):  # the flood has begun
        await trio.lowlevel.checkpoint()
    applied = []  # how many flood pushes the server had applied at each reply
    for _ in range(20):
        assert await steady.request(pop(b"none")) == []
        applied.append(len(live.store))
    gaps = [later - earlier for earlier, later in itertools.pairwise(applied)]
    # A round trip costs the flooder a few reads of its own, never the rest of its flood.
    assert max(gaps) <= 16 * per_send, applied
    assert applied[-1] < rounds * per_send


# The own wait (``Reactor.run`` blocking in its epoll while trio has nothing else to do) must
# still let everything else in trio happen. Each test below makes the reactor's last wait its
# own, then needs trio to run something only a wake-up of that wait can start: if the wait
# slept through it, the test would hang, which pytest-timeout turns into a failure.


async def served_once(live: LiveServer) -> None:
    """A request served by the reactor, so that its next wait is its own epoll's."""
    peer = await live.connect()
    assert await peer.request(pop(b"none")) == []
    assert reactor_of(live).waits_in_own_epoll


@pytest.mark.timeout(30)
async def test_a_deadline_in_another_task_wakes_the_own_wait(live: LiveServer) -> None:
    await served_once(live)
    with trio.move_on_after(0.01) as sleep:
        await trio.sleep_forever()
    assert sleep.cancelled_caught  # the deadline expired, with the reactor idle in between
    await served_once(live)


@pytest.mark.timeout(30)
async def test_a_thread_calling_into_trio_wakes_the_own_wait(live: LiveServer) -> None:
    await served_once(live)
    called = []

    def from_a_thread() -> int:
        time.sleep(0.01)  # most likely while the reactor waits in its own epoll
        return trio.from_thread.run_sync(lambda: called.append("in trio") or 42)

    assert await trio.to_thread.run_sync(from_a_thread) == 42
    assert called == ["in trio"]
    await served_once(live)


@pytest.mark.timeout(30)
async def test_another_tasks_socket_wakes_the_own_wait(live: LiveServer) -> None:
    await served_once(live)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sender = threading.Thread(target=lambda: (time.sleep(0.01), theirs.sendall(b"x")))
        sender.start()
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
        assert await stream.receive_some(1) == b"x"  # this task waited in trio's epoll
        sender.join()
    await served_once(live)


@pytest.mark.timeout(30)
async def test_a_deadline_cancels_the_server_while_the_reactor_waits_in_its_own_epoll() -> None:
    server = PinpriqServer()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(server.serve, 0, host="127.0.0.1"))
        stream = await trio.open_tcp_stream("127.0.0.1", listeners[0].socket.getsockname()[1])
        peer = Peer(stream)
        assert await peer.request(pop(b"none")) == []
        assert server.reactor is not None
        assert server.reactor.waits_in_own_epoll
        nursery.cancel_scope.deadline = trio.current_time() + 0.01
    assert nursery.cancel_scope.cancelled_caught
    assert server.reactor is None  # serve has ended, the reactor's task with it
    await stream.aclose()


@pytest.mark.timeout(30)
async def test_a_shutdown_from_a_thread_reaches_the_reactor_in_its_own_wait(
    start_server: StartServer,
) -> None:
    server = PinpriqServer()
    live = await start_server(server)
    peer = await live.connect()
    assert await peer.request(pop(b"none")) == []

    def shut_down() -> None:
        time.sleep(0.01)  # most likely while the reactor waits in its own epoll
        trio.from_thread.run_sync(server.shutdown)

    await trio.to_thread.run_sync(shut_down)
    await peer.expect_closed()
    while server.reactor is not None:  # noqa: ASYNC110 (serve returns: the epoll closes)
        await trio.sleep(0.01)


@pytest.mark.timeout(30)
async def test_virtual_time_keeps_the_reactor_waiting_through_trio(
    live: LiveServer, mock_clock: trio.testing.MockClock
) -> None:
    peer = await live.connect()
    assert await peer.request(pop(b"none")) == []
    # A MockClock's deadlines are virtual: blocking on them in the kernel would sleep in
    # real time (or forever, at rate 0), and the clock would never jump.
    assert not reactor_of(live).waits_in_own_epoll
    await trio.sleep(3600)  # jumps: every task, the reactor's included, waits in trio
    assert await peer.request(pop(b"none")) == []


#: A reactor serving one connection (a socket pair) in a trio run whose main task then sleeps:
#: the child says "idle" once a request has been answered, the reactor's next wait its own.
KI_CHILD = """
import os, socket, trio
from pinpriq.reactor import Reactor

class Conn:
    def __init__(self, fileno): self.fileno = fileno
    def serve_ready(self):
        os.read(self.fileno, 100)
        os.write(self.fileno, b"reply")
        return True

async def main():
    reactor = Reactor()
    ours, theirs = socket.socketpair()
    client = trio.SocketStream(trio.socket.from_stdlib_socket(theirs))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reactor.run)
        nursery.start_soon(reactor.park, Conn(ours.fileno()))
        await client.send_all(b"request")
        assert await client.receive_some(5) == b"reply"
        print("idle" if reactor.waits_in_own_epoll else "no own wait", flush=True)
        try:
            await trio.sleep_forever()
        except KeyboardInterrupt:
            print("KeyboardInterrupt in the main task", flush=True)
            raise

try:
    trio.run(main)
except BaseException:
    pass
"""


def test_ctrl_c_during_the_own_wait_reaches_the_main_task() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", KI_CHILD],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "idle\n"
        time.sleep(0.2)  # most likely in the own wait by now (if not, trio's: the same answer)
        child.send_signal(signal.SIGINT)
        rest, _ = child.communicate(timeout=30)
    finally:
        child.kill()
    # Not raised in the reactor's task (which would cancel the main task instead).
    assert rest == "KeyboardInterrupt in the main task\n"


@pytest.mark.timeout(30)
async def test_two_servers_in_one_run_share_the_own_wait(start_server: StartServer) -> None:
    # Two reactors blocking in turn would each find the other runnable and take checkpoints
    # back and forth for ever: the second waits through trio, whose epoll wakes the first.
    first, second = await start_server(PinpriqServer()), await start_server(PinpriqServer())
    on_second = await second.connect()
    for i in range(10):  # the second's requests while the first waits in its own epoll
        await served_once(first)
        assert await on_second.request(push(b"q", b"k%d" % i, b"v") + SYNC) == []
    assert not reactor_of(second).waits_in_own_epoll
    assert len(second.store) == 10
