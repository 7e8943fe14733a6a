"""The broker without any I/O: whole conversations driven through ``Session.receive`` with a
fake clock, no event loop and no socket. What comes out is checked byte for byte against
replies built by hand (``tests.rawpeer``)."""

from __future__ import annotations

import logging
from typing import NamedTuple

import pytest

from pinpriq.broker import OUTPUT_HIGH_WATER, Blocked, Broker, Session
from pinpriq.store import PACKET_OVERHEAD, QueueStore
from pinpriq.wire import (
    FRAMES,
    READY,
    SYNC,
    Ack,
    ClientFrame,
    LeasedSubscribe,
    Pop,
    Push,
    Release,
    Reserve,
    Subscribe,
    Touch,
    Unsubscribe,
)
from tests.rawpeer import reply


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def broker_with(clock: FakeClock, **options: int) -> Broker:
    return Broker(QueueStore(clock), **options)


def take(session: Session) -> bytes:
    """What the session owes its client, as the driver would write it."""
    data = bytes(session.output)
    session.output.clear()
    session.output_drained()
    return data


def test_a_conversation_is_bytes_out_for_frames_in(clock: FakeClock) -> None:
    session = broker_with(clock).open_session()
    frames: list[ClientFrame] = [
        Push(b"q", b"k1", b"a", 0, 2),
        Push(b"q", b"k2", b"b", 0, 1),
        SYNC,
        Pop(b"q"),
        Pop(b"q"),
        Pop(b"q"),
    ]
    assert session.receive(frames) == len(frames)
    assert session.blocked is None
    assert take(session) == reply() + reply((b"k2", b"b")) + reply((b"k1", b"a")) + reply()


def test_every_frame_of_the_protocol_is_handled(clock: FakeClock) -> None:
    session = broker_with(clock).open_session()
    examples = {Push: Push(b"q", b"k", b"v"), Pop: Pop(b"q"), Subscribe: Subscribe(b"q")}
    examples |= {Unsubscribe: Unsubscribe(b"q"), type(READY): READY, type(SYNC): SYNC}
    examples |= {Reserve: Reserve(b"q"), Ack: Ack(1), Release: Release(2), Touch: Touch(3)}
    examples |= {LeasedSubscribe: LeasedSubscribe(b"r")}  # last: then the connection is leased
    assert set(examples) == set(FRAMES.values())
    assert session.receive(list(examples.values())) == len(examples)
    assert session.error is None


def test_a_frame_the_broker_does_not_know_is_an_error_not_a_fall_through(
    clock: FakeClock,
) -> None:
    class Frobnicate(NamedTuple):
        queue: bytes

    session = broker_with(clock).open_session()
    session.receive([Subscribe(b"q")])
    with pytest.raises(TypeError, match="no handler for Frobnicate frames"):
        session.receive([Frobnicate(b"q")])  # type: ignore[list-item]
    assert session.queues == {b"q"}  # not taken for an unsubscribe, or anything else


def test_a_push_is_delivered_to_a_waiting_session_and_filed_for_writing(
    clock: FakeClock,
) -> None:
    broker = broker_with(clock)
    pusher, subscriber = broker.open_session(), broker.open_session()
    subscriber.receive([Subscribe(b"q"), READY])
    assert broker.take_dirty() == []
    pusher.receive([Push(b"q", b"k", b"v"), SYNC])
    assert broker.take_dirty() == [subscriber]
    assert take(subscriber) == reply((b"k", b"v"))
    assert take(pusher) == reply()  # the sync: the push, and its delivery, are done
    assert broker.totals().delivered == 1


def test_a_delivery_to_the_pusher_itself_comes_before_its_next_reply(clock: FakeClock) -> None:
    session = broker_with(clock).open_session()
    session.receive([Subscribe(b"sub"), READY, Push(b"sub", b"k", b"d"), Pop(b"own")])
    assert take(session) == reply((b"k", b"d")) + reply()


def test_closing_a_session_drops_its_subscriptions(clock: FakeClock) -> None:
    broker = broker_with(clock)
    gone, other = broker.open_session(), broker.open_session()
    gone.receive([Subscribe(b"q"), READY])
    gone.close()
    gone.close()  # idempotent
    assert broker.sessions == 1
    other.receive([Push(b"q", b"k", b"v"), Pop(b"q")])
    assert take(other) == reply((b"k", b"v"))
    assert take(gone) == b""


def test_totals_count_every_packet_once(clock: FakeClock) -> None:
    broker = broker_with(clock)
    session, subscriber = broker.open_session(), broker.open_session()
    session.receive([Push(b"q", b"k", b"1"), Push(b"q", b"k", b"2", 0, 0), Push(b"q", b"x", b"3")])
    session.receive([Push(b"q", b"t", b"", 125, 9), Pop(b"q")])  # pops x
    subscriber.receive([Subscribe(b"q"), READY])  # delivered: the k group, 2 packets
    session.receive([Push(b"q", b"held", b"", 0, 0)])
    clock.now += 0.125
    assert broker.expire() == 1
    assert broker.totals() == (5, 1, 2, 1)  # pushed, popped, delivered, expired; 1 held


def test_the_timer_is_the_earliest_deadline(clock: FakeClock) -> None:
    broker = broker_with(clock)
    session = broker.open_session()
    session.receive([Push(b"q", b"a", b"", 500, 1)])
    assert broker.timer == 1000.5
    session.receive([Push(b"q", b"b", b"", 250, 1), Push(b"q", b"c", b"", 1000, 1)])
    assert broker.timer == 1000.25
    clock.now = 1000.25
    broker.expire()
    assert broker.timer == 1000.5


# -- the memory cap ---------------------------------------------------------------------------

PACKET = len(b"kNN") + len(b"v") + PACKET_OVERHEAD  # what each test packet counts


def pushes(count: int, start: int = 0, prio: int = 1) -> list[ClientFrame]:
    return [Push(b"q", b"k%02d" % i, b"v", 0, prio) for i in range(start, start + count)]


def test_pushes_wait_at_the_cap_and_resume_only_below_the_low_water_mark(
    clock: FakeClock,
) -> None:
    broker = broker_with(clock, max_memory=10 * PACKET)
    rooms: list[int] = []
    broker.on_room = lambda: rooms.append(len(broker.store))
    producer, consumer = broker.open_session(), broker.open_session()
    frames = pushes(12)
    done = producer.receive(frames)
    assert (done, producer.blocked, broker.memory_full) == (10, Blocked.MEMORY, True)
    consumer.receive([Pop(b"q")])  # 9 held: 90% of the cap, not below it
    assert broker.memory_full
    assert producer.receive(frames, done) == done  # still waiting
    consumer.receive([Pop(b"q")])  # 8 held: below 90%
    assert (broker.memory_full, rooms) == (False, [8])
    assert producer.receive(frames, done) == 12
    assert producer.blocked is None


def test_the_cap_log_says_how_much_is_held_by_prio_0_packets(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    broker = broker_with(clock, max_memory=10 * PACKET)
    session = broker.open_session()
    with caplog.at_level(logging.WARNING, logger="pinpriq.broker"):
        session.receive(pushes(4, prio=1) + pushes(6, start=4, prio=0))
    [record] = caplog.records
    assert f"{10 * PACKET} bytes held, cap {10 * PACKET}" in record.getMessage()
    assert f"{6 * PACKET} of the held bytes are prio-0 packets" in record.getMessage()


def test_expiry_can_make_room(clock: FakeClock) -> None:
    broker = broker_with(clock, max_memory=2 * PACKET)
    rooms: list[bool] = []
    broker.on_room = lambda: rooms.append(True)
    session = broker.open_session()
    session.receive([Push(b"q", b"k00", b"v", 125, 0), Push(b"q", b"k01", b"v", 125, 0)])
    assert broker.memory_full
    clock.now += 0.125
    broker.expire()
    assert (broker.memory_full, rooms) == (False, [True])


# -- the output bound -------------------------------------------------------------------------

BIG = b"x" * 60_000


def test_a_session_that_owes_too_much_stops_applying_frames(clock: FakeClock) -> None:
    session = broker_with(clock).open_session()
    count = OUTPUT_HIGH_WATER // len(BIG) + 10
    session.receive([Push(b"q", b"%04d" % i, BIG) for i in range(count)])
    pops: list[ClientFrame] = [Pop(b"q")] * count
    done = session.receive(pops)
    assert session.blocked is Blocked.OUTPUT
    assert len(session.output) > OUTPUT_HIGH_WATER >= len(session.output) - len(BIG) - 10
    take(session)
    assert session.receive(pops, done) == count


def test_a_subscriber_past_the_bound_is_paused_and_resumes_when_drained(
    clock: FakeClock,
) -> None:
    broker = broker_with(clock)
    subscriber, pusher, other = broker.open_session(), broker.open_session(), broker.open_session()
    subscriber.receive([Subscribe(b"q"), *[READY] * 1000])
    count = OUTPUT_HIGH_WATER // len(BIG) + 1
    pusher.receive([Push(b"q", b"%04d" % i, BIG) for i in range(count + 5)])
    assert subscriber.paused
    assert len(broker.store) == 5  # the rest stays queued, for others
    other.receive([Pop(b"q")])
    assert take(other) != reply()
    take(subscriber)  # the driver wrote it all: deliveries go on
    assert len(broker.store) == 0
