"""The server's limits over real TCP: the memory cap, output and decoder bounds, the connection
limit, fault isolation, and graceful shutdown. Each limit makes someone wait; none loses a
packet."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from pinpriq import server as server_module
from pinpriq.broker import OUTPUT_HIGH_WATER, Session
from pinpriq.packed import DEFAULT_STORE_OVERHEAD
from pinpriq.server import RECEIVE_SIZE, PinpriqServer
from pinpriq.wire import MAX_FRAME, ClientFrame
from tests.conftest import LiveServer, StartServer
from tests.rawpeer import READY, Peer, pop, push, subscribe

PAYLOAD = b"p" * 100
#: What one test packet (key b"kNN", PAYLOAD) counts against the cap.
PACKET_COST = 3 + len(PAYLOAD) + DEFAULT_STORE_OVERHEAD


def capped(packets: int) -> PinpriqServer:
    """A server that is full once it holds ``packets`` test packets."""
    return PinpriqServer(max_memory=packets * PACKET_COST)


def pushes(count: int, queue: bytes = b"q", ttl_ms: int = 0) -> bytes:
    return b"".join(push(queue, b"k%02d" % i, PAYLOAD, ttl_ms=ttl_ms) for i in range(count))


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


def server_side(server: PinpriqServer, peer: Peer) -> server_module._Connection:
    """The server's end of a peer's connection; white-box, to read its buffers."""
    [conn] = [c for c in server._connections.values() if c.peer == f"127.0.0.1:{peer.local_port}"]
    return conn


# -- memory cap -------------------------------------------------------------------------------


async def test_a_full_server_stops_reading_a_pusher_and_loses_nothing(
    start_server: StartServer,
) -> None:
    live = await start_server(capped(10))
    producer, consumer = await live.connect(), await live.connect()
    # The pop after the pushes is the producer's barrier: it is not read while the producer waits.
    await producer.send(pushes(30) + pop(b"barrier"))
    await settle()
    assert len(live.store) == 10
    assert live.server.broker.memory_full
    await producer.expect_silence()
    popped = [await consumer.request(pop(b"q")) for _ in range(30)]
    assert sorted(p[0][0] for p in popped) == sorted(b"k%02d" % i for i in range(30))
    assert await producer.reply() == []  # the barrier, read once there was room again
    assert not live.server.broker.memory_full
    assert len(live.store) == 0


async def test_pops_credits_and_other_connections_carry_on_while_full(
    start_server: StartServer,
) -> None:
    live = await start_server(capped(5))
    producer, reader, subscriber = [await live.connect() for _ in range(3)]
    await producer.send(pushes(5, b"full") + push(b"blocked", b"x", b"y"))
    await settle()
    assert live.server.broker.memory_full
    await subscriber.send(subscribe(b"full") + READY)
    assert len(await subscriber.reply()) == 1
    await reader.send(b"".join(pop(b"full") for _ in range(4)))
    assert [len(await reader.reply()) for _ in range(4)] == [1, 1, 1, 1]
    assert await reader.request(pop(b"blocked")) == [(b"x", b"y")]  # the waiting push landed


async def test_full_and_recovered_are_each_logged_once(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    live = await start_server(capped(15))
    producer, consumer = await live.connect(), await live.connect()
    with caplog.at_level(logging.INFO, logger="pinpriq.server"):
        await producer.send(pushes(20))
        await settle()
        assert live.server.broker.memory_full  # 15 held, 5 pushes waiting
        await consumer.send(pop(b"q") * 20)  # one batch: room for all 5 at once
        popped = [len(await consumer.reply()) for _ in range(20)]
        while sum(popped) < 20:
            popped.append(len(await consumer.request(pop(b"q"))))
    messages = [r.getMessage() for r in caplog.records if "memory" in r.getMessage()]
    assert len(messages) == 2, messages
    assert "cap reached" in messages[0]
    assert "pushes resume" in messages[1]


async def test_expiry_makes_room_for_a_waiting_pusher(
    start_server: StartServer, mock_clock: trio.testing.MockClock
) -> None:
    live = await start_server(capped(10))
    producer, consumer = await live.connect(), await live.connect()
    await producer.send(pushes(10, b"short", ttl_ms=1000) + push(b"later", b"k", b"v"))
    await settle()
    assert live.server.broker.memory_full
    await trio.sleep(1.5)  # no pop: the expiry sweep alone frees the room
    assert await consumer.request(pop(b"later")) == [(b"k", b"v")]
    assert not live.server.broker.memory_full


async def test_decoder_holds_at_most_one_frame_and_one_read_while_waiting(
    start_server: StartServer,
) -> None:
    live = await start_server(capped(1))
    producer = await live.connect()
    big = push(b"q", b"k", b"x" * 65535)
    await producer.send(push(b"q", b"first", PAYLOAD))
    await settle()
    with trio.move_on_after(1):  # the server stops reading: this send blocks eventually
        for _ in range(200):
            await producer.send(big)
    conn = server_side(live.server, producer)
    assert conn.decoder.pending <= MAX_FRAME + RECEIVE_SIZE
    assert len(live.store) == 1


# -- frame timeout ----------------------------------------------------------------------------


def timing_out(seconds: float, **limits: int) -> PinpriqServer:
    return PinpriqServer(frame_timeout=seconds, **limits)


async def test_half_a_frame_held_for_the_frame_timeout_closes_only_that_connection(
    start_server: StartServer, mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    live = await start_server(timing_out(30))
    stalled, idle = await live.connect(), await live.connect()
    frame = push(b"q", b"k", b"v")
    await stalled.send(pop(b"none") + frame[:7])
    assert await stalled.reply() == []  # the frames before the cut one are answered
    await trio.sleep(29)
    await stalled.expect_silence()  # not yet
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        await trio.sleep(2)
        await stalled.expect_closed()
    [record] = caplog.records
    assert f"closing 127.0.0.1:{stalled.local_port}: an incomplete frame" in record.getMessage()
    assert "(7 bytes so far) for 30 s of reading" in record.getMessage()
    await trio.sleep(100)  # an idle connection between frames is never timed out
    assert await idle.request(pop(b"q")) == []
    assert len(live.store) == 0  # the cut push was never applied


async def test_a_frame_trickled_in_times_out_though_bytes_keep_coming(
    start_server: StartServer, mock_clock: trio.testing.MockClock
) -> None:
    live = await start_server(timing_out(30))
    slow = await live.connect()
    frame = push(b"q", b"k", b"x" * 100)
    started = trio.current_time()

    async def trickle() -> None:
        for byte in frame:
            await slow.send(bytes([byte]))
            await trio.sleep(5)

    with pytest.raises(trio.BrokenResourceError):  # the server closed it: sends are reset
        await trickle()
    assert 30 <= trio.current_time() - started <= 40
    assert len(live.store) == 0


async def test_each_complete_frame_starts_the_clock_again(
    start_server: StartServer, mock_clock: trio.testing.MockClock
) -> None:
    live = await start_server(timing_out(30))
    client = await live.connect()
    for i in range(5):  # 100 s in all, never 30 s on one frame
        frame = push(b"q", b"k%d" % i, b"v")
        await client.send(frame[:5])
        await trio.sleep(20)
        await client.send(frame[5:])
    assert await client.request(pop(b"q")) == [(b"k4", b"v")]
    assert len(live.store) == 4


async def test_a_producer_the_server_paused_is_not_timed_out_for_it(
    start_server: StartServer, mock_clock: trio.testing.MockClock
) -> None:
    live = await start_server(timing_out(1, max_memory=10 * PACKET_COST))
    producer, consumer = await live.connect(), await live.connect()
    last = push(b"q", b"last", PAYLOAD)
    await producer.send(pushes(12) + last[:5])  # 10 fit; the rest wait, with half a frame
    await settle()
    assert live.server.broker.memory_full
    await trio.sleep(60)  # paused by the server for a minute: its reading clock is stopped
    for _ in range(5):
        assert len(await consumer.request(pop(b"q"))) == 1
    await settle()
    await producer.send(last[5:] + pop(b"none"))
    assert await producer.reply() == []
    assert len(live.store) == 10 - 5 + 2 + 1


# -- output bound -----------------------------------------------------------------------------


async def test_a_client_that_does_not_read_its_replies_is_not_read_either(
    hardened: LiveServer,
) -> None:
    live = hardened  # plain, and with a token and TLS
    filler, greedy = await live.connect(), await live.connect()
    payload = b"x" * 60_000
    count = 600  # 36 MB of replies, far beyond the output bound plus the socket buffers
    for i in range(count):
        await filler.send(push(b"q", b"k%04d" % i, payload))
    await settle()
    await greedy.send(pop(b"q") * count)
    await settle()
    conn = server_side(live.server, greedy)
    assert len(conn.session.output) + conn.session.unsent <= OUTPUT_HIGH_WATER + len(payload) + 64
    assert len(live.store) > count // 3  # most pops were not even read
    assert await filler.request(pop(b"elsewhere")) == []  # others carry on
    keys = [(await greedy.reply())[0][0] for _ in range(count)]
    assert keys == [b"k%04d" % i for i in reversed(range(count))]  # then all arrive, in order


# -- connection limit -------------------------------------------------------------------------


async def test_connections_past_the_limit_are_closed_at_once(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    live = await start_server(PinpriqServer(max_connections=3))
    peers = [await live.connect() for _ in range(3)]
    await settle()
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        extra = await live.connect()
        await extra.expect_closed()
    assert any("refusing a connection" in r.getMessage() for r in caplog.records)
    assert await peers[0].request(pop(b"q")) == []  # the admitted ones are unaffected
    await peers[1].aclose()
    await settle()
    again = await live.connect()
    assert await again.request(pop(b"q")) == []


# -- fault isolation --------------------------------------------------------------------------


async def test_a_bug_in_one_connection_closes_only_that_one(
    live: LiveServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    receive = Session.receive

    def buggy_receive(session: Session, frames: list[ClientFrame], start: int = 0) -> int:
        if any(frame[:1] == (b"boom",) for frame in frames[start:]):
            raise RuntimeError("simulated bug")
        return receive(session, frames, start)

    monkeypatch.setattr(Session, "receive", buggy_receive)
    victim, bystander = await live.connect(), await live.connect()
    await bystander.send(push(b"q", b"k", b"v"))
    with caplog.at_level(logging.ERROR, logger="pinpriq.server"):
        await victim.send(pop(b"boom"))
        await victim.expect_closed()
    [record] = caplog.records
    assert "127.0.0.1:" in record.getMessage()
    assert record.exc_info is not None  # the traceback is logged
    assert await bystander.request(pop(b"q")) == [(b"k", b"v")]
    await settle()
    assert live.server.connections == 1


# -- graceful shutdown ------------------------------------------------------------------------


async def test_shutdown_flushes_owed_replies_then_closes(start_server: StartServer) -> None:
    server = PinpriqServer()
    live = await start_server(server)
    slow, idle = await live.connect(), await live.connect()
    payload = b"x" * 60_000
    await slow.send(b"".join(push(b"q", b"k%d" % i, payload) for i in range(100)))
    # ~6 MB of replies, not read yet: the server computes replies up to its output bound and
    # stops reading there, so only those are owed.
    await slow.send(pop(b"q") * 100)
    await settle()
    server.shutdown()
    replies = []
    with trio.fail_after(5):
        while True:
            try:
                replies.append(await slow.reply())
            except EOFError:
                break
        await idle.expect_closed()
    assert len(replies) * len(payload) >= OUTPUT_HIGH_WATER
    assert all(reply[0][1] == payload for reply in replies)  # every owed reply, whole
    assert len(replies) + len(server.broker.store) == 100  # the pops never read popped nothing
    with pytest.raises(OSError, match="connect"):  # the listener is closed
        await trio.open_tcp_stream("127.0.0.1", live.port)


async def test_shutdown_gives_up_on_a_client_that_never_reads(
    start_server: StartServer, mock_clock: trio.testing.MockClock
) -> None:
    server = PinpriqServer()
    live = await start_server(server)
    stuck = await live.connect()
    payload = b"x" * 60_000
    await stuck.send(b"".join(push(b"q", b"k%d" % i, payload) for i in range(200)))
    await stuck.send(pop(b"q") * 200)
    await settle()
    server.shutdown()
    await trio.sleep(server_module.CLOSE_FLUSH_SECONDS + 0.1)  # virtual time
    assert server.connections == 0
