"""The server over real TCP on an ephemeral loopback port, spoken to in raw bytes.

Each protocol decision (docs/protocol.md, "Decisions") has at least one test here; TTL tests
run on virtual time (the ``mock_clock`` fixture), never real sleeps.
"""

from __future__ import annotations

import gc
import logging
from functools import partial

import pytest
import trio
import trio.testing

from pinpriq.server import serve
from tests.conftest import LiveServer
from tests.rawpeer import (
    READY,
    SYNC,
    Peer,
    pop,
    push,
    push_options,
    reply,
    subscribe,
    unsubscribe,
)

# -- pop, priority and grouping (decisions 2-4) -----------------------------------------------


async def test_pop_reply_bytes_are_exact(live: LiveServer) -> None:
    peer = await live.connect()
    await peer.send(push(b"jobs", b"k1", b"hello", prio=3))
    await peer.send(pop(b"jobs"))
    assert await peer.receive_exactly(13) == bytes.fromhex("0001 0002 0005") + b"k1hello"


async def test_lowest_prio_number_pops_first(live: LiveServer) -> None:
    peer = await live.connect()
    await peer.send(push(b"q", b"low", b"", prio=200) + push(b"q", b"high", b"", prio=1))
    await peer.send(push(b"q", b"mid", b"", prio=7))
    assert await peer.request(pop(b"q")) == [(b"high", b"")]
    assert await peer.request(pop(b"q")) == [(b"mid", b"")]
    assert await peer.request(pop(b"q")) == [(b"low", b"")]


async def test_newest_wins_ties(live: LiveServer) -> None:
    peer = await live.connect()
    await peer.send(b"".join(push(b"q", b"k%d" % i, b"", prio=5) for i in range(3)))
    assert [await peer.request(pop(b"q")) for _ in range(3)] == [
        [(b"k2", b"")],
        [(b"k1", b"")],
        [(b"k0", b"")],
    ]


async def test_group_reply_is_selected_first_then_push_order(live: LiveServer) -> None:
    peer = await live.connect()
    await peer.send(
        push(b"q", b"K", b"a", prio=9)
        + push(b"q", b"other", b"x", prio=1)
        + push(b"q", b"K", b"b", prio=0)  # never selectable, rides along
        + push(b"q", b"K", b"c", prio=2)  # selected: best of key K
        + push(b"q", b"K", b"d", prio=4)
    )
    assert await peer.request(pop(b"q")) == [(b"other", b"x")]
    assert await peer.request(pop(b"q")) == [(b"K", b"c"), (b"K", b"a"), (b"K", b"b"), (b"K", b"d")]
    assert await peer.request(pop(b"q")) == []
    assert len(live.store) == 0


async def test_grouping_stays_within_one_queue(live: LiveServer) -> None:
    peer = await live.connect()
    await peer.send(push(b"a", b"K", b"1") + push(b"b", b"K", b"2"))
    assert await peer.request(pop(b"a")) == [(b"K", b"1")]
    assert await peer.request(pop(b"b")) == [(b"K", b"2")]


@pytest.mark.parametrize(
    "setup",
    [b"", push(b"q", b"k", b"only prio 0", prio=0), push(b"elsewhere", b"k", b"v")],
    ids=["missing queue", "prio-0 only", "other queue"],
)
async def test_nothing_selectable_pops_00_00(live: LiveServer, setup: bytes) -> None:
    peer = await live.connect()
    await peer.send(setup + pop(b"q"))
    assert await peer.receive_exactly(2) == b"\x00\x00"
    await peer.expect_silence()


# -- TTL (decision 1), on virtual time --------------------------------------------------------


async def test_ttl_expires_after_its_milliseconds(
    live: LiveServer, mock_clock: trio.testing.MockClock
) -> None:
    peer = await live.connect()
    await peer.send(push(b"q", b"k", b"v", ttl_ms=250, prio=1))
    await peer.send(push(b"q", b"k2", b"v2", ttl_ms=500, prio=2))
    await trio.testing.wait_all_tasks_blocked()
    await trio.sleep(0.249)
    assert len(live.store) == 2
    await trio.sleep(0.002)
    assert await peer.request(pop(b"q")) == [(b"k2", b"v2")]  # k has expired
    await peer.send(push(b"q", b"k3", b"v3", ttl_ms=100))
    await trio.sleep(0.101)
    assert await peer.request(pop(b"q")) == []


async def test_ttl_zero_never_expires(live: LiveServer, mock_clock: trio.testing.MockClock) -> None:
    peer = await live.connect()
    await peer.send(push(b"q", b"k", b"forever", ttl_ms=0))
    await trio.sleep(365 * 24 * 3600)
    assert await peer.request(pop(b"q")) == [(b"k", b"forever")]


async def test_expired_memory_is_released_without_a_pop(
    live: LiveServer, mock_clock: trio.testing.MockClock
) -> None:
    peer = await live.connect()
    await peer.send(
        b"".join(push(b"q%d" % i, b"k", b"v" * 100, ttl_ms=10 * i) for i in range(1, 6))
    )
    await peer.send(push(b"keep", b"k", b"v"))
    await trio.testing.wait_all_tasks_blocked()
    assert len(live.store) == 6
    await trio.sleep(0.025)  # the expiry timer, not a pop, removes q1 and q2
    assert len(live.store) == 4
    await trio.sleep(1)
    assert len(live.store) == 1
    assert live.store.queue_count == 1
    assert live.store.next_deadline() is None


async def test_expired_sibling_is_left_out_of_a_group(
    live: LiveServer, mock_clock: trio.testing.MockClock
) -> None:
    peer = await live.connect()
    await peer.send(push(b"q", b"K", b"short", ttl_ms=100, prio=0) + push(b"q", b"K", b"long"))
    await trio.sleep(0.2)
    assert await peer.request(pop(b"q")) == [(b"K", b"long")]


async def test_a_later_earlier_deadline_reschedules_the_sweep(
    live: LiveServer, mock_clock: trio.testing.MockClock
) -> None:
    peer = await live.connect()
    await peer.send(push(b"q", b"late", b"", ttl_ms=60_000))
    await trio.testing.wait_all_tasks_blocked()
    await peer.send(push(b"q", b"soon", b"", ttl_ms=10))
    await trio.sleep(0.02)
    assert len(live.store) == 1  # swept at 10 ms, not at 60 s


# -- delayed pushes and long TTLs (decision 21), on virtual time ------------------------------


async def test_a_delayed_packet_is_popped_only_once_due(
    live: LiveServer, mock_clock: trio.testing.MockClock
) -> None:
    peer = await live.connect()
    await peer.send(push_options(b"q", b"k", b"later", delay_ms=500) + SYNC + pop(b"q"))
    assert await peer.reply() == []  # the sync: the push is applied
    assert await peer.reply() == []  # and the packet is in no queue yet
    assert live.store.queue_info(b"q").delayed == 1
    await trio.sleep(0.499)
    assert await peer.request(pop(b"q")) == []
    await trio.sleep(0.001)
    assert await peer.request(pop(b"q")) == [(b"k", b"later")]


async def test_a_delayed_packet_is_delivered_to_a_waiting_subscriber_when_due(
    live: LiveServer, mock_clock: trio.testing.MockClock
) -> None:
    pusher, subscriber = await live.connect(), await live.connect()
    await subscriber.send(subscribe(b"q") + READY)
    await pusher.send(push_options(b"q", b"k", b"later", delay_ms=60_000))
    await trio.testing.wait_all_tasks_blocked()
    await subscriber.expect_silence()
    await trio.sleep(60)  # the expiry timer lets it in and offers it: no frame is read
    assert await subscriber.reply() == [(b"k", b"later")]


async def test_a_71_with_no_delay_is_a_push_and_its_ttl_may_pass_65535_ms(
    live: LiveServer, mock_clock: trio.testing.MockClock
) -> None:
    peer = await live.connect()
    await peer.send(push_options(b"q", b"k", b"v", ttl_ms=100_000, delay_ms=0) + pop(b"q"))
    assert await peer.reply() == [(b"k", b"v")]
    await peer.send(push_options(b"q", b"k", b"v", ttl_ms=100_000, delay_ms=50_000))
    await trio.sleep(149.9)  # its TTL counts from its due time, 50 s after the push
    assert await peer.request(pop(b"q")) == [(b"k", b"v")]
    await peer.send(push_options(b"q", b"k", b"w", ttl_ms=100_000, delay_ms=50_000))
    await trio.sleep(150.1)
    assert await peer.request(pop(b"q")) == []


async def test_the_largest_71_frame_is_accepted(live: LiveServer) -> None:
    peer = await live.connect()
    big = b"x" * 0xFFFF
    frame = push_options(big, big, big, ttl_ms=0xFFFF_FFFF, delay_ms=1)
    assert len(frame) == 196_621
    await peer.send(frame + SYNC)
    assert await peer.reply() == []
    assert live.store.queue_info(big).delayed == 1


async def test_a_delay_above_30_days_closes_the_connection(live: LiveServer) -> None:
    peer = await live.connect()
    fine = push_options(b"q", b"k", b"30 days", delay_ms=2_592_000_000)
    await peer.send(fine + pop(b"q") + push_options(b"q", b"k", b"more", delay_ms=2_592_000_001))
    assert await peer.reply() == []  # the frames before it were applied
    await peer.expect_closed()
    assert live.store.queue_info(b"q").delayed == 1


# -- queues (decision 5) ----------------------------------------------------------------------


async def test_empty_queue_name_and_key(live: LiveServer) -> None:
    peer = await live.connect()
    await peer.send(push(b"", b"", b"payload") + pop(b"named"))
    assert await peer.reply() == []
    assert await peer.request(pop(b"")) == [(b"", b"payload")]


async def test_empty_queues_are_forgotten(live: LiveServer) -> None:
    peer = await live.connect()
    await peer.send(b"".join(push(b"q%d" % i, b"k", b"v") for i in range(100)))
    await peer.send(b"".join(pop(b"q%d" % i) for i in range(100)))
    for _ in range(100):
        assert len(await peer.reply()) == 1
    assert live.store.queue_count == 0


# -- subscriptions and credits (decisions 6 and 7) --------------------------------------------


async def test_subscribe_grants_no_credit(live: LiveServer) -> None:
    sub, pusher = await live.connect(), await live.connect()
    await sub.send(subscribe(b"q"))
    await pusher.send(push(b"q", b"k", b"v"))
    await sub.expect_silence()
    assert await pusher.request(pop(b"q")) == [(b"k", b"v")]


@pytest.mark.parametrize("credit_first", [True, False], ids=["credit first", "subscribe first"])
async def test_credit_before_or_after_subscribe(live: LiveServer, credit_first: bool) -> None:
    sub, pusher = await live.connect(), await live.connect()
    await sub.send(READY + subscribe(b"q") if credit_first else subscribe(b"q") + READY)
    await trio.testing.wait_all_tasks_blocked()
    await pusher.send(push(b"q", b"k", b"v"))
    assert await sub.reply() == [(b"k", b"v")]


async def test_subscribe_delivers_what_is_already_queued(live: LiveServer) -> None:
    sub, pusher = await live.connect(), await live.connect()
    await pusher.send(push(b"q", b"k", b"v"))
    await trio.testing.wait_all_tasks_blocked()
    await sub.send(READY + subscribe(b"q"))
    assert await sub.reply() == [(b"k", b"v")]


async def test_credits_accumulate_and_bound_deliveries(live: LiveServer) -> None:
    sub, pusher = await live.connect(), await live.connect()
    await sub.send(READY * 3 + subscribe(b"q"))
    await trio.testing.wait_all_tasks_blocked()
    await pusher.send(b"".join(push(b"q", b"k%d" % i, b"", prio=1) for i in range(5)))
    assert [await sub.reply() for _ in range(3)] == [[(b"k0", b"")], [(b"k1", b"")], [(b"k2", b"")]]
    await sub.expect_silence()
    await sub.send(READY)
    assert await sub.reply() == [(b"k4", b"")]  # the best now: newest of equal prio


async def test_push_reaches_a_waiting_subscriber_before_the_next_frame(live: LiveServer) -> None:
    sub, pusher = await live.connect(), await live.connect()
    await sub.send(READY + subscribe(b"q"))
    await trio.testing.wait_all_tasks_blocked()
    # In one write: the subscriber must have the packet before this pop is read.
    assert await pusher.request(push(b"q", b"k", b"v") + pop(b"q")) == []
    assert await sub.reply() == [(b"k", b"v")]


async def test_delivery_is_a_whole_key_group(live: LiveServer) -> None:
    sub, pusher = await live.connect(), await live.connect()
    await pusher.send(push(b"q", b"K", b"zero", prio=0) + pop(b"nothing"))
    await pusher.reply()
    await sub.send(READY + subscribe(b"q"))
    await trio.testing.wait_all_tasks_blocked()
    await sub.expect_silence()  # a prio-0 packet alone is not selectable
    await pusher.send(push(b"q", b"K", b"one", prio=1))
    assert await sub.reply() == [(b"K", b"one"), (b"K", b"zero")]


async def test_best_packet_across_subscribed_queues(live: LiveServer) -> None:
    sub, pusher = await live.connect(), await live.connect()
    await pusher.send(
        push(b"a", b"a5", b"", prio=5)
        + push(b"b", b"b2-old", b"", prio=2)
        + push(b"c", b"c2-new", b"", prio=2)
        + push(b"unsubscribed", b"u1", b"", prio=1)
        + pop(b"none")
    )
    await pusher.reply()
    await sub.send(subscribe(b"a") + subscribe(b"b") + subscribe(b"c") + READY * 3)
    assert [await sub.reply() for _ in range(3)] == [
        [(b"c2-new", b"")],
        [(b"b2-old", b"")],
        [(b"a5", b"")],
    ]


async def test_waiting_subscribers_are_served_first_come_first_served(live: LiveServer) -> None:
    first, second, third, pusher = [await live.connect() for _ in range(4)]
    for peer in (first, second, third):
        await peer.send(subscribe(b"q") + READY * 2)
        await trio.testing.wait_all_tasks_blocked()
    for i in range(6):
        await pusher.send(push(b"q", b"k%d" % i, b""))
        await trio.testing.wait_all_tasks_blocked()
    # Each delivery sends its receiver to the back of the line.
    assert [await first.reply(), await first.reply()] == [[(b"k0", b"")], [(b"k3", b"")]]
    assert [await second.reply(), await second.reply()] == [[(b"k1", b"")], [(b"k4", b"")]]
    assert [await third.reply(), await third.reply()] == [[(b"k2", b"")], [(b"k5", b"")]]


async def test_unsubscribe_keeps_credits(live: LiveServer) -> None:
    sub, pusher = await live.connect(), await live.connect()
    await sub.send(subscribe(b"a") + READY + unsubscribe(b"a") + subscribe(b"b"))
    await trio.testing.wait_all_tasks_blocked()
    await pusher.send(push(b"a", b"ka", b""))
    await trio.testing.wait_all_tasks_blocked()
    await sub.expect_silence()
    await pusher.send(push(b"b", b"kb", b""))
    assert await sub.reply() == [(b"kb", b"")]


async def test_redundant_subscribe_and_unsubscribe_are_ignored(live: LiveServer) -> None:
    sub, pusher = await live.connect(), await live.connect()
    await sub.send(unsubscribe(b"q") + subscribe(b"q") + subscribe(b"q") + READY)
    await trio.testing.wait_all_tasks_blocked()
    await pusher.send(push(b"q", b"k1", b"") + push(b"q", b"k2", b""))
    assert await sub.reply() == [(b"k1", b"")]
    await sub.expect_silence()  # one credit, one delivery, despite two subscribes
    await sub.send(unsubscribe(b"q") + unsubscribe(b"q") + READY)
    await sub.expect_silence()
    assert await pusher.request(pop(b"q")) == [(b"k2", b"")]


async def test_closing_drops_subscriptions_and_credits(live: LiveServer) -> None:
    sub, pusher = await live.connect(), await live.connect()
    await sub.send(subscribe(b"q") + READY * 5)
    await trio.testing.wait_all_tasks_blocked()
    await sub.aclose()
    await trio.testing.wait_all_tasks_blocked()
    await pusher.send(push(b"q", b"k", b"v"))
    assert await pusher.request(pop(b"q")) == [(b"k", b"v")]
    assert live.server.broker.subscriptions.waiting(b"q") == []


async def test_frame_cut_short_by_close_is_discarded(live: LiveServer) -> None:
    cut, other = await live.connect(), await live.connect()
    frame = push(b"q", b"k", b"never lands")
    await cut.send(push(b"q", b"k0", b"lands") + frame[:-1])
    await cut.aclose()
    await trio.testing.wait_all_tasks_blocked()
    assert await other.request(pop(b"q")) == [(b"k0", b"lands")]
    assert await other.request(pop(b"q")) == []
    assert live.server.connections == 1


# -- one stream of frames (decision 8) --------------------------------------------------------


async def test_pop_replies_come_in_request_order(live: LiveServer) -> None:
    peer = await live.connect()
    await peer.send(b"".join(push(b"q%d" % i, b"k", b"%d" % i) for i in range(20)))
    await peer.send(b"".join(pop(b"q%d" % i) for i in reversed(range(20))))
    assert [await peer.reply() for _ in range(20)] == [
        [(b"k", b"%d" % i)] for i in reversed(range(20))
    ]


async def test_deliveries_and_pop_replies_share_a_connection_intact(live: LiveServer) -> None:
    both, pusher = await live.connect(), await live.connect()
    await both.send(subscribe(b"sub") + READY * 50)
    await trio.testing.wait_all_tasks_blocked()
    big = b"x" * 60_000
    for i in range(50):
        # Confirmed (sync) before the pop on the other connection: the server keeps no order
        # between connections, and serves one chunk of each a turn (the 60 kB push may take
        # more turns than the pop).
        pushes = push(b"sub", b"d%d" % i, big) + push(b"own", b"p%d" % i, b"y")
        assert await pusher.request(pushes + SYNC) == []
        await both.send(pop(b"own"))
    replies = [await both.reply() for _ in range(100)]
    assert sorted(r[0][0] for r in replies) == sorted(
        [b"d%d" % i for i in range(50)] + [b"p%d" % i for i in range(50)]
    )
    assert all(r[0][1] in (big, b"y") for r in replies)


# -- bad input (decision 9) -------------------------------------------------------------------


async def test_unknown_opcode_closes_only_that_connection(
    live: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    bad, good = await live.connect(), await live.connect()
    await good.send(push(b"q", b"g", b"good"))
    before = push(b"q", b"b", b"before") + pop(b"empty")
    after = push(b"q", b"a", b"after")
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        await bad.send(before + b"\x99" + after)
        assert await bad.reply() == []  # frames before the bad byte were applied and answered
        await bad.expect_closed()
    assert await good.request(pop(b"q")) == [(b"b", b"before")]
    assert await good.request(pop(b"q")) == [(b"g", b"good")]
    assert await good.request(pop(b"q")) == []  # the frame after the bad byte was not
    [record] = [
        r for r in caplog.records if r.name == "pinpriq.server" and r.levelno == logging.WARNING
    ]
    message = record.getMessage()
    assert "127.0.0.1:" in message
    assert f"offset {len(before)}" in message
    assert "0x99" in message


@pytest.mark.parametrize("opcode", [0x00, 0x42, 0x51, 0x72, 0x74, 0x76, 0xFF])
async def test_every_unknown_opcode_closes(live: LiveServer, opcode: int) -> None:
    peer = await live.connect()
    await peer.send(bytes([opcode]))
    await peer.expect_closed()


# -- framing over TCP -------------------------------------------------------------------------


async def test_a_thousand_pipelined_frames_in_one_write(live: LiveServer) -> None:
    peer = await live.connect()
    frames = [push(b"q", b"k%03d" % i, b"v%d" % i, prio=1 + i % 255) for i in range(500)]
    frames += [pop(b"q")] * 500
    await peer.send(b"".join(frames))
    replies = [await peer.reply() for _ in range(500)]
    expected = sorted(range(500), key=lambda i: (1 + i % 255, -i))
    assert replies == [[(b"k%03d" % i, b"v%d" % i)] for i in expected]


async def test_maximum_size_frame(live: LiveServer) -> None:
    peer = await live.connect()
    queue, key, payload = b"q" * 65535, b"k" * 65535, b"p" * 65535
    frame = push(queue, key, payload, ttl_ms=65535, prio=255)
    assert len(frame) == 196_615
    await peer.send(frame)
    assert await peer.request(pop(queue)) == [(key, payload)]


async def test_frames_sent_one_byte_at_a_time(live: LiveServer) -> None:
    peer = await live.connect()
    stream = push(b"queue", b"key", b"payload", ttl_ms=1000, prio=3) + subscribe(b"x") + READY
    stream += unsubscribe(b"x") + pop(b"queue")
    for byte in stream:
        await peer.send(bytes([byte]))
        await trio.testing.wait_all_tasks_blocked()
    assert await peer.reply() == [(b"key", b"payload")]


async def test_disconnect_mid_frame_changes_nothing(live: LiveServer) -> None:
    peer = await live.connect()
    await peer.send(push(b"q", b"k", b"v"))
    for cut in (1, 3, 9, 12):
        dying = await live.connect()
        await dying.send(push(b"q", b"dead", b"payload")[:cut])
        await dying.aclose()
    dying = await live.connect()
    await dying.send(pop(b"q")[:2])
    await dying.aclose()
    await trio.testing.wait_all_tasks_blocked()
    assert await peer.request(pop(b"q")) == [(b"k", b"v")]
    assert len(live.store) == 0


async def test_a_subscriber_that_stops_reading_stalls_no_one(live: LiveServer) -> None:
    stuck, pusher, other = await live.connect(), await live.connect(), await live.connect()
    await stuck.send(subscribe(b"q") + READY * 1000)
    await trio.testing.wait_all_tasks_blocked()
    payload = b"x" * 65535
    with trio.fail_after(10):
        for i in range(300):  # ~20 MB, far beyond the socket buffers and the output bound
            await pusher.send(push(b"q", b"k%d" % i, payload))
        assert await pusher.request(pop(b"empty")) == []
        await other.send(push(b"mine", b"k", b"v"))
        assert await other.request(pop(b"mine")) == [(b"k", b"v")]
    # Deliveries stopped at the stuck subscriber's output bound: the rest stays queued, for
    # others to take and for the memory cap to count.
    assert len(live.store) > 200
    [(taken, _)] = await other.request(pop(b"q"))
    with trio.fail_after(10):  # once it reads again, deliveries resume
        delivered = [(await stuck.reply())[0][0] for _ in range(299)]
    assert sorted([taken, *delivered]) == sorted(b"k%d" % i for i in range(300))


async def test_connection_count_returns_to_zero(live: LiveServer) -> None:
    peers = [await live.connect() for _ in range(20)]
    await trio.testing.wait_all_tasks_blocked()
    assert live.server.connections == 20
    for peer in peers:
        await peer.aclose()
    await trio.testing.wait_all_tasks_blocked()
    assert live.server.connections == 0


def test_reply_helper_matches_the_protocol_table() -> None:
    # The test helpers are themselves pinned against the protocol's byte layouts.
    assert push(b"q", b"k", b"p", 5, 2) == bytes.fromhex("70 0001 0005 02 0001 0001") + b"kpq"
    assert pop(b"ab") == bytes.fromhex("50 0002") + b"ab"
    assert subscribe(b"ab") == bytes.fromhex("73 0002") + b"ab"
    assert unsubscribe(b"") == bytes.fromhex("75 0000")
    assert reply((b"k", b"pp"), (b"", b"")) == bytes.fromhex("0002 0001 0002 6b7070 0000 0000")


async def test_a_closed_connection_leaves_no_reference_cycle(live: LiveServer) -> None:
    # Objects in reference cycles wait for the cyclic collector, which pinpriq-server runs
    # rarely: a connection that left one behind would grow memory under connection churn.
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for frames in (push(b"q", b"k", b"v") + pop(b"q"), subscribe(b"s") + READY, b"\x99"):
            for _ in range(5):
                peer = await live.connect()
                await peer.send(frames)
                await trio.testing.wait_all_tasks_blocked()
                await peer.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert live.server.connections == 0
        gc.collect()
        left = [
            type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("pinpriq")
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []


async def test_serve_runs_a_fresh_server_until_cancelled(nursery: trio.Nursery) -> None:
    listeners = await nursery.start(partial(serve, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    peer = Peer(stream)
    try:
        assert await peer.request(push(b"q", b"k", b"v") + pop(b"q")) == [(b"k", b"v")]
    finally:
        await peer.aclose()
