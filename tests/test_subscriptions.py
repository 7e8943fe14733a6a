"""Subscriptions and delivery credits (decisions 6 and 7) at the pure level.

Each test plays the server's part: a push is ``store.push`` followed by ``subs.offer(queue)``,
a 0x41 byte is ``subs.ready(sub)``, and a closed connection is ``subs.remove(sub)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pinpriq.store import QueueStore
from pinpriq.subscriptions import Subscriber, Subscriptions
from pinpriq.wire import KeyedPayload


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Recorder(Subscriber):
    """A subscriber that hands each delivery to a function."""

    __slots__ = ("take",)

    def __init__(self, take: Callable[[Sequence[KeyedPayload]], object]) -> None:
        super().__init__()
        self.take = take

    def deliver(self, packets: Sequence[KeyedPayload]) -> None:
        self.take(packets)


class Conn:
    """A connection as the subscriptions see it: a Subscriber and the deliveries it got."""

    def __init__(self) -> None:
        self.deliveries: list[list[bytes]] = []  # payloads of each delivery
        self.sub: Subscriber = Recorder(self._deliver)

    def _deliver(self, packets: Sequence[KeyedPayload]) -> None:
        self.deliveries.append([p[1] for p in packets])  # each packet's payload


class Server:
    """The store and its subscriptions, driven the way the server drives them."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.store = QueueStore(self.clock)
        self.subs = Subscriptions(self.store)

    def push(
        self,
        queue: bytes,
        payload: bytes,
        *,
        key: bytes | None = None,
        prio: int = 1,
        ttl_ms: int = 0,
    ) -> None:
        """A push as the server handles it: store the packet, then serve waiters."""
        self.store.push(queue, payload if key is None else key, payload, ttl_ms, prio)
        self.subs.offer(queue)

    def waiting_conn(self, queue: bytes, credits: int = 1) -> Conn:
        conn = Conn()
        self.subs.subscribe(conn.sub, queue)
        self.subs.ready(conn.sub, credits)
        return conn


@pytest.fixture
def server() -> Server:
    return Server()


# --- credits (decision 6) ------------------------------------------------------------------------


def test_subscribe_grants_no_credit(server: Server) -> None:
    server.push(b"q", b"a")
    conn = Conn()
    server.subs.subscribe(conn.sub, b"q")
    assert conn.deliveries == []
    assert conn.sub.credits == 0
    assert server.store.depth(b"q") == 1


def test_credit_after_subscribe_delivers_queued_packet(server: Server) -> None:
    server.push(b"q", b"a")
    conn = Conn()
    server.subs.subscribe(conn.sub, b"q")
    server.subs.ready(conn.sub)
    assert conn.deliveries == [[b"a"]]
    assert conn.sub.credits == 0
    assert server.store.depth(b"q") == 0


def test_credit_before_subscribe_delivers_on_subscribe(server: Server) -> None:
    server.push(b"q", b"a")
    conn = Conn()
    server.subs.ready(conn.sub)
    assert conn.deliveries == []
    server.subs.subscribe(conn.sub, b"q")
    assert conn.deliveries == [[b"a"]]


def test_credit_before_subscribe_delivers_later_push(server: Server) -> None:
    conn = Conn()
    server.subs.ready(conn.sub)
    server.subs.subscribe(conn.sub, b"q")
    server.push(b"q", b"a")
    assert conn.deliveries == [[b"a"]]


def test_credits_accumulate_three_credits_five_pushes(server: Server) -> None:
    conn = Conn()
    server.subs.subscribe(conn.sub, b"q")
    for _ in range(3):
        server.subs.ready(conn.sub)
    for name in (b"a", b"b", b"c", b"d", b"e"):
        server.push(b"q", name)
    assert conn.deliveries == [[b"a"], [b"b"], [b"c"]]
    assert conn.sub.credits == 0
    assert server.store.depth(b"q") == 2


def test_credits_granted_later_take_remaining_packets_best_first(server: Server) -> None:
    conn = Conn()
    server.subs.subscribe(conn.sub, b"q")
    for name in (b"a", b"b", b"c"):
        server.push(b"q", name, prio=2)
    server.subs.ready(conn.sub, 2)
    assert conn.deliveries == [[b"c"], [b"b"]]  # newest first among equal prios
    assert server.store.depth(b"q") == 1


def test_offer_delivers_push_to_waiting_subscriber(server: Server) -> None:
    conn = server.waiting_conn(b"q")
    server.store.push(b"q", b"k", b"a", 0, 1)
    assert conn.deliveries == []  # the store alone does not deliver
    server.subs.offer(b"q")
    assert conn.deliveries == [[b"a"]]
    assert server.store.depth(b"q") == 0


def test_offer_after_several_pushes_serves_every_credit(server: Server) -> None:
    conn = server.waiting_conn(b"q", credits=3)
    for name in (b"a", b"b", b"c", b"d"):
        server.store.push(b"q", name, name, 0, 1)
    server.subs.offer(b"q")
    assert conn.deliveries == [[b"d"], [b"c"], [b"b"]]
    assert server.store.depth(b"q") == 1


def test_unselectable_push_leaves_subscriber_waiting(server: Server) -> None:
    conn = server.waiting_conn(b"q")
    server.push(b"q", b"zero", prio=0)
    assert conn.deliveries == []
    assert server.subs.waiting(b"q") == [conn.sub]
    server.push(b"q", b"one", prio=1)
    assert conn.deliveries == [[b"one"]]


def test_offer_without_waiters_keeps_packet(server: Server) -> None:
    conn = Conn()
    server.subs.subscribe(conn.sub, b"q")  # subscribed but no credit
    server.push(b"q", b"a")
    assert conn.deliveries == []
    assert server.store.depth(b"q") == 1


def test_push_to_other_queue_not_delivered(server: Server) -> None:
    conn = server.waiting_conn(b"q")
    server.push(b"other", b"a")
    assert conn.deliveries == []
    assert server.subs.waiting(b"q") == [conn.sub]


# --- best packet across queues (decision 6) ------------------------------------------------------


def test_best_packet_across_subscribed_queues(server: Server) -> None:
    server.push(b"a", b"a-prio2", prio=2)
    server.push(b"b", b"b-prio1-old", prio=1)
    server.push(b"a", b"a-prio1-new", prio=1)
    server.push(b"c", b"c-unsubscribed", prio=1)
    conn = Conn()
    server.subs.subscribe(conn.sub, b"a")
    server.subs.subscribe(conn.sub, b"b")
    server.subs.ready(conn.sub, 4)
    assert conn.deliveries == [[b"a-prio1-new"], [b"b-prio1-old"], [b"a-prio2"]]
    assert conn.sub.credits == 1
    assert server.store.depth(b"c") == 1


def test_waiting_subscriber_of_several_queues_gets_push_to_any(server: Server) -> None:
    conn = Conn()
    server.subs.subscribe(conn.sub, b"a")
    server.subs.subscribe(conn.sub, b"b")
    server.subs.ready(conn.sub)
    assert server.subs.waiting(b"a") == server.subs.waiting(b"b") == [conn.sub]
    server.push(b"b", b"x")
    assert conn.deliveries == [[b"x"]]
    assert server.subs.waiting(b"a") == server.subs.waiting(b"b") == []


def test_subscribing_while_waiting_adds_the_queue(server: Server) -> None:
    conn = server.waiting_conn(b"a")
    server.subs.subscribe(conn.sub, b"b")
    assert server.subs.waiting(b"b") == [conn.sub]
    server.push(b"b", b"x")
    assert conn.deliveries == [[b"x"]]


# --- first come, first served (decision 6) -------------------------------------------------------


def test_longest_waiting_subscriber_served_first(server: Server) -> None:
    first, second, third = Conn(), Conn(), Conn()
    for conn in (first, second, third):
        server.subs.subscribe(conn.sub, b"q")
    # Waiting starts with the credit, not with the subscribe.
    for conn in (second, first, third):
        server.subs.ready(conn.sub)
    assert server.subs.waiting(b"q") == [second.sub, first.sub, third.sub]
    for name in (b"p1", b"p2", b"p3"):
        server.push(b"q", name)
    assert (second.deliveries, first.deliveries, third.deliveries) == (
        [[b"p1"]],
        [[b"p2"]],
        [[b"p3"]],
    )


def test_served_waiter_goes_to_the_back(server: Server) -> None:
    a, b, c = (server.waiting_conn(b"q", credits=2) for _ in range(3))
    server.push(b"q", b"p1")
    assert server.subs.waiting(b"q") == [b.sub, c.sub, a.sub]
    for name in (b"p2", b"p3", b"p4", b"p5"):
        server.push(b"q", name)
    assert a.deliveries == [[b"p1"], [b"p4"]]
    assert b.deliveries == [[b"p2"], [b"p5"]]
    assert c.deliveries == [[b"p3"]]
    assert server.subs.waiting(b"q") == [c.sub]


def test_extra_credit_keeps_place_in_line(server: Server) -> None:
    a = server.waiting_conn(b"q")
    b = server.waiting_conn(b"q")
    server.subs.ready(a.sub)  # a already waits: a second credit does not requeue it
    assert server.subs.waiting(b"q") == [a.sub, b.sub]
    server.push(b"q", b"p1")
    assert a.deliveries == [[b"p1"]]


def test_waiter_on_several_queues_keeps_one_place_in_line(server: Server) -> None:
    both = Conn()
    server.subs.subscribe(both.sub, b"a")
    server.subs.subscribe(both.sub, b"b")
    server.subs.ready(both.sub)
    only_b = server.waiting_conn(b"b")
    server.push(b"b", b"x")
    assert both.deliveries == [[b"x"]]
    assert only_b.deliveries == []


# --- unsubscribe, redundancy, close (decision 7) -------------------------------------------------


def test_unsubscribe_keeps_credits(server: Server) -> None:
    conn = server.waiting_conn(b"q", credits=2)
    server.subs.unsubscribe(conn.sub, b"q")
    server.push(b"q", b"a")
    assert conn.deliveries == []
    assert conn.sub.credits == 2
    assert server.subs.waiting(b"q") == []
    server.subs.subscribe(conn.sub, b"r")
    server.push(b"r", b"b")
    assert conn.deliveries == [[b"b"]]
    assert conn.sub.credits == 1


def test_unsubscribe_one_queue_keeps_waiting_on_the_others(server: Server) -> None:
    conn = Conn()
    server.subs.subscribe(conn.sub, b"a")
    server.subs.subscribe(conn.sub, b"b")
    server.subs.ready(conn.sub)
    server.subs.unsubscribe(conn.sub, b"a")
    server.push(b"a", b"x")
    assert conn.deliveries == []
    server.push(b"b", b"y")
    assert conn.deliveries == [[b"y"]]


def test_resubscribing_goes_to_the_back_of_the_line(server: Server) -> None:
    a = server.waiting_conn(b"q")
    b = server.waiting_conn(b"q")
    server.subs.unsubscribe(a.sub, b"q")
    server.subs.subscribe(a.sub, b"q")
    assert server.subs.waiting(b"q") == [b.sub, a.sub]
    server.push(b"q", b"p1")
    assert (a.deliveries, b.deliveries) == ([], [[b"p1"]])


def test_redundant_subscribe_ignored(server: Server) -> None:
    conn = Conn()
    server.subs.subscribe(conn.sub, b"q")
    server.subs.ready(conn.sub)
    server.subs.subscribe(conn.sub, b"q")
    assert conn.sub.credits == 1
    assert server.subs.waiting(b"q") == [conn.sub]
    server.subs.unsubscribe(conn.sub, b"q")  # one unsubscribe undoes both subscribes
    server.push(b"q", b"a")
    assert conn.deliveries == []


def test_redundant_unsubscribe_ignored(server: Server) -> None:
    conn = server.waiting_conn(b"q")
    server.subs.unsubscribe(conn.sub, b"never-subscribed")
    server.subs.unsubscribe(conn.sub, b"q")
    server.subs.unsubscribe(conn.sub, b"q")
    assert conn.sub.credits == 1
    assert conn.sub.queues == set()
    server.subs.subscribe(conn.sub, b"q")
    server.push(b"q", b"a")
    assert conn.deliveries == [[b"a"]]


def test_remove_drops_subscriptions_and_credits(server: Server) -> None:
    gone = server.waiting_conn(b"q", credits=3)
    stays = server.waiting_conn(b"q")
    server.subs.remove(gone.sub)
    assert server.subs.waiting(b"q") == [stays.sub]
    server.push(b"q", b"a")
    server.push(b"q", b"b")
    assert gone.deliveries == []
    assert stays.deliveries == [[b"a"]]
    assert (gone.sub.credits, gone.sub.queues) == (0, set())
    assert server.store.depth(b"q") == 1


def test_remove_of_idle_subscriber_is_harmless(server: Server) -> None:
    conn = Conn()
    server.subs.subscribe(conn.sub, b"q")
    server.subs.remove(conn.sub)
    server.subs.remove(conn.sub)
    assert conn.sub.queues == set()
    assert server.subs.waiting(b"q") == []


# --- what a delivery carries ---------------------------------------------------------------------


def test_delivery_carries_whole_key_group_like_pop(server: Server) -> None:
    server.push(b"q", b"k-old", key=b"k", prio=0)
    server.push(b"q", b"other", key=b"o", prio=2)
    server.push(b"q", b"k-sel", key=b"k", prio=1)
    server.push(b"q", b"k-new", key=b"k", prio=3)
    conn = server.waiting_conn(b"q")
    assert conn.deliveries == [[b"k-sel", b"k-old", b"k-new"]]
    assert server.store.depth(b"q") == 1


def test_expired_packet_never_delivered(server: Server) -> None:
    conn = Conn()
    server.subs.subscribe(conn.sub, b"q")
    server.push(b"q", b"short", prio=1, ttl_ms=125)
    server.push(b"q", b"long", prio=2, ttl_ms=0)
    server.clock.now += 0.125  # no expire() call: the store must still refuse the dead packet
    server.subs.ready(conn.sub, 2)
    assert conn.deliveries == [[b"long"]]
    assert conn.sub.credits == 1
    assert server.subs.waiting(b"q") == [conn.sub]


def test_expired_sibling_not_delivered(server: Server) -> None:
    server.push(b"q", b"dead", key=b"k", prio=0, ttl_ms=125)
    server.push(b"q", b"sel", key=b"k", prio=1, ttl_ms=0)
    server.clock.now += 0.125
    conn = server.waiting_conn(b"q")
    assert conn.deliveries == [[b"sel"]]


# --- a stateful check of the module's invariant --------------------------------------------------

QUEUES = (b"a", b"b", b"c")
CONNS = 3


class SubscriptionsInvariants(RuleBasedStateMachine):
    """Random subscribe/unsubscribe/ready/push/pop/close/clock steps. After each: a waiting
    subscriber has credit, subscriptions and nothing selectable in them; every packet is
    delivered at most once; each delivery spent exactly one credit."""

    @initialize()
    def start(self) -> None:
        self.server = Server()
        self.conns = [Conn() for _ in range(CONNS)]
        self.granted = [0] * CONNS
        self.closed: list[Conn] = []
        self.pushed = 0

    @rule(n=st.integers(0, CONNS - 1), queue=st.sampled_from(QUEUES))
    def subscribe(self, n: int, queue: bytes) -> None:
        self.server.subs.subscribe(self.conns[n].sub, queue)

    @rule(n=st.integers(0, CONNS - 1), queue=st.sampled_from(QUEUES))
    def unsubscribe(self, n: int, queue: bytes) -> None:
        self.server.subs.unsubscribe(self.conns[n].sub, queue)

    @rule(n=st.integers(0, CONNS - 1), credits=st.integers(1, 2))
    def ready(self, n: int, credits: int) -> None:
        self.server.subs.ready(self.conns[n].sub, credits)
        self.granted[n] += credits

    @rule(
        queue=st.sampled_from(QUEUES),
        key=st.sampled_from([b"x", b"y"]),
        prio=st.sampled_from([0, 1, 2]),
        ttl_ms=st.sampled_from([0, 125]),
    )
    def push(self, queue: bytes, key: bytes, prio: int, ttl_ms: int) -> None:
        self.pushed += 1
        self.server.push(queue, b"%d" % self.pushed, key=key, prio=prio, ttl_ms=ttl_ms)

    @rule(queue=st.sampled_from(QUEUES))
    def pop(self, queue: bytes) -> None:
        self.server.store.pop(queue)

    @rule(n=st.integers(0, CONNS - 1))
    def close_and_reconnect(self, n: int) -> None:
        self.server.subs.remove(self.conns[n].sub)
        self.closed.append(self.conns[n])
        self.conns[n] = Conn()
        self.granted[n] = 0

    @rule()
    def advance_and_expire(self) -> None:
        self.server.clock.now += 0.125
        self.server.store.expire()

    @invariant()
    def waiting_lists_match_subscribers(self) -> None:
        for queue in QUEUES:
            expected = {id(c.sub) for c in self.conns if queue in c.sub.queues and c.sub.credits}
            waiting = self.server.subs.waiting(queue)
            assert {id(s) for s in waiting} == expected
            assert len(waiting) == len(expected)
            if waiting:
                assert self.server.store.peek_rank(queue) is None

    @invariant()
    def deliveries_spend_credits_once_each(self) -> None:
        for conn, granted in zip(self.conns, self.granted, strict=True):
            assert all(conn.deliveries)
            assert conn.sub.credits == granted - len(conn.deliveries)
        everyone = self.conns + self.closed
        delivered = [p for conn in everyone for d in conn.deliveries for p in d]
        assert len(delivered) == len(set(delivered))


SubscriptionsInvariants.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_subscriptions_keep_their_invariants = SubscriptionsInvariants.TestCase


# -- pausing: a connection whose unsent output is past its bound (the server's side) ----------


def test_a_subscriber_paused_in_deliver_receives_nothing_more_until_resumed() -> None:
    server = Server()
    slow, other = Conn(), Conn()
    slow.sub = Recorder(lambda packets: (slow._deliver(packets), pause(slow.sub)))
    server.subs.subscribe(slow.sub, b"q")
    server.subs.ready(slow.sub, 3)
    server.push(b"q", b"1")  # delivered, and the connection pauses itself
    server.push(b"q", b"2")
    assert slow.deliveries == [[b"1"]]
    assert server.subs.waiting(b"q") == []
    server.subs.subscribe(other.sub, b"q")
    server.subs.ready(other.sub)
    assert other.deliveries == [[b"2"]]  # the packet stayed queued for someone else
    server.push(b"q", b"3")
    server.subs.resume(slow.sub)  # its credits were kept
    assert slow.deliveries == [[b"1"], [b"3"]]


def pause(sub: Subscriber) -> None:
    sub.paused = True


def test_a_waiting_subscriber_paused_from_outside_lets_the_next_one_be_served() -> None:
    server = Server()
    first, second = Conn(), Conn()
    for conn in (first, second):
        server.subs.subscribe(conn.sub, b"q")
        server.subs.ready(conn.sub)
    server.subs.pause(first.sub)  # the client memory budget: it owes too much output
    assert server.subs.waiting(b"q") == [second.sub]
    server.push(b"q", b"1")
    assert (first.deliveries, second.deliveries) == ([], [[b"1"]])
    server.subs.resume(first.sub)  # its output drained; the credit was kept
    server.push(b"q", b"2")
    assert first.deliveries == [[b"2"]]
