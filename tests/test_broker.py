"""The broker without any I/O: whole conversations driven through ``Session.receive`` with a
fake clock, no event loop and no socket. What comes out is checked byte for byte against
replies built by hand (``tests.rawpeer``)."""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from typing import NamedTuple

import pytest

from pinpriq import packed
from pinpriq.broker import OUTPUT_HIGH_WATER, Blocked, Broker, Session
from pinpriq.store import PACKET_OVERHEAD, QueuedPacket, QueueStore
from pinpriq.wire import (
    FRAMES,
    READY,
    SYNC,
    Ack,
    Auth,
    ClientFrame,
    DelayedPush,
    LeasedSubscribe,
    Opcode,
    Pop,
    Push,
    Release,
    Reserve,
    Subscribe,
    Touch,
    Unsubscribe,
)
from tests.rawpeer import LEASED_NOTHING, lease_reply, reply, status


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def broker_with(clock: FakeClock, *, token: bytes | None = None, **options: int) -> Broker:
    return Broker(QueueStore(clock), token=token, **options)


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
    broker = broker_with(clock)
    examples = {Push: Push(b"q", b"k", b"v"), Pop: Pop(b"q"), Subscribe: Subscribe(b"q")}
    examples |= {Unsubscribe: Unsubscribe(b"q"), type(READY): READY, type(SYNC): SYNC}
    examples |= {Auth: Auth(b"any token: this broker has none")}
    examples |= {DelayedPush: DelayedPush(b"q", b"k", b"v", 0, 1, 1000)}
    # Lease frames on a connection of their own: never with a plain subscribe (decision 20).
    lease_examples = {Reserve: Reserve(b"q"), Ack: Ack(1), Release: Release(2), Touch: Touch(3)}
    lease_examples |= {LeasedSubscribe: LeasedSubscribe(b"r")}  # last: the connection is leased
    assert set(examples) | set(lease_examples) == set(FRAMES.values())
    for frames in (examples, lease_examples):
        session = broker.open_session()
        assert session.receive(list(frames.values())) == len(frames)
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
    assert broker.totals() == (5, 1, 2, 1, 0)  # pushed, popped, delivered, expired; 1 held
    assert broker.purge(b"q") == 1
    assert broker.totals() == (5, 1, 2, 1, 1)  # and purged; none held


def test_subscribers_are_counted_per_queue_and_in_all(clock: FakeClock) -> None:
    broker = broker_with(clock)
    subs = broker.subscriptions
    one, two = broker.open_session(), broker.open_session()
    one.receive([Subscribe(b"a"), Subscribe(b"b"), Subscribe(b"a"), READY])
    two.receive([Subscribe(b"a")])
    assert (subs.subscribers, subs.subscriber_count) == ({b"a": 2, b"b": 1}, 2)
    one.receive([Unsubscribe(b"b"), Unsubscribe(b"b")])
    assert (subs.subscribers, subs.subscriber_count) == ({b"a": 2}, 2)
    two.receive([Unsubscribe(b"a")])
    one.close()
    assert (subs.subscribers, subs.subscriber_count) == ({}, 0)


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


def test_a_purge_makes_room_and_wakes_waiting_pushers(clock: FakeClock) -> None:
    # A cap full of prio-0 packets frees itself only by a purge (or expiry).
    broker = broker_with(clock, max_memory=10 * PACKET)
    rooms: list[int] = []
    broker.on_room = lambda: rooms.append(len(broker.store))
    producer = broker.open_session()
    frames = pushes(12, prio=0)
    done = producer.receive(frames)
    assert (done, producer.blocked) == (10, Blocked.MEMORY)
    assert broker.purge(b"q") == 10
    assert (broker.memory_full, rooms, broker.store.bytes_held) == (False, [0], 0)
    assert producer.receive(frames, done) == 12


# -- the output bound -------------------------------------------------------------------------

BIG = b"x" * 60_000


class PoppedElsewhere(QueueStore):
    """A store whose pops run before ``receive`` (as a ``BatchedStore``'s, in ``run``)."""

    def pop(self, queue: bytes) -> list[QueuedPacket]:
        raise AssertionError("the broker called pop on a store whose pops already ran")


def test_pops_that_already_ran_are_answered_in_order_from_the_results_given(
    clock: FakeClock,
) -> None:
    session = Broker(PoppedElsewhere(clock)).open_session()
    popped = deque([[(b"k1", b"a"), (b"k2", b"b")], []])
    frames: list[ClientFrame] = [Pop(b"q"), SYNC, Push(b"q", b"k", b"v"), Pop(b"r")]
    assert session.receive(frames, 0, popped) == len(frames)
    assert take(session) == reply((b"k1", b"a"), (b"k2", b"b")) + reply() + reply()
    assert not popped  # each result answered once


def test_a_batch_stopped_by_a_wait_goes_on_with_the_results_it_was_given(
    clock: FakeClock,
) -> None:
    """Each call carries its own results, so sessions waiting mid-batch share none."""
    broker = Broker(PoppedElsewhere(clock))
    first, second = broker.open_session(), broker.open_session()
    count = OUTPUT_HIGH_WATER // len(BIG) + 10
    pops: list[ClientFrame] = [Pop(b"q")] * count
    mine = deque([[(b"k", BIG)]] * count)
    done = first.receive(pops, 0, mine)
    assert first.blocked is Blocked.OUTPUT
    second.receive([Pop(b"q")], 0, deque([[(b"other", b"x")]]))
    assert take(second) == reply((b"other", b"x"))
    take(first)
    assert first.receive(pops, done, mine) == count
    assert not mine


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


# -- auth (decision 12) -----------------------------------------------------------------------

TOKEN = b"the right token"


def test_the_right_token_first_is_answered_and_the_rest_of_the_batch_applied(
    clock: FakeClock,
) -> None:
    broker = broker_with(clock, token=TOKEN)
    session = broker.open_session()
    assert not session.authenticated
    frames: list[ClientFrame] = [Auth(TOKEN), Push(b"q", b"k", b"v"), Pop(b"q")]
    assert session.receive(frames) == 3
    assert session.authenticated
    assert take(session) == reply() + reply((b"k", b"v"))


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([Auth(b"the wrong token"), Push(b"q", b"k", b"v")], "a wrong token"),
        ([Auth(b""), Push(b"q", b"k", b"v")], "a wrong token"),
        ([Auth(TOKEN + b"!"), Push(b"q", b"k", b"v")], "a wrong token"),
        ([Push(b"q", b"k", b"v"), Auth(TOKEN)], "a push before auth"),
        ([SYNC, Auth(TOKEN)], "a sync before auth"),
        ([Unsubscribe(b"q")], "an unsubscribe before auth"),
    ],
)
def test_anything_but_the_right_token_first_is_rejected_and_nothing_applied(
    clock: FakeClock, frames: list[ClientFrame], reason: str
) -> None:
    broker = broker_with(clock, token=TOKEN)
    session = broker.open_session()
    assert session.receive(frames) == 0
    assert (session.blocked, session.rejected) == (Blocked.REJECTED, reason)
    assert TOKEN not in session.rejected.encode()
    assert not session.authenticated
    assert session.output == b""  # no answer: the driver closes the connection
    assert len(broker.store) == 0
    assert session.receive(frames) == 0  # final: asking again applies nothing either
    assert len(broker.store) == 0


def test_an_empty_batch_before_auth_is_no_rejection(clock: FakeClock) -> None:
    session = broker_with(clock, token=TOKEN).open_session()
    assert session.receive([]) == 0
    assert (session.blocked, session.rejected, session.authenticated) == (None, None, False)


def test_a_session_without_the_token_is_refused_at_the_first_byte(clock: FakeClock) -> None:
    session = broker_with(clock, token=TOKEN).open_session()
    assert session.opens_with(Opcode.AUTH)
    assert session.rejected is None
    assert not session.opens_with(Opcode.PUSH)
    assert (session.blocked, session.rejected) == (Blocked.REJECTED, "a push before auth")
    other = broker_with(clock, token=TOKEN).open_session()
    assert not other.opens_with(0x16)  # a TLS handshake on a plain port
    assert other.rejected == "byte 0x16, not an opcode, before auth"


def test_without_a_token_any_auth_is_answered_and_the_first_byte_never_matters(
    clock: FakeClock,
) -> None:
    session = broker_with(clock).open_session()
    assert session.authenticated
    assert session.opens_with(Opcode.PUSH)
    frames: list[ClientFrame] = [Push(b"q", b"k", b"v"), Auth(b"whatever"), Auth(b""), Pop(b"q")]
    assert session.receive(frames) == 4
    assert take(session) == reply() + reply() + reply((b"k", b"v"))


def test_a_second_auth_is_answered_if_right_and_rejected_if_wrong(clock: FakeClock) -> None:
    broker = broker_with(clock, token=TOKEN)
    session = broker.open_session()
    frames: list[ClientFrame] = [
        Auth(TOKEN),
        Push(b"q", b"k1", b"v"),
        Auth(TOKEN),
        Pop(b"q"),
        Push(b"q", b"k2", b"v"),
        Auth(b"guess"),
        Push(b"q", b"k3", b"v"),
    ]
    assert session.receive(frames) == 5  # stops at the wrong auth
    assert session.blocked is Blocked.REJECTED
    assert session.rejected == "a wrong token in a second auth"
    # The frames before it were applied and answered (decision 9); nothing after it was.
    assert take(session) == reply() + reply() + reply((b"k1", b"v"))
    assert [packet[0] for packet in broker.store.pop(b"q")] == [b"k2"]
    assert len(broker.store) == 0


# -- leases (decisions 13-18) -----------------------------------------------------------------


def test_reserve_ack_release_touch_conversation(clock: FakeClock) -> None:
    broker = broker_with(clock)
    session = broker.open_session()
    session.receive([Push(b"q", b"k", b"a", 0, 2), Push(b"q", b"j", b"b", 0, 1)])
    session.receive([Reserve(b"q", 500), Reserve(b"q"), Reserve(b"q"), Touch(1, 2000)])
    session.receive([Ack(1), Ack(1), Release(2, 0), Pop(b"q")])
    assert take(session) == (
        lease_reply(1, 1, (b"j", b"b"))
        + lease_reply(2, 1, (b"k", b"a"))
        + LEASED_NOTHING  # nothing left to take
        + status(1, True)  # touched
        + status(1, True)  # acked
        + status(1, False)  # acked already
        + status(2, True)  # released: back at once...
        + reply((b"k", b"a"))  # ...for the pop to find
    )
    assert broker.lease_totals() == (0, 1, 1, 0, 0, 1)
    assert broker.totals() == (2, 1, 0, 0, 0)  # pushed, popped (k after its release), ...


def test_lease_ids_are_per_connection(clock: FakeClock) -> None:
    broker = broker_with(clock)
    one, two = broker.open_session(), broker.open_session()
    one.receive([Push(b"q", b"%d" % i, b"", 0, 1) for i in range(3)])
    one.receive([Reserve(b"q")])
    two.receive([Reserve(b"q"), Ack(1)])
    one.receive([Reserve(b"q"), Ack(2)])
    assert take(one) == lease_reply(1, 1, (b"2", b"")) + lease_reply(2, 1, (b"0", b"")) + status(
        2, True
    )
    assert take(two) == lease_reply(1, 1, (b"1", b"")) + status(1, True)


def test_a_lease_deadline_is_on_the_one_timer_and_its_packets_go_to_a_waiting_subscriber(
    clock: FakeClock,
) -> None:
    broker = broker_with(clock)
    worker, subscriber = broker.open_session(), broker.open_session()
    worker.receive([Push(b"q", b"k", b"v", 0, 1), Reserve(b"q", 250)])
    subscriber.receive([Subscribe(b"q"), READY])
    assert broker.timer == 1000.25
    clock.now = 1000.25
    broker.expire()
    assert broker.take_dirty() == [subscriber]
    assert take(subscriber) == reply((b"k", b"v"))  # a plain subscriber gets it as a push's
    assert broker.timer == math.inf
    worker.receive([Ack(1)])
    assert take(worker) == lease_reply(1, 1, (b"k", b"v")) + status(1, False)


def test_closing_a_connection_returns_its_leases_to_waiting_subscribers(clock: FakeClock) -> None:
    broker = broker_with(clock)
    worker, subscriber = broker.open_session(), broker.open_session()
    subscriber.receive([LeasedSubscribe(b"q", 1000), READY])
    worker.receive([Push(b"other", b"k", b"v", 0, 1), Reserve(b"other")])
    subscriber.receive([LeasedSubscribe(b"other")])  # the latest lease time is the default
    worker.close()
    assert broker.take_dirty() == [subscriber]
    assert take(subscriber) == lease_reply(1, 2, (b"k", b"v"))  # its second attempt
    assert broker.timer == 1030.0  # the default lease time: 30 s


def test_release_with_a_delay_sets_the_timer(clock: FakeClock) -> None:
    broker = broker_with(clock)
    session = broker.open_session()
    session.receive([Push(b"q", b"k", b"v", 0, 1), Reserve(b"q", 60_000), Release(1, 125)])
    assert broker.timer == 1000.125
    session.receive([Pop(b"q")])
    clock.now = 1000.125
    broker.expire()
    session.receive([Pop(b"q")])
    assert take(session).endswith(reply() + reply((b"k", b"v")))


def test_a_leased_connection_gets_the_11_byte_header_on_everything(clock: FakeClock) -> None:
    broker = broker_with(clock)
    worker, pusher = broker.open_session(), broker.open_session()
    worker.receive([SYNC, LeasedSubscribe(b"q", 500), READY, READY, SYNC])
    pusher.receive([Push(b"q", b"a", b"1", 0, 1), Push(b"q", b"b", b"2", 0, 1)])
    worker.receive([Touch(2), Ack(1), SYNC, Push(b"q", b"c", b"3", 0, 1)])
    assert take(worker) == (
        reply()  # a sync before the leased subscribe: still the 2-byte answer
        + LEASED_NOTHING  # a sync after it
        + lease_reply(1, 1, (b"a", b"1"))
        + lease_reply(2, 1, (b"b", b"2"))
        + status(2, True)
        + status(1, True)
        + LEASED_NOTHING
    )  # and no credit for the third packet: acks grant none (decision 17)
    assert len(broker.store) == 1


@pytest.mark.parametrize(
    ("first", "offending", "reason"),
    [
        (LeasedSubscribe(b"q"), Pop(b"q"), "a pop on a leased connection"),
        (LeasedSubscribe(b"q"), Subscribe(b"r"), "a plain subscribe on a leased connection"),
        (LeasedSubscribe(b"q"), Reserve(b"q"), "a reserve on a leased connection"),
    ],
)
def test_mixing_leased_and_plain_frames_is_refused(
    clock: FakeClock, first: ClientFrame, offending: ClientFrame, reason: str
) -> None:
    session = broker_with(clock).open_session()
    frames: list[ClientFrame] = [first, SYNC, offending, SYNC]
    assert session.receive(frames) == 2  # the frames before it are applied, it and after not
    assert session.error is not None
    assert session.error.startswith(reason)
    assert "decision 18" in session.error
    assert take(session) in (reply(), LEASED_NOTHING)


def test_a_pop_in_the_same_batch_as_the_leased_subscribe_is_refused(clock: FakeClock) -> None:
    session = broker_with(clock).open_session()
    assert session.receive([Pop(b"q"), LeasedSubscribe(b"q"), Pop(b"q")]) == 2
    assert session.error == "a pop on a leased connection (decision 18)"


@pytest.mark.parametrize(
    ("first", "offending", "reason"),
    [
        (Subscribe(b"q"), Reserve(b"q"), "a reserve on a connection that sent a plain subscribe"),
        (Subscribe(b"q"), Ack(1), "an ack on a connection that sent a plain subscribe"),
        (Subscribe(b"q"), Release(1), "a release on a connection that sent a plain subscribe"),
        (Subscribe(b"q"), Touch(1), "a touch on a connection that sent a plain subscribe"),
        (
            Subscribe(b"q"),
            LeasedSubscribe(b"r"),
            "a leased subscribe on a connection that sent a plain",
        ),
        (Reserve(b"none"), Subscribe(b"q"), "a plain subscribe on a connection that sent lease"),
        (Ack(1), Subscribe(b"q"), "a plain subscribe on a connection that sent lease"),
        (Release(1), Subscribe(b"q"), "a plain subscribe on a connection that sent lease"),
        (Touch(1), Subscribe(b"q"), "a plain subscribe on a connection that sent lease"),
    ],
)
def test_plain_subscriptions_and_lease_frames_never_share_a_connection(
    clock: FakeClock, first: ClientFrame, offending: ClientFrame, reason: str
) -> None:
    broker = broker_with(clock)
    session = broker.open_session()
    broker.open_session().receive([Push(b"q", b"k", b"v", 0, 1)])
    frames: list[ClientFrame] = [first, SYNC, offending, Push(b"q", b"after", b"", 0, 1)]
    assert session.receive(frames) == 2  # decision 20: the frames before it are applied
    assert session.error is not None
    assert session.error.startswith(reason)
    assert session.error.endswith("(decision 20)")
    assert len(broker.store) == 1  # none taken by a refused reserve; the push after it not made


def test_an_unsubscribe_does_not_undo_a_plain_subscription(clock: FakeClock) -> None:
    # Decision 20: deliveries made before the unsubscribe was read may still be on their way.
    session = broker_with(clock).open_session()
    frames: list[ClientFrame] = [Subscribe(b"q"), Unsubscribe(b"q"), SYNC, LeasedSubscribe(b"q")]
    assert session.receive(frames) == 3
    assert session.error == (
        "a leased subscribe on a connection that sent a plain subscribe (decision 20)"
    )
    assert take(session) == reply()  # the sync: still a plain connection


def test_a_pop_and_a_reserve_share_a_connection_with_no_subscription(clock: FakeClock) -> None:
    session = broker_with(clock).open_session()
    frames: list[ClientFrame] = [Push(b"q", b"a", b"1", 0, 1), Push(b"q", b"b", b"2", 0, 2)]
    frames += [Reserve(b"q"), Pop(b"q"), Ack(1), Pop(b"q"), SYNC]
    assert session.receive(frames) == len(frames)
    assert session.error is None
    assert take(session) == (
        lease_reply(1, 1, (b"a", b"1")) + reply((b"b", b"2")) + status(1, True) + reply() + reply()
    )


def test_leased_packets_count_against_the_cap_and_an_ack_makes_room(clock: FakeClock) -> None:
    broker = broker_with(clock, max_memory=2 * PACKET)
    rooms: list[bool] = []
    broker.on_room = lambda: rooms.append(True)
    producer, worker = broker.open_session(), broker.open_session()
    frames = pushes(3)
    assert producer.receive(frames) == 2
    worker.receive([Reserve(b"q"), Reserve(b"q")])
    assert broker.memory_full  # still: leased packets are held
    assert producer.receive(frames, 2) == 2
    worker.receive([Ack(1)])
    assert (broker.memory_full, rooms) == (False, [True])
    assert producer.receive(frames, 2) == 3


def test_an_ack_racing_the_deadline_finds_the_lease_gone(clock: FakeClock) -> None:
    broker = broker_with(clock)
    worker, subscriber = broker.open_session(), broker.open_session()
    worker.receive([Push(b"q", b"k", b"v", 0, 1), Reserve(b"q", 125)])
    subscriber.receive([Subscribe(b"q"), READY])
    clock.now += 0.125  # the deadline passed; expire() has not run yet
    worker.receive([Ack(1)])
    assert take(worker).endswith(status(1, False))
    assert take(subscriber) == reply((b"k", b"v"))  # came back with the ack, and was offered


def test_dead_letters_after_max_deliveries(clock: FakeClock) -> None:
    broker = broker_with(clock, max_deliveries=2)
    session, watcher = broker.open_session(), broker.open_session()
    watcher.receive([Subscribe(b"q.dead"), READY])
    session.receive([Push(b"q", b"k", b"v", 0, 1)])
    session.receive([Reserve(b"q"), Release(1), Reserve(b"q"), Release(2)])
    assert take(watcher) == reply((b"k", b"v"))
    assert broker.lease_totals().dead_lettered == 1


def test_auth_on_a_leased_connection_is_answered_with_eleven_zero_bytes(clock: FakeClock) -> None:
    # Decision 18: everything a leased connection receives has the 11-byte header.
    session = broker_with(clock, token=TOKEN).open_session()
    frames: list[ClientFrame] = [Auth(TOKEN), LeasedSubscribe(b"q"), Auth(TOKEN)]
    assert session.receive(frames) == 3
    assert take(session) == reply() + LEASED_NOTHING
    assert session.receive([Auth(b"wrong")]) == 0  # a wrong one still closes, unanswered
    assert session.blocked is Blocked.REJECTED
    assert take(session) == b""


# -- delayed pushes (decision 21) and moves (decision 22) --------------------------------------


def delayed(payload: bytes, delay_ms: int, *, queue: bytes = b"q", ttl_ms: int = 0) -> DelayedPush:
    return DelayedPush(queue, payload, payload, ttl_ms, 1, delay_ms)


def test_a_delayed_push_sets_the_timer_and_is_delivered_when_due(clock: FakeClock) -> None:
    broker = broker_with(clock)
    pusher, subscriber = broker.open_session(), broker.open_session()
    subscriber.receive([Subscribe(b"q"), READY])
    pusher.receive([delayed(b"later", 500), Push(b"q", b"now", b"now", 0, 1), Pop(b"q"), Pop(b"q")])
    assert take(subscriber) == reply((b"now", b"now"))  # the plain push, delivered at once
    assert take(pusher) == reply() + reply()  # the delayed packet is in no queue yet
    assert broker.timer == 1000.5
    subscriber.receive([READY])
    clock.now = 1000.5
    broker.expire()
    assert broker.take_dirty() == [subscriber]
    assert take(subscriber) == reply((b"later", b"later"))
    assert broker.totals() == (2, 0, 2, 0, 0)
    assert broker.timer == math.inf


def test_a_packet_that_arrived_on_a_read_is_offered_when_the_timer_fires(
    clock: FakeClock,
) -> None:
    broker = broker_with(clock)
    pusher, subscriber = broker.open_session(), broker.open_session()
    pusher.receive([delayed(b"later", 250)])
    subscriber.receive([Subscribe(b"q")])  # no credit yet
    clock.now = 1000.25
    pusher.receive([Pop(b"other")])  # a read files the due packet before the timer fires
    subscriber.receive([READY])
    assert take(subscriber) == reply((b"later", b"later"))  # the credit finds it queued
    pusher.receive([delayed(b"again", 250, queue=b"q")])
    subscriber.receive([READY])
    clock.now = 1000.5
    pusher.receive([Pop(b"other")])  # filed by a read: nobody offered it yet
    assert take(subscriber) == b""
    broker.expire()  # the timer (set to its due time at the push) offers it
    assert take(subscriber) == reply((b"again", b"again"))


def test_delayed_pushes_are_counted_per_queue(clock: FakeClock) -> None:
    broker = broker_with(clock)
    broker.take_pushes()  # start counting
    session = broker.open_session()
    session.receive(
        [Push(b"q", b"a", b"", 0, 1), delayed(b"b", 100), delayed(b"c", 100, queue=b"r")]
    )
    assert broker.take_pushes() == {b"q": 2, b"r": 1}


def test_pushes_are_counted_per_queue_across_batches_and_sessions(clock: FakeClock) -> None:
    # A run of pushes to one queue goes on across batches and sessions (at pipeline 1 every
    # push is a batch of its own); taking the counts adds up the run so far, and pushes before
    # the first take are not counted.
    broker = broker_with(clock)
    first, second = broker.open_session(), broker.open_session()
    first.receive([Push(b"q", b"early", b"", 0, 1)])
    assert broker.take_pushes() == {}  # starts counting
    first.receive([Push(b"q", b"a", b"", 0, 1)])
    second.receive([Push(b"q", b"b", b"", 0, 1)])
    first.receive([Push(b"r", b"c", b"", 0, 1), Push(b"q", b"d", b"", 0, 1)])
    second.receive([Push(b"q", b"e", b"", 0, 0), Pop(b"r")])
    assert broker.take_pushes() == {b"q": 4, b"r": 1}
    second.receive([Push(b"q", b"f", b"", 0, 1)])
    assert broker.take_pushes() == {b"q": 1}
    assert broker.take_pushes() == {}


def test_a_delayed_push_is_a_push_on_any_connection(clock: FakeClock) -> None:
    # Decision 21: for decisions 18 and 20 a 71 is a push.
    broker = broker_with(clock)
    plain, leased = broker.open_session(), broker.open_session()
    assert plain.receive([Subscribe(b"s"), delayed(b"a", 100)]) == 2
    assert leased.receive([LeasedSubscribe(b"s"), delayed(b"b", 100)]) == 2
    assert plain.error is leased.error is None
    assert broker.store.queue_info(b"q").delayed == 2


def test_a_delayed_push_before_auth_is_rejected(clock: FakeClock) -> None:
    broker = broker_with(clock, token=b"secret")
    session = broker.open_session()
    assert session.receive([delayed(b"a", 100)]) == 0
    assert (session.blocked, session.rejected) == (Blocked.REJECTED, "a delayed push before auth")
    assert len(broker.store) == 0


def test_delayed_pushes_wait_at_the_cap_and_its_log_says_how_much_is_delayed(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    size = len(b"kNN") * 2 + PACKET_OVERHEAD  # key and payload are the same bytes
    broker = broker_with(clock, max_memory=4 * size)
    session = broker.open_session()
    frames: list[ClientFrame] = [delayed(b"k%02d" % i, 1000) for i in range(6)]
    with caplog.at_level(logging.WARNING, logger="pinpriq.broker"):
        assert session.receive(frames) == 4
    assert session.blocked is Blocked.MEMORY
    [record] = caplog.records
    assert f"{4 * size} are delayed packets" in record.getMessage()
    assert broker.purge(b"q") == 4  # a purge removes delayed packets and makes room
    assert session.receive(frames, 4) == 6


def test_a_store_without_delayed_packets_closes_the_connection(clock: FakeClock) -> None:
    class Undelayed(QueueStore):
        def push_delayed(self, *args: object) -> float:
            raise NotImplementedError("not on this store")

    session = Broker(Undelayed(clock)).open_session()
    assert session.receive([Push(b"q", b"k", b"v", 0, 1), delayed(b"a", 100), SYNC]) == 1
    assert session.error == "a push with a delay: not on this store"


def test_a_move_offers_the_target_to_its_waiting_subscribers(clock: FakeClock) -> None:
    broker = broker_with(clock)
    pusher, subscriber = broker.open_session(), broker.open_session()
    subscriber.receive([Subscribe(b"jobs"), READY])
    pusher.receive([Push(b"jobs.dead", b"k", b"v", 0, 1), Push(b"jobs.dead", b"k", b"w", 0, 0)])
    assert broker.move(b"jobs.dead", b"jobs") == 2
    assert broker.take_dirty() == [subscriber]
    assert take(subscriber) == reply((b"k", b"v"), (b"k", b"w"))
    assert broker.move(b"jobs.dead", b"jobs") == 0
    with pytest.raises(ValueError, match="itself"):
        broker.move(b"jobs", b"jobs")


@pytest.mark.skipif(not packed.available, reason="the packed store's C core is not built")
@pytest.mark.parametrize("max_pop", [1, 3, 0xFFFF])
def test_the_packed_stores_pop_replies_are_the_reference_stores_bytes(
    clock: FakeClock, max_pop: int
) -> None:
    # On the packed store a pop frame's reply is written by the store (pop_reply), not by
    # wire.append_reply: the same frames must give the same bytes, key groups (cut at
    # max_pop), prio-0 riders, empty and missing queues included.
    rng = random.Random(max_pop)
    frames: list[ClientFrame] = []
    for n in range(600):
        queue = rng.choice([b"a", b"b", b""])
        if rng.random() < 0.6:
            key = rng.choice([b"k1", b"k2", b"", b"x" * 300, b"k%d" % n])
            payload = b"p" * rng.choice([0, 1, 16, 70])
            frames.append(Push(queue, key, payload, 0, rng.choice([0, 1, 2, 255])))
        else:
            frames.append(Pop(queue))
    frames += [Pop(b"a")] * 200 + [Pop(b"missing")]
    outputs = []
    for store in (QueueStore(clock, max_pop=max_pop), packed.PackedStore(clock, max_pop=max_pop)):
        broker = Broker(store)
        assert (broker.packed_store is store) == isinstance(store, packed.PackedStore)
        session = broker.open_session()
        assert session.receive(frames) == len(frames)
        outputs.append(take(session))
        store.check_invariants()
    assert outputs[0] == outputs[1]
    assert outputs[0].endswith(reply() * 2)  # queue a ran dry; b"missing" never was


@pytest.mark.skipif(not packed.available, reason="the packed store's C core is not built")
@pytest.mark.parametrize("max_pop", [1, 3, 0xFFFF])
def test_the_packed_stores_deliveries_are_the_reference_stores_bytes(
    clock: FakeClock, max_pop: int
) -> None:
    # On the packed store a plain subscriber's delivery is written by the store
    # (pop_delivery), not by wire.append_reply from tuples: the same conversation must give
    # every session the same bytes and the broker the same count of deliveries, with key
    # groups, prio-0 riders, credits, several subscribers and queues per subscriber.
    rng = random.Random(max_pop)
    script: list[tuple[int, list[ClientFrame]]] = []  # (session, frames it sends)
    for n in range(800):
        who = rng.randrange(4)  # 0: the pusher, 1-3: subscribers
        queue = rng.choice([b"a", b"b"])
        if who == 0:
            key = rng.choice([b"k1", b"k2", b"", b"k%d" % n])
            payload = b"p%d" % n * rng.choice([0, 1, 9])
            script.append((0, [Push(queue, key, payload, 0, rng.choice([0, 1, 2, 255]))] * 2))
        else:
            frame = rng.choice([Subscribe(queue), READY, READY, Unsubscribe(queue), Pop(queue)])
            script.append((who, [frame]))
    outputs: list[list[bytes]] = []
    for store in (QueueStore(clock, max_pop=max_pop), packed.PackedStore(clock, max_pop=max_pop)):
        broker = Broker(store)
        sessions = [broker.open_session() for _ in range(4)]
        written = []
        for who, frames in script:
            assert sessions[who].receive(frames) == len(frames)
            written += [take(session) for session in sessions]
        outputs.append(written)
        assert broker.delivered > 100
        outputs[-1].append(b"%d" % broker.delivered)
        store.check_invariants()
    assert outputs[0] == outputs[1]


def test_packets_that_fall_due_while_expire_offers_are_offered_too(clock: FakeClock) -> None:
    # The clock moves on while the timer's sweep delivers: a packet that falls due then is let
    # in by the delivery's pop, after the sweep, and no later timer stands for it.
    class SlowPops(QueueStore):
        slow = False

        def pop(self, queue: bytes) -> list[QueuedPacket]:
            clock.now += 0.5 if self.slow else 0
            return super().pop(queue)

    store = SlowPops(clock)
    broker = Broker(store)
    first, second, pusher = broker.open_session(), broker.open_session(), broker.open_session()
    first.receive([Subscribe(b"a"), READY])
    second.receive([Subscribe(b"b"), READY])
    pusher.receive([delayed(b"x", 1000, queue=b"a"), delayed(b"y", 1250, queue=b"b")])
    clock.now, store.slow = 1001.0, True
    broker.expire()
    assert take(first) == reply((b"x", b"x"))
    assert take(second) == reply((b"y", b"y"))  # fell due during the delivery of "x"
    assert broker.timer == math.inf
