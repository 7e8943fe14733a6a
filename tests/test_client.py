"""``PinpriqClient`` (Trio) against the real server over TCP, and against a scripted fake server
where a test needs to control exactly what the server says and when.

The fake server's replies are built by hand with ``struct`` (``reply()`` below) rather than with
``pinpriq.wire``, so a codec bug cannot agree with itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from functools import partial

import pytest
import trio
import trio.testing

from pinpriq import Packet, PinpriqClient, PinpriqConnectionError, PinpriqError
from pinpriq.client import Lease
from pinpriq.server import PinpriqServer
from tests.conftest import LiveServer, StartServer
from tests.rawpeer import READY, Peer, lease_reply, pop, push, reply, reserve, status, subscribe

TIMEOUT = 10


class FakeServer:
    """A listening socket whose connections the test accepts and speaks for, byte by byte."""

    def __init__(self, listener: trio.SocketListener) -> None:
        self.listener = listener
        self.port: int = listener.socket.getsockname()[1]
        self.peers: list[Peer] = []

    async def accept(self) -> Peer:
        peer = Peer(await self.listener.accept())
        self.peers.append(peer)
        return peer


async def read_to_eof(peer: Peer) -> bytes:
    """Everything the client sent on this connection, once it has closed it."""
    data = bytes(peer.buffer)
    while chunk := await peer.stream.receive_some(65536):
        data += chunk
    return data


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    server = FakeServer(listener)
    yield server
    for peer in server.peers:
        await trio.aclose_forcefully(peer.stream)
    await listener.aclose()


def connect(
    port: int, timeout: float | None = TIMEOUT
) -> AbstractAsyncContextManager[PinpriqClient]:
    return PinpriqClient.connect("127.0.0.1", port, timeout=timeout)


@pytest.fixture(autouse=True)
def _deadline(nursery: trio.Nursery) -> None:
    """No test here may hang: each fails after TIMEOUT seconds (virtual under ``mock_clock``)."""

    async def watchdog() -> None:
        await trio.sleep(TIMEOUT * 2)
        pytest.fail(f"test still running after {TIMEOUT * 2} s")

    nursery.start_soon(watchdog)


# -- push and pop against the real server -----------------------------------------------------


async def test_push_then_pop_round_trip(live: LiveServer) -> None:
    async with connect(live.port) as client:
        await client.push("jobs", "job-1", "resize cat.jpg")
        assert await client.pop("jobs") == [Packet(b"job-1", b"resize cat.jpg")]
        assert await client.pop("jobs") == []


async def test_bytes_and_str_mean_the_same_utf8(live: LiveServer) -> None:
    async with connect(live.port) as client:
        await client.push("caf\u00e9", b"k\xff", bytearray(b"\x00\x01"))
        await client.push(b"caf\xc3\xa9", memoryview(b"k2"), "\u20ac")
        assert await client.pop(b"caf\xc3\xa9") == [Packet(b"k2", "\u20ac".encode())]
        assert await client.pop("caf\u00e9") == [Packet(b"k\xff", b"\x00\x01")]


async def test_prio_and_key_grouping_come_back_as_on_the_wire(live: LiveServer) -> None:
    async with connect(live.port) as client:
        await client.push("q", "K", "a", prio=9)
        await client.push("q", "other", "x", prio=1)
        await client.push("q", "K", "b", prio=0)
        await client.push("q", "K", "c", prio=2)
        assert await client.pop("q") == [Packet(b"other", b"x")]
        assert await client.pop("q") == [
            Packet(b"K", b"c"),
            Packet(b"K", b"a"),
            Packet(b"K", b"b"),
        ]


async def test_prio_0_alone_pops_nothing(live: LiveServer) -> None:
    async with connect(live.port) as client:
        await client.push("q", "k", "hidden", prio=0)
        assert await client.pop("q") == []
        assert len(live.store) == 1


async def test_ttl_ms_expires_on_the_servers_clock(
    live: LiveServer, mock_clock: trio.testing.MockClock
) -> None:
    async with connect(live.port) as client:
        await client.push("q", "short", "", ttl_ms=100)
        await client.push("q", "forever", "", ttl_ms=0, prio=2)
        await trio.sleep(0.2)  # virtual time
        assert await client.pop("q") == [Packet(b"forever", b"")]
        assert await client.pop("q") == []


async def test_largest_fields_round_trip(live: LiveServer) -> None:
    big = bytes(range(256)) * 255 + b"\x00" * 255  # 65,535 bytes
    async with connect(live.port) as client:
        await client.push(big, big, big)
        assert await client.pop(big) == [Packet(big, big)]


async def test_fifty_concurrent_pops_each_get_their_own_reply(live: LiveServer) -> None:
    # Task i pops queue i, which holds i % 3 packets of key i, so every reply is different
    # (empty, one packet, a group of two) and a reply given to the wrong task shows.
    expected: dict[int, list[Packet]] = {}
    async with connect(live.port) as client:
        for i in range(50):
            payloads = [b"%d-%d" % (i, n) * (1 + 1000 * (i == 7)) for n in range(i % 3)]
            for payload in payloads:
                await client.push(f"q{i}", f"k{i}", payload, prio=1)
            expected[i] = [Packet(b"k%d" % i, p) for p in payloads[::-1][:1] + payloads[:-1]]
        got: dict[int, list[Packet]] = {}

        async def pop_one(i: int) -> None:
            got[i] = await client.pop(f"q{i}")

        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(pop_one, i)
    assert got == expected


async def test_concurrent_pushes_never_interleave(live: LiveServer) -> None:
    payload = b"x" * 60000  # big enough that a send may not finish in one go
    async with connect(live.port) as client, trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(partial(client.push, "q", f"k{i}", payload))
    async with connect(live.port) as client:
        popped = [await client.pop("q") for _ in range(21)]
    assert sorted(p[0].key for p in popped[:20]) == sorted(b"k%d" % i for i in range(20))
    assert all(p[0].payload == payload for p in popped[:20])
    assert popped[20] == []


# -- subscriptions against the real server ----------------------------------------------------


async def test_subscribe_delivers_pushes_in_selection_order(live: LiveServer) -> None:
    async with connect(live.port) as client:
        await client.push("a", "a1", "1", prio=5)
        async with client.subscribe(["a", "b"]) as deliveries:
            assert await anext(deliveries) == [Packet(b"a1", b"1")]
            await client.push("b", "b1", "2")  # pushed while the subscriber waits
            assert await anext(deliveries) == [Packet(b"b1", b"2")]
            await client.push("a", "k", "x", prio=3)
            await client.push("a", "k", "y", prio=0)
            assert await anext(deliveries) == [Packet(b"k", b"x"), Packet(b"k", b"y")]


async def test_subscription_uses_its_own_connection(live: LiveServer) -> None:
    async with connect(live.port) as client:
        await client.push("q", "k1", "")
        async with client.subscribe("q") as deliveries:
            assert await anext(deliveries) == [Packet(b"k1", b"")]
            # A pop on the client still gets its own reply, not a delivery.
            await client.push("other", "o", "")
            assert await client.pop("other") == [Packet(b"o", b"")]


async def test_limit_ends_iteration_and_takes_no_more(live: LiveServer) -> None:
    async with connect(live.port) as client:
        for i in range(5):
            await client.push("q", f"k{i}", "")
        async with client.subscribe("q", prefetch=4, limit=2) as deliveries:
            got = [packets async for packets in deliveries]
        assert got == [[Packet(b"k4", b"")], [Packet(b"k3", b"")]]
        # Only two credits were ever granted, so the rest stayed queued.
        assert [await client.pop("q") for _ in range(3)] == [
            [Packet(b"k2", b"")],
            [Packet(b"k1", b"")],
            [Packet(b"k0", b"")],
        ]


async def test_prefetch_3_holds_at_most_3_and_leaves_the_rest(live: LiveServer) -> None:
    async with connect(live.port) as client:
        for i in range(10):
            await client.push("q", f"k{i}", "")
        async with client.subscribe("q", prefetch=3) as deliveries:
            first = await anext(deliveries)  # a slow consumer: it asks for nothing more
            # Let the server read everything the subscriber has sent so far.
            await trio.testing.wait_all_tasks_blocked()
            others = []
            for _ in range(11):
                packets = await client.pop("q")
                if not packets:
                    break
                others += packets
            assert len(others) == 7, "the subscriber took more than its 3 credits"
            await client.push("q", "late", "")  # no credit left: it waits in the queue
            await trio.testing.wait_all_tasks_blocked()
            assert len(live.store) == 1
            rest = [await anext(deliveries) for _ in range(3)]
    keys = [packets[0].key for packets in [first, *rest]]
    assert keys == [b"k9", b"k8", b"k7", b"late"]
    assert sorted(p.key for p in others) == [b"k%d" % i for i in range(7)]


async def test_leaving_the_block_closes_the_subscription(live: LiveServer) -> None:
    async with connect(live.port) as client:
        await client.push("q", "k1", "")
        async with client.subscribe("q", prefetch=1) as deliveries:
            await anext(deliveries)
        await client.push("q", "k2", "")  # no credit was returned, so nobody takes this
        assert await client.pop("q") == [Packet(b"k2", b"")]


# -- credits and reply matching, byte for byte against a fake server --------------------------


async def test_credits_return_when_the_caller_asks_for_the_next(fake: FakeServer) -> None:
    async with connect(fake.port) as client:
        await fake.accept()
        async with client.subscribe("q", prefetch=3) as deliveries:
            sub = await fake.accept()
            assert await sub.receive_exactly(7) == subscribe(b"q") + READY * 3
            await sub.send(reply((b"1", b"")) + reply((b"2", b"")) + reply((b"3", b"")))
            assert await anext(deliveries) == [Packet(b"1", b"")]
            assert await anext(deliveries) == [Packet(b"2", b"")]  # the first is finished
            assert await sub.receive_exactly(1) == READY
        # Leaving with the second in hand returns no credit for it.
        assert await read_to_eof(sub) == b""


async def test_limit_caps_the_credits_granted(fake: FakeServer) -> None:
    async with connect(fake.port) as client:
        await fake.accept()
        async with client.subscribe(("a", "b"), prefetch=5, limit=2) as deliveries:
            sub = await fake.accept()
            await sub.send(reply((b"1", b"")) + reply((b"2", b"")))
            assert len([packets async for packets in deliveries]) == 2
        assert await read_to_eof(sub) == subscribe(b"a") + subscribe(b"b") + READY * 2


async def test_a_cancelled_pop_leaves_the_connection_in_step(fake: FakeServer) -> None:
    async with connect(fake.port) as client:
        server = await fake.accept()
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.pop, "a")
                assert await server.receive_exactly(4) == pop(b"a")
                scope.cancel()
        await server.send(reply((b"for-a", b"")))  # the cancelled pop's reply arrives late
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.send, reply((b"for-b", b"")))
            assert await client.pop("b") == [Packet(b"for-b", b"")]


async def test_a_pop_times_out_and_the_next_gets_its_own_reply(
    fake: FakeServer, mock_clock: trio.testing.MockClock
) -> None:
    async with connect(fake.port, timeout=5) as client:
        server = await fake.accept()
        with pytest.raises(TimeoutError, match=rf"pop from 127\.0\.0\.1:{fake.port}.* 5 s"):
            await client.pop("a")
        await server.send(reply((b"for-a", b"")) + reply((b"for-b", b"")))
        assert await client.pop("b") == [Packet(b"for-b", b"")]


async def test_a_push_that_cannot_be_sent_times_out_and_closes(
    fake: FakeServer, mock_clock: trio.testing.MockClock
) -> None:
    # The fake never reads, so the socket buffers fill up and a send blocks.
    async with connect(fake.port, timeout=5) as client:
        await fake.accept()
        with pytest.raises(TimeoutError, match="push to"):  # noqa: PT012
            for _ in range(10000):
                await client.push("q", "k", b"x" * 65535)
        # Part of a frame may have gone out, so the connection cannot be used again.
        with pytest.raises(PinpriqConnectionError, match="lost during a send"):
            await client.pop("q")


# -- arguments and connection errors ----------------------------------------------------------

TOO_LONG = b"x" * 65536


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"queue": TOO_LONG}, "queue"),
        ({"key": TOO_LONG}, "key"),
        ({"payload": "\u00e9" * 32768}, "payload"),  # 65,536 bytes of UTF-8
        ({"ttl_ms": 1 << 32}, "ttl_ms"),
        ({"ttl_ms": -1}, "ttl_ms"),
        ({"prio": 256}, "prio"),
        ({"prio": -1}, "prio"),
        ({"key": "\udcff"}, "key"),  # a lone surrogate has no UTF-8
    ],
)
async def test_bad_push_arguments_raise_before_sending(
    fake: FakeServer, kwargs: dict[str, object], field: str
) -> None:
    args: dict[str, object] = {"queue": "q", "key": "k", "payload": "p", **kwargs}
    async with connect(fake.port) as client:
        server = await fake.accept()
        with pytest.raises(ValueError, match=rf"^{field}\b"):
            await client.push(**args)  # type: ignore[arg-type]
        await client.push("q", "k", "p")
        assert await server.receive_exactly(13) == push(b"q", b"k", b"p")


async def test_bad_pop_and_subscribe_arguments_raise_before_sending(fake: FakeServer) -> None:
    async with connect(fake.port) as client:
        server = await fake.accept()
        with pytest.raises(ValueError, match=r"^queue"):
            await client.pop(TOO_LONG)
        with pytest.raises(TypeError, match=r"^queue must be bytes or str, not int"):
            await client.pop(7)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^queue"):
            client.subscribe(["ok", TOO_LONG])
        with pytest.raises(ValueError, match="at least one queue"):
            client.subscribe([])
        with pytest.raises(ValueError, match=r"^prefetch"):
            client.subscribe("q", prefetch=0)
        with pytest.raises(ValueError, match=r"^limit"):
            client.subscribe("q", limit=0)
        await client.push("q", "k", "p")
        assert await server.receive_exactly(13) == push(b"q", b"k", b"p")


async def test_refused_connection_names_the_address() -> None:
    with trio.socket.socket() as placeholder:  # bound, never listening: connecting is refused
        await placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
        with pytest.raises(PinpriqConnectionError, match=rf"127\.0\.0\.1:{port}") as info:
            async with connect(port):
                pass  # pragma: no cover
    assert isinstance(info.value, ConnectionError)
    assert (info.value.host, info.value.port) == ("127.0.0.1", port)


@pytest.mark.parametrize("seconds", [0, -1.0])
async def test_timeout_must_be_positive(seconds: float) -> None:
    with pytest.raises(ValueError, match="timeout"):
        async with connect(1, timeout=seconds):
            pass  # pragma: no cover


async def answered_pop(client: PinpriqClient, server: Peer) -> None:
    """A pop of ``x`` that the fake server answers ``00 00``."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.pop, "x")
        assert await server.receive_exactly(4) == pop(b"x")
        await server.send(reply())


async def test_dropped_connection_fails_every_waiting_pop(fake: FakeServer) -> None:
    errors: list[Exception] = []

    async def pop_and_record(queue: str) -> None:
        try:
            await client.pop(queue)
        except PinpriqConnectionError as error:
            errors.append(error)

    async with connect(fake.port) as client:
        server = await fake.accept()
        await answered_pop(client, server)  # a server that has spoken is not refusing
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pop_and_record, "a")
            nursery.start_soon(pop_and_record, "b")
            await server.receive_exactly(8)
            await server.aclose()
        assert [str(e) for e in errors] == [
            f"connection to 127.0.0.1:{fake.port} was closed by the server"
        ] * 2
        with pytest.raises(PinpriqConnectionError, match="closed by the server"):
            await client.push("q", "k", "")


async def test_subscription_reports_a_closed_server(fake: FakeServer) -> None:
    async with connect(fake.port) as client:
        await fake.accept()
        async with client.subscribe("q") as deliveries:
            sub = await fake.accept()
            await sub.receive_exactly(5)  # unread bytes would make the close a reset
            await sub.send(reply((b"k", b"")))  # a server that has spoken is not refusing
            assert await anext(deliveries) == [Packet(b"k", b"")]

            async def close_once_the_credit_is_back() -> None:
                assert await sub.receive_exactly(1) == READY  # unread, it would make a reset
                await sub.aclose()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(close_once_the_credit_is_back)
                with pytest.raises(PinpriqConnectionError, match="closed by the server"):
                    await anext(deliveries)


async def test_calls_after_close_raise(live: LiveServer) -> None:
    async with connect(live.port) as client:
        pass
    with pytest.raises(PinpriqConnectionError, match="is closed"):
        await client.pop("q")


# -- wrong types, sync, and servers that are not what they seem -------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"ttl_ms": 1.5}, "ttl_ms"), ({"ttl_ms": "5"}, "ttl_ms"), ({"prio": None}, "prio")],
)
async def test_arguments_of_the_wrong_type_name_the_field_before_sending(
    fake: FakeServer, kwargs: dict[str, object], field: str
) -> None:
    async with connect(fake.port) as client:
        server = await fake.accept()
        with pytest.raises(TypeError, match=rf"^{field} must be an integer") as info:
            await client.push("q", "k", "p", **kwargs)  # type: ignore[arg-type]
        assert isinstance(info.value, PinpriqError)
        await client.push("q", "k", "p")
        assert await server.receive_exactly(13) == push(b"q", b"k", b"p")


@pytest.mark.parametrize("port", [0, 65536, -1])
async def test_a_port_out_of_range_is_a_value_error_at_connect(port: int) -> None:
    with pytest.raises(ValueError, match=rf"^port must be in 1\.\.65535, not {port}$"):
        async with connect(port):
            pass  # pragma: no cover


async def test_sync_returns_once_earlier_pushes_are_applied(live: LiveServer) -> None:
    async with connect(live.port) as client:
        for i in range(100):
            await client.push("q", f"k{i}", "")
        await client.sync()
        assert len(live.store) == 100  # no other barrier: the sync's answer is the proof
        await client.push("q", "confirmed", "", confirm=True)
        assert len(live.store) == 101


async def test_sync_answers_stay_in_order_with_pop_replies(fake: FakeServer) -> None:
    async with connect(fake.port) as client, trio.open_nursery() as nursery:
        server = await fake.accept()
        results: list[object] = []

        async def pop_then_record() -> None:
            results.append(await client.pop("a"))

        nursery.start_soon(pop_then_record)
        await server.receive_exactly(4)
        nursery.start_soon(client.sync)
        assert await server.receive_exactly(1) == b"\x21"
        await server.send(reply((b"k", b"v")) + reply())
    assert results == [[Packet(b"k", b"v")]]


async def test_a_sync_answered_by_something_else_fails_at_once(fake: FakeServer) -> None:
    async with connect(fake.port, timeout=None) as client:
        server = await fake.accept()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.send, b"-ERR unknown command '\\x70'\r\n")
            with pytest.raises(PinpriqConnectionError, match="answered a sync with 2d 45"):
                await client.push("q", "k", "v", confirm=True)  # no timeout: fails by itself
        with pytest.raises(PinpriqConnectionError, match="answered a sync"):
            await client.pop("q")  # the connection is out of step, so closed


async def test_a_server_at_its_connection_limit_is_named_as_the_likely_cause(
    start_server: StartServer,
) -> None:
    live = await start_server(PinpriqServer(max_connections=1))
    await live.connect()  # takes the one slot
    async with connect(live.port) as client:
        with pytest.raises(PinpriqConnectionError) as info:
            await client.pop("q")
    assert str(info.value) == (
        f"127.0.0.1:{live.port}: the server closed the connection at once "
        "(it may be at its connection limit, want a token or TLS, or refuse clients from "
        "other hosts)"
    )


# -- leases (protocol 1.1) --------------------------------------------------------------------


async def test_reserve_gives_a_lease_that_acks_once(live: LiveServer) -> None:
    async with connect(live.port) as client:
        await client.push("jobs", "k", "a", prio=2)
        await client.push("jobs", "k", "b", prio=0)
        job = await client.reserve("jobs", lease_ms=5000)
        assert (job.lease_id, job.attempt) == (1, 1)
        assert job.packets == [Packet(b"k", b"a"), Packet(b"k", b"b")]
        assert await client.pop("jobs") == []  # leased: out of the queue
        assert await job.touch(5000)
        assert await job.ack()
        assert not await job.ack()  # already over: the server answers status 0
        assert live.broker.lease_totals().acked == 2


async def test_a_lease_and_a_plain_subscription_of_one_client_never_share_a_connection(
    live: LiveServer,
) -> None:
    # Decision 20: the server closes a connection that mixes them; the subscription has a
    # connection of its own, so the client's lease frames go on working beside it.
    async with connect(live.port) as client:
        await client.push("jobs", "k", "v")
        job = await client.reserve("jobs")
        async with client.subscribe("events") as deliveries:
            await client.push("events", "e", "1")
            assert await deliveries.__anext__() == [Packet(b"e", b"1")]
            assert await job.ack()
        assert await (await client.reserve("jobs")).release() is False  # empty: sends nothing


async def test_an_empty_reserve_is_a_false_lease_that_sends_nothing(live: LiveServer) -> None:
    async with connect(live.port) as client:
        job = await client.reserve("nothing")
        assert not job
        assert (job.lease_id, job.attempt, job.packets) == (0, 0, [])
        assert not await job.ack()
        assert not await job.touch()
        async with job:
            pass
    assert live.broker.lease_totals().unknown == 0  # no ack reached the server


async def test_the_lease_as_a_context_manager_acks_or_releases(live: LiveServer) -> None:
    async with connect(live.port) as client:
        await client.push("jobs", "k", "v")
        with pytest.raises(ValueError, match="boom"):
            async with await client.reserve("jobs") as job:
                raise ValueError("boom")
        async with await client.reserve("jobs") as again:  # released: back at once
            assert again.packets == job.packets
            assert again.attempt == 2
        assert await client.pop("jobs") == []
        assert live.broker.lease_totals()[:3] == (0, 1, 1)  # leased, acked, redelivered


async def test_a_cancelled_job_is_released_all_the_same(live: LiveServer) -> None:
    async with connect(live.port) as client:
        await client.push("jobs", "k", "v")
        job = await client.reserve("jobs")
        with trio.CancelScope() as scope:
            async with job:
                scope.cancel()
                await trio.sleep_forever()
        assert await client.pop("jobs") == [Packet(b"k", b"v")]


async def test_a_lease_left_to_lapse_comes_back_and_its_ack_says_so(
    live: LiveServer, mock_clock: trio.testing.MockClock
) -> None:
    async with connect(live.port) as client:
        await client.push("jobs", "k", "v")
        job = await client.reserve("jobs", lease_ms=1000)
        await trio.sleep(0.75)
        assert await job.touch(1000)  # now ends at 1.75 s
        await trio.sleep(0.75)
        assert await client.pop("jobs") == []
        await trio.sleep(0.5)  # virtual time
        assert not await job.ack()
        assert await client.pop("jobs") == [Packet(b"k", b"v")]


async def test_release_with_a_delay_brings_the_job_back_later(
    live: LiveServer, mock_clock: trio.testing.MockClock
) -> None:
    async with connect(live.port) as client:
        await client.push("jobs", "k", "v")
        assert await (await client.reserve("jobs")).release(delay_ms=2000)
        await trio.sleep(1.9)
        assert not await client.reserve("jobs")
        await trio.sleep(0.2)
        assert (await client.reserve("jobs")).attempt == 2


async def test_leased_subscription_delivers_leases_and_unacked_ones_go_back(
    live: LiveServer,
) -> None:
    async with connect(live.port) as client:
        for i in range(3):
            await client.push("jobs", f"k{i}", "")
        async with client.subscribe("jobs", lease_ms=60_000, prefetch=2) as jobs:
            first = await anext(jobs)
            assert first.packets == [Packet(b"k2", b"")]
            assert await first.ack()
            second = await anext(jobs)
            assert second.packets == [Packet(b"k1", b"")]
            assert await second.touch()
            # the third was delivered too (prefetch 2), never handed out: neither acked
        await trio.testing.wait_all_tasks_blocked()  # the server has seen the close
        assert await client.pop("jobs") == [Packet(b"k1", b"")]  # both came back at the close
        assert await client.pop("jobs") == [Packet(b"k0", b"")]


async def test_acks_from_another_task_while_the_iterator_waits(live: LiveServer) -> None:
    async with connect(live.port) as client:
        await client.push("jobs", "k", "")
        async with client.subscribe("jobs", lease_ms=60_000, prefetch=2) as jobs:
            job = await anext(jobs)
            async with trio.open_nursery() as nursery:
                got: list[Lease] = []

                async def next_job() -> None:
                    got.append(await anext(jobs))  # waits, reading, for the next delivery

                nursery.start_soon(next_job)
                await trio.testing.wait_all_tasks_blocked()
                assert await job.ack()  # its answer is read by whichever task reads
                await client.push("jobs", "k2", "")
            assert got[0].packets == [Packet(b"k2", b"")]


async def test_work_acks_each_job_after_confirming_its_follow_ups(live: LiveServer) -> None:
    async with connect(live.port) as client:
        for i in range(3):
            await client.push("jobs", f"k{i}", f"{i}")

        async def handler(job: Lease) -> None:
            await client.push("done", job.packets[0].key, job.packets[0].payload)

        await client.work("jobs", handler, limit=3)
        totals = live.broker.lease_totals()
        assert (totals.acked, totals.redelivered, totals.leased) == (3, 0, 0)
        assert len(live.store) == 3  # every follow-up is in


async def test_work_keeps_a_slow_job_alive_and_releases_a_failed_one(
    live: LiveServer, mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with connect(live.port) as client:
        await client.push("jobs", "k", "v")
        attempts: list[int] = []

        async def handler(job: Lease) -> None:
            attempts.append(job.attempt)
            await trio.sleep(3)  # three times the lease: touches keep it
            if len(attempts) == 1:
                raise RuntimeError("flaky")

        await client.work("jobs", handler, lease_ms=1000, limit=2, retry_delay_ms=500)
        assert attempts == [1, 2]
        totals = live.broker.lease_totals()
        assert (totals.acked, totals.redelivered) == (1, 1)  # the release, not a lapse
        assert "job b'k' (attempt 1) failed, released: flaky" in caplog.text


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.reserve("q", lease_ms=86_400_001), "lease_ms must be in 0..86400000"),
        (lambda c: c.reserve("q", lease_ms=1.5), "lease_ms must be an integer"),
        (lambda c: c.subscribe("q", lease_ms=-1).__aenter__(), "lease_ms must be in"),
    ],
)
async def test_bad_lease_arguments_raise_before_sending(
    fake: FakeServer, call: Callable[[PinpriqClient], Awaitable[object]], message: str
) -> None:
    async with connect(fake.port) as client:
        peer = await fake.accept()
        with pytest.raises((ValueError, TypeError), match=message):
            await call(client)
    assert await read_to_eof(peer) == b""


async def test_an_answer_about_another_lease_is_out_of_step(fake: FakeServer) -> None:
    async with connect(fake.port) as client:
        peer = await fake.accept()
        await peer.send(lease_reply(5, 1, (b"k", b"")))
        job = await client.reserve("q")
        assert await peer.receive_exactly(len(reserve(b"q"))) == reserve(b"q")
        await peer.send(status(6, True))
        with pytest.raises(PinpriqConnectionError, match=r"about lease 5 .* lease 6"):
            await job.ack()
