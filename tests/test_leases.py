"""The lease table (decisions 13-16) over the in-memory store, with a fake clock: no event loop,
no socket, no real time. Clock readings and lease times are multiples of 1/8 s, so deadlines
are exact.

The property test at the end drives random interleavings of push, reserve, ack, release,
touch, close, pop and the passing of time against a naive model, and checks after every step
that each packet is in exactly one of queued, leased, acked, expired and popped (a packet in a
dead-letter queue is queued there), that nothing is acked twice, and that what comes back is
served in the model's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pinpriq import packed
from pinpriq.leases import Holder, Lease, Leases
from pinpriq.store import KEY, LEASES, PAYLOAD, PRIO, QueueStore
from tests.stores import BUILT_IN_STORES, store_id


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=BUILT_IN_STORES, ids=store_id)
def store(request: pytest.FixtureRequest, clock: FakeClock) -> QueueStore:
    return request.param(clock)  # type: ignore[no-any-return]


@pytest.fixture
def leases(store: QueueStore) -> Leases:
    return Leases(store, default_ms=1000, max_deliveries=3)


def push(
    store: QueueStore, payload: bytes, *, key: bytes | None = None, prio: int = 1, ttl_ms: int = 0
) -> None:
    """Push to queue q a packet its payload names; the key defaults to the payload."""
    store.push(b"q", payload if key is None else key, payload, ttl_ms, prio)


def payloads(lease: Lease | None) -> list[bytes]:
    assert lease is not None
    return [p[PAYLOAD] for p in lease.packets]


def popped(store: QueueStore, queue: bytes = b"q") -> list[bytes]:
    return [p[PAYLOAD] for p in store.pop(queue)]


# --- reserve and ids (decision 13) ---------------------------------------------------------------


def test_reserve_leases_what_pop_would_take(store: QueueStore, leases: Leases) -> None:
    push(store, b"a", key=b"k", prio=2)
    push(store, b"b", key=b"k", prio=0)
    push(store, b"c", prio=1)
    holder = Holder()
    assert payloads(leases.reserve(holder, b"q", 0)) == [b"c"]
    assert payloads(leases.reserve(holder, b"q", 0)) == [b"a", b"b"]
    assert leases.reserve(holder, b"q", 0) is None  # nothing to take: no id spent
    assert sorted(holder.leases) == [1, 2]
    assert leases.leased(b"q") == 3
    assert len(store) == 0
    store.check_invariants()


def test_lease_ids_count_per_holder_from_one_and_are_never_reused(
    store: QueueStore, leases: Leases
) -> None:
    for n in range(4):
        push(store, b"%d" % n)
    one, two = Holder(), Holder()
    first = leases.reserve(one, b"q", 0)
    assert first is not None
    assert leases.ack(one, first.lease_id)
    ids = [leases.reserve(h, b"q", 0) for h in (one, two, one)]
    assert [lease.lease_id for lease in ids if lease is not None] == [2, 1, 3]


def test_an_id_names_a_lease_of_its_own_holder_only(store: QueueStore, leases: Leases) -> None:
    push(store, b"a")
    mine, other = Holder(), Holder()
    leases.reserve(mine, b"q", 0)
    assert not leases.ack(other, 1)
    assert not leases.touch(other, 1, 0)
    assert not leases.release(other, 1, 0)
    assert leases.ack(mine, 1)
    assert leases.totals().unknown == 3


def test_attempt_is_one_more_than_the_most_times_any_packet_was_leased(
    store: QueueStore, leases: Leases
) -> None:
    holder = Holder()
    push(store, b"a", key=b"k")
    lease = leases.reserve(holder, b"q", 0)
    assert lease is not None
    assert lease.attempt == 1
    assert leases.release(holder, lease.lease_id, 0)
    push(store, b"b", key=b"k", prio=0)  # a newcomer to the key, never leased
    lease = leases.reserve(holder, b"q", 0)
    assert lease is not None
    assert lease.attempt == 2
    assert [p[LEASES] for p in lease.packets] == [1, 0]


# --- ack, release, touch (decision 14) -----------------------------------------------------------


def test_ack_is_for_good_and_only_once(store: QueueStore, leases: Leases) -> None:
    push(store, b"a")
    holder = Holder()
    leases.reserve(holder, b"q", 0)
    assert leases.ack(holder, 1)
    assert not leases.ack(holder, 1)
    assert store.bytes_held == 0
    assert leases.totals().acked == 1
    assert leases.totals().unknown == 1
    assert leases.leased(b"q") == 0
    assert leases.next_deadline() is None


def test_release_sends_the_group_back_at_once(store: QueueStore, leases: Leases) -> None:
    push(store, b"a")
    holder = Holder()
    leases.reserve(holder, b"q", 0)
    assert leases.release(holder, 1, 0)
    assert leases.take_returned() == [b"q"]
    assert not leases.ack(holder, 1)  # the lease is over
    assert popped(store) == [b"a"]
    assert leases.totals().redelivered == 1


def test_release_with_a_delay_holds_the_group_out_of_its_queue_until_then(
    store: QueueStore, leases: Leases, clock: FakeClock
) -> None:
    push(store, b"a")
    holder = Holder()
    leases.reserve(holder, b"q", 0)
    held = store.bytes_held
    assert leases.release(holder, 1, 500)
    assert not leases.touch(holder, 1, 0)  # its id is dead at once
    assert leases.next_deadline() == 1000.5
    clock.advance(0.375)
    leases.expire()
    assert store.pop(b"q") == []
    assert store.bytes_held == held  # still counted against the memory cap
    assert leases.leased(b"q") == 1
    clock.advance(0.125)
    leases.expire()
    assert leases.take_returned() == [b"q"]
    assert popped(store) == [b"a"]


def test_touch_moves_the_deadline_from_now(
    store: QueueStore, leases: Leases, clock: FakeClock
) -> None:
    push(store, b"a")
    holder = Holder()
    leases.reserve(holder, b"q", 500)
    clock.advance(0.375)
    assert leases.touch(holder, 1, 500)
    assert leases.next_deadline() == 1000.875
    clock.advance(0.375)
    leases.expire()
    assert leases.ack(holder, 1)
    assert leases.touch(holder, 1, 0) is False


def test_a_touch_may_shorten_a_lease(store: QueueStore, leases: Leases, clock: FakeClock) -> None:
    push(store, b"a")
    holder = Holder()
    leases.reserve(holder, b"q", 0)  # the default: 1 s here
    assert leases.touch(holder, 1, 125)
    assert leases.soonest() == 1000.125
    clock.advance(0.125)
    leases.expire()
    assert popped(store) == [b"a"]


def test_lease_time_zero_is_the_default(store: QueueStore, leases: Leases) -> None:
    push(store, b"a")
    lease = leases.reserve(Holder(), b"q", 0)
    assert lease is not None
    assert lease.due == 1001.0


# --- going back (decision 15) --------------------------------------------------------------------


def test_a_lease_is_live_while_now_is_before_its_deadline(
    store: QueueStore, leases: Leases, clock: FakeClock
) -> None:
    push(store, b"a")
    holder = Holder()
    leases.reserve(holder, b"q", 500)
    clock.advance(0.5)
    # Without expire(): the ack itself finds the deadline passed, and the lease goes back.
    assert not leases.ack(holder, 1)
    assert leases.take_returned() == [b"q"]
    assert popped(store) == [b"a"]


def test_a_lease_goes_back_at_its_deadline_in_push_order_with_its_ttl(
    store: QueueStore, leases: Leases, clock: FakeClock
) -> None:
    push(store, b"old", ttl_ms=2000, prio=2)
    holder = Holder()
    leases.reserve(holder, b"q", 500)
    push(store, b"new", prio=2)
    clock.advance(0.5)
    leases.expire()
    assert leases.take_returned() == [b"q"]
    assert store.next_deadline() == 1002.0  # its own TTL deadline, not a new one
    assert popped(store) == [b"new"]  # newest first among equals: "old" kept its place
    assert popped(store) == [b"old"]


def test_ttl_wins_over_a_lease(store: QueueStore, leases: Leases, clock: FakeClock) -> None:
    push(store, b"a", ttl_ms=250)
    holder = Holder()
    leases.reserve(holder, b"q", 500)
    clock.advance(0.5)
    leases.expire()
    assert leases.take_returned() == []
    assert store.expired == 1
    assert store.bytes_held == 0
    assert leases.totals().redelivered == 0


def test_closing_a_holder_sends_back_every_lease_it_holds(
    store: QueueStore, leases: Leases
) -> None:
    for payload in (b"a", b"b", b"c"):
        push(store, payload)
    holder = Holder()
    leases.reserve(holder, b"q", 0)
    leases.reserve(holder, b"q", 0)
    leases.release(holder, 2, 5000)  # already released: waits out its delay regardless
    leases.close(holder)
    assert holder.leases == {}
    assert popped(store) == [b"c"]
    assert popped(store) == [b"a"]
    assert store.pop(b"q") == []
    assert leases.leased(b"q") == 1


def test_leases_give_no_exclusivity_per_key(store: QueueStore, leases: Leases) -> None:
    push(store, b"a", key=b"k")
    holder = Holder()
    leases.reserve(holder, b"q", 0)
    push(store, b"b", key=b"k")
    assert payloads(leases.reserve(holder, b"q", 0)) == [b"b"]


# --- dead letters (decision 16) ------------------------------------------------------------------


def test_after_max_deliveries_a_group_goes_to_the_dead_letter_queue(
    store: QueueStore, leases: Leases
) -> None:
    push(store, b"a", key=b"k", ttl_ms=60_000)
    push(store, b"b", key=b"k", prio=0)
    holder = Holder()
    for attempt in (1, 2, 3):  # max_deliveries is 3 here
        lease = leases.reserve(holder, b"q", 0)
        assert lease is not None
        assert lease.attempt == attempt
        leases.release(holder, lease.lease_id, 0)
    assert leases.take_returned() == [b"q", b"q", b"q.dead"]
    assert store.pop(b"q") == []
    assert store.next_deadline() == 1060.0  # the TTL deadline went with it
    dead = store.take(b"q.dead")
    assert [(p[PAYLOAD], p[PRIO], p[LEASES]) for p in dead] == [(b"a", 1, 0), (b"b", 0, 0)]
    totals = leases.totals()
    assert (totals.redelivered, totals.dead_lettered) == (4, 2)


def test_max_deliveries_zero_never_buries(store: QueueStore) -> None:
    leases = Leases(store, max_deliveries=0)
    push(store, b"a")
    holder = Holder()
    for _ in range(300):
        lease = leases.reserve(holder, b"q", 0)
        assert lease is not None
        leases.release(holder, lease.lease_id, 0)
    assert lease.attempt == 300  # the wire byte saturates at 255; the count does not


def test_a_queue_name_too_long_for_the_suffix_drops_the_group(store: QueueStore) -> None:
    leases = Leases(store, max_deliveries=1)
    name = b"n" * 65531  # 65,531 + 5 > 65,535
    store.push(name, b"k", b"a", 0, 1)
    holder = Holder()
    leases.reserve(holder, name, 0)
    leases.release(holder, 1, 0)
    assert store.queue_count == 0
    assert store.bytes_held == 0
    assert leases.totals().dropped == 1


def test_the_longest_name_that_takes_the_suffix_gets_its_dead_letter_queue(
    store: QueueStore,
) -> None:
    leases = Leases(store, max_deliveries=1)
    name = b"n" * 65530
    store.push(name, b"k", b"a", 0, 1)
    holder = Holder()
    leases.reserve(holder, name, 0)
    leases.close(holder)
    assert store.depth(name + b".dead") == 1


# --- the heap stays bounded ----------------------------------------------------------------------


def test_acked_leases_do_not_keep_their_heap_entries_or_packets(
    store: QueueStore, leases: Leases
) -> None:
    holder = Holder()
    for n in range(2000):
        push(store, b"%d" % n)
        lease = leases.reserve(holder, b"q", 0)
        assert lease is not None
        leases.touch(holder, lease.lease_id, 0)
        leases.ack(holder, lease.lease_id)
        assert lease.packets == []
    assert len(leases._heap) <= 64 + 2  # white-box: rebuilt as stale entries pile up
    assert leases.next_deadline() is None


def test_the_default_lease_time_must_be_positive(store: QueueStore) -> None:
    with pytest.raises(ValueError, match="positive"):
        Leases(store, default_ms=0)


# --- the property test ---------------------------------------------------------------------------

QUEUES = (b"a", b"b")
KEYS = (b"x", b"y", b"z")
MAX_DELIVERIES = 3
DEFAULT_MS = 500


@dataclass
class P:
    """A packet in the model: its number is its payload."""

    n: int
    queue: bytes
    key: bytes
    prio: int
    deadline: float
    leases: int = 0


@dataclass
class ML:
    """A lease in the model."""

    holder: int
    lease_id: int
    queue: bytes
    packets: list[P]
    due: float
    attempt: int
    waiting: bool = False  # released with a delay


@dataclass
class Model:
    now: float = 0.0
    queued: list[P] = field(default_factory=list)  # push order: n is the push sequence
    leases: list[ML] = field(default_factory=list)
    next_id: list[int] = field(default_factory=lambda: [1, 1, 1])
    acked: set[int] = field(default_factory=set)
    expired: set[int] = field(default_factory=set)
    popped: set[int] = field(default_factory=set)

    def sweep(self) -> None:
        for p in [p for p in self.queued if p.deadline <= self.now]:
            self.queued.remove(p)
            self.expired.add(p.n)

    def take(self, queue: bytes) -> list[P]:
        self.sweep()
        candidates = [p for p in self.queued if p.queue == queue and p.prio]
        if not candidates:
            return []
        best = min(candidates, key=lambda p: (p.prio, -p.n))
        group = [best] + [
            p for p in self.queued if p.queue == queue and p.key == best.key and p is not best
        ]
        self.queued = [p for p in self.queued if all(p is not g for g in group)]
        return group

    def reserve(self, holder: int, queue: bytes, ms: int) -> ML | None:
        group = self.take(queue)
        if not group:
            return None
        lease = ML(
            holder,
            self.next_id[holder],
            queue,
            group,
            self.now + (ms or DEFAULT_MS) / 1000,
            max(p.leases for p in group) + 1,
        )
        self.next_id[holder] += 1
        self.leases.append(lease)
        return lease

    def live(self, holder: int, lease_id: int) -> ML | None:
        for lease in self.leases:
            if (lease.holder, lease.lease_id) == (holder, lease_id) and not lease.waiting:
                if lease.due > self.now:
                    return lease
                self.end(lease)
                return None
        return None

    def end(self, lease: ML) -> None:
        self.leases.remove(lease)
        dead = lease.attempt >= MAX_DELIVERIES
        for p in lease.packets:
            p.leases = 0 if dead else p.leases + 1
            p.queue = lease.queue + b".dead" if dead else lease.queue
            if p.deadline <= self.now:
                self.expired.add(p.n)
            else:
                self.queued.append(p)
        self.queued.sort(key=lambda p: p.n)

    def expire(self) -> None:
        self.sweep()
        for lease in [lease for lease in self.leases if lease.due <= self.now]:
            self.end(lease)

    def close(self, holder: int) -> None:
        for lease in [x for x in self.leases if x.holder == holder and not x.waiting]:
            self.end(lease)
        self.next_id[holder] = 1


class LeasesVersusModel(RuleBasedStateMachine):
    STORE: type[QueueStore] = QueueStore

    @initialize()
    def start(self) -> None:
        self.clock = FakeClock(0.0)
        self.store = self.STORE(self.clock)
        self.leases = Leases(self.store, default_ms=DEFAULT_MS, max_deliveries=MAX_DELIVERIES)
        self.holders = [Holder(), Holder(), Holder()]
        self.model = Model()
        self.pushed = 0

    @rule(
        queue=st.sampled_from(QUEUES),
        key=st.sampled_from(KEYS),
        prio=st.sampled_from([0, 1, 2]),
        ttl_ms=st.sampled_from([0, 0, 0, 500, 1500]),
    )
    def push(self, queue: bytes, key: bytes, prio: int, ttl_ms: int) -> None:
        self.pushed += 1
        self.store.push(queue, key, b"%d" % self.pushed, ttl_ms, prio)
        deadline = self.model.now + ttl_ms / 1000 if ttl_ms else float("inf")
        self.model.queued.append(P(self.pushed, queue, key, prio, deadline))

    @rule(
        holder=st.integers(0, 2),
        queue=st.sampled_from((*QUEUES, b"a.dead")),
        ms=st.sampled_from([0, 125, 250, 750]),
    )
    def reserve(self, holder: int, queue: bytes, ms: int) -> None:
        lease = self.leases.reserve(self.holders[holder], queue, ms)
        expected = self.model.reserve(holder, queue, ms)
        if expected is None:
            assert lease is None
            return
        assert lease is not None
        # Order after any return matches the model: push order and newest-first selection.
        assert [int(p[PAYLOAD]) for p in lease.packets] == [p.n for p in expected.packets]
        assert (lease.lease_id, lease.attempt, lease.due) == (
            expected.lease_id,
            expected.attempt,
            expected.due,
        )

    @rule(queue=st.sampled_from(QUEUES))
    def pop(self, queue: bytes) -> None:
        expected = [p.n for p in self.model.take(queue)]
        assert [int(p[PAYLOAD]) for p in self.store.pop(queue)] == expected
        self.model.popped.update(expected)

    def _some_id(self, data: st.DataObject, holder: int) -> int:
        return data.draw(st.integers(1, max(1, self.model.next_id[holder])), label="lease id")

    @rule(holder=st.integers(0, 2), data=st.data())
    def ack(self, holder: int, data: st.DataObject) -> None:
        lease_id = self._some_id(data, holder)
        lease = self.model.live(holder, lease_id)
        assert self.leases.ack(self.holders[holder], lease_id) == (lease is not None)
        if lease is not None:
            numbers = {p.n for p in lease.packets}
            assert not numbers & self.model.acked, "acked twice"
            self.model.acked |= numbers
            self.model.leases.remove(lease)

    @rule(holder=st.integers(0, 2), data=st.data(), delay=st.sampled_from([0, 0, 250, 500]))
    def release(self, holder: int, data: st.DataObject, delay: int) -> None:
        lease_id = self._some_id(data, holder)
        lease = self.model.live(holder, lease_id)
        assert self.leases.release(self.holders[holder], lease_id, delay) == (lease is not None)
        if lease is not None:
            if delay:
                lease.waiting, lease.due = True, self.model.now + delay / 1000
            else:
                self.model.end(lease)

    @rule(holder=st.integers(0, 2), data=st.data(), ms=st.sampled_from([0, 125, 1000]))
    def touch(self, holder: int, data: st.DataObject, ms: int) -> None:
        lease_id = self._some_id(data, holder)
        lease = self.model.live(holder, lease_id)
        assert self.leases.touch(self.holders[holder], lease_id, ms) == (lease is not None)
        if lease is not None:
            lease.due = self.model.now + (ms or DEFAULT_MS) / 1000

    @rule(holder=st.integers(0, 2))
    def close(self, holder: int) -> None:
        self.leases.close(self.holders[holder])
        self.holders[holder] = Holder()  # a new connection
        self.model.close(holder)

    @rule(seconds=st.sampled_from([0.125, 0.25, 0.5]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.model.now += seconds

    @rule()
    def expire(self) -> None:
        self.store.expire()
        self.leases.expire()
        self.model.expire()

    @precondition(lambda self: self.model.leases)
    @rule()
    def next_deadline(self) -> None:
        assert self.leases.next_deadline() == min(lease.due for lease in self.model.leases)

    @invariant()
    def every_packet_is_in_exactly_one_state(self) -> None:
        self.store.check_invariants()
        model = self.model
        store_queued = {
            int(p[PAYLOAD]): (name, p[KEY])
            for name, _, _ in self.store.sizes()
            for p in self.store.queued(name)
        }
        assert store_queued == {p.n: (p.queue, p.key) for p in model.queued}
        lease_table = [
            lease for entry in self.leases._heap if (lease := entry[2]).due == entry[0]
        ]  # white-box: every lease still live or waiting has its current heap entry
        store_leased = sorted(int(p[PAYLOAD]) for lease in set(lease_table) for p in lease.packets)
        model_leased = sorted(p.n for lease in model.leases for p in lease.packets)
        assert store_leased == model_leased
        totals = self.leases.totals()
        assert totals.leased == len(model_leased)
        assert totals.acked == len(model.acked)
        assert self.store.expired == len(model.expired)
        states = [set(store_queued), set(model_leased), model.acked, model.expired, model.popped]
        assert sum(map(len, states)) == self.pushed, "a packet lost or in two states"
        assert set().union(*states) == set(range(1, self.pushed + 1))
        for queue in QUEUES:
            assert self.leases.leased(queue) == sum(
                len(lease.packets) for lease in model.leases if lease.queue == queue
            )


LeasesVersusModel.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None
)
test_leases_match_a_naive_model = LeasesVersusModel.TestCase

if packed.available:

    class PackedLeasesVersusModel(LeasesVersusModel):
        STORE = packed.PackedStore

    PackedLeasesVersusModel.TestCase.settings = LeasesVersusModel.TestCase.settings
    test_leases_on_the_packed_store_match_a_naive_model = PackedLeasesVersusModel.TestCase
