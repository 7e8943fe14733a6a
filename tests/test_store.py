"""The queue store against decisions 1-5, with a fake clock (no real time, no sleeps).

Clock readings and TTLs are chosen as multiples of 1/8 s (125 ms) where tests compare times,
so the float arithmetic of deadlines is exact and "at the deadline" means exactly that.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pinpriq import packed, wire
from pinpriq.store import (
    DEADLINE,
    DEFAULT_MAX_POP,
    KEY,
    LEASES,
    PACKET_OVERHEAD,
    PAYLOAD,
    PRIO,
    SEQ,
    QueuedPacket,
    QueueStore,
)
from tests.stores import BUILT_IN_STORES, overhead, store_id

YEAR = 365 * 24 * 3600.0


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture(params=BUILT_IN_STORES, ids=store_id)
def store_class(request: pytest.FixtureRequest) -> type[QueueStore]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def store(store_class: type[QueueStore], clock: FakeClock) -> QueueStore:
    return store_class(clock)


def payloads(packets: list[QueuedPacket]) -> list[bytes]:
    return [p[PAYLOAD] for p in packets]


def push(
    store: QueueStore,
    payload: bytes,
    *,
    queue: bytes = b"q",
    key: bytes | None = None,
    prio: int = 1,
    ttl_ms: int = 0,
) -> float:
    """Push a packet its payload names; the key defaults to the payload (a group of one)."""
    return store.push(queue, payload if key is None else key, payload, ttl_ms, prio)


# --- decision 1: TTL -----------------------------------------------------------------------------


def test_ttl_is_in_milliseconds(store: QueueStore, clock: FakeClock) -> None:
    push(store, b"a", ttl_ms=250)
    clock.advance(0.125)
    assert store.expire() == 0
    assert store.peek_rank(b"q") is not None
    clock.advance(0.125)
    assert store.expire() == 1
    assert store.pop(b"q") == []


def test_push_returns_deadline_on_store_clock(store: QueueStore) -> None:
    assert push(store, b"a", ttl_ms=1500) == 1001.5
    assert push(store, b"b", ttl_ms=0) == float("inf")


def test_packets_without_a_ttl_share_one_deadline_object(store: QueueStore) -> None:
    # The compiled store once boxed a new float ``inf`` into every packet without a TTL: 24
    # bytes a queued packet, and an allocation per push.
    for key in (b"a", b"b", b"c"):
        push(store, key, ttl_ms=0)
    deadlines = [packet[DEADLINE] for packet in store.peek(b"q", 3)]
    assert deadlines == [float("inf")] * 3
    assert deadlines[0] is deadlines[1] is deadlines[2]


def test_ttl_zero_never_expires(store: QueueStore, clock: FakeClock) -> None:
    push(store, b"forever", ttl_ms=0)
    clock.advance(100 * YEAR)
    assert store.expire() == 0
    assert store.next_deadline() is None
    assert payloads(store.pop(b"q")) == [b"forever"]


def test_longest_ttl_lasts_65535_ms(store: QueueStore, clock: FakeClock) -> None:
    push(store, b"a", ttl_ms=65535)
    clock.advance(65.534)
    assert store.expire() == 0
    clock.advance(0.002)
    assert store.expire() == 1


def test_expired_packet_never_popped_even_without_expire(
    store: QueueStore, clock: FakeClock
) -> None:
    push(store, b"short", prio=1, ttl_ms=125)
    push(store, b"long", prio=2, ttl_ms=0)
    clock.advance(0.125)
    assert payloads(store.pop(b"q")) == [b"long"]
    assert store.pop(b"q") == []


def test_expired_packet_not_ranked_even_without_expire(store: QueueStore, clock: FakeClock) -> None:
    push(store, b"short", ttl_ms=125)
    clock.advance(0.125)
    assert store.peek_rank(b"q") is None


def test_packet_live_until_just_before_deadline(store: QueueStore, clock: FakeClock) -> None:
    push(store, b"a", ttl_ms=500)
    clock.advance(0.499_999)
    assert payloads(store.pop(b"q")) == [b"a"]


def test_packet_expired_exactly_at_deadline(store: QueueStore, clock: FakeClock) -> None:
    push(store, b"a", ttl_ms=500)
    clock.advance(0.5)
    assert store.pop(b"q") == []


def test_expire_releases_memory_without_pop(store: QueueStore, clock: FakeClock) -> None:
    push(store, b"a", queue=b"q1", ttl_ms=125)
    push(store, b"b", queue=b"q1", ttl_ms=250, prio=0)
    push(store, b"c", queue=b"q2", ttl_ms=125)
    push(store, b"d", queue=b"q3", ttl_ms=0)
    assert (len(store), store.queue_count) == (4, 3)
    clock.advance(0.125)
    assert store.expire() == 2
    assert (len(store), store.queue_count) == (2, 2)
    assert (store.depth(b"q1"), store.depth(b"q2")) == (1, 0)
    clock.advance(0.125)
    assert store.expire() == 1
    assert (len(store), store.queue_count) == (1, 1)
    store.check_invariants()


def test_next_deadline_moves_on_after_expiry(store: QueueStore, clock: FakeClock) -> None:
    assert store.next_deadline() is None
    push(store, b"late", ttl_ms=375)
    push(store, b"soon", ttl_ms=125)
    push(store, b"never", ttl_ms=0)
    assert store.next_deadline() == 1000.125
    clock.advance(0.125)
    store.expire()
    assert store.next_deadline() == 1000.375
    clock.advance(0.25)
    store.expire()
    assert store.next_deadline() is None


def test_next_deadline_skips_popped_packets(store: QueueStore) -> None:
    push(store, b"popped", prio=1, ttl_ms=125)
    push(store, b"kept", prio=2, ttl_ms=250)
    assert payloads(store.pop(b"q")) == [b"popped"]
    assert store.next_deadline() == 1000.25


def test_next_deadline_reports_a_due_packet_not_yet_expired(
    store: QueueStore, clock: FakeClock
) -> None:
    push(store, b"a", ttl_ms=125)
    clock.advance(1.0)
    assert store.next_deadline() == 1000.125  # due: the owner should call expire() now


# --- decision 2: selection -----------------------------------------------------------------------


def test_prio_one_before_two_even_when_older(store: QueueStore) -> None:
    push(store, b"one", prio=1)
    push(store, b"two", prio=2)
    assert payloads(store.pop(b"q")) == [b"one"]
    assert payloads(store.pop(b"q")) == [b"two"]


def test_pops_in_priority_order_across_the_range(store: QueueStore) -> None:
    for prio in (5, 255, 1, 3, 254, 2):
        push(store, b"p%d" % prio, prio=prio)
    popped = [store.pop(b"q") for _ in range(7)]
    assert popped[-1] == []
    assert [payloads(p) for p in popped[:-1]] == [
        [b"p1"],
        [b"p2"],
        [b"p3"],
        [b"p5"],
        [b"p254"],
        [b"p255"],
    ]


def test_newest_wins_among_equal_priorities(store: QueueStore) -> None:
    for name in (b"old", b"mid", b"new"):
        push(store, name, prio=2)
    assert [payloads(store.pop(b"q")) for _ in range(3)] == [[b"new"], [b"mid"], [b"old"]]


def test_newest_is_by_push_order_not_by_clock(store: QueueStore) -> None:
    push(store, b"first", prio=2)
    push(store, b"second", prio=2)  # same clock reading
    assert payloads(store.pop(b"q")) == [b"second"]


def test_prio_zero_never_selected(store: QueueStore) -> None:
    push(store, b"a", prio=0)
    push(store, b"b", prio=0)
    assert store.pop(b"q") == []
    assert store.depth(b"q") == 2
    assert store.peek_rank(b"q") is None


def test_prio_zero_left_behind_when_other_key_selected(store: QueueStore) -> None:
    push(store, b"zero", prio=0)
    push(store, b"one", prio=1)
    assert payloads(store.pop(b"q")) == [b"one"]
    assert store.pop(b"q") == []
    assert store.depth(b"q") == 1


# --- decision 3: key grouping --------------------------------------------------------------------


def test_prio_zero_sibling_rides_along(store: QueueStore) -> None:
    push(store, b"zero", key=b"k", prio=0)
    push(store, b"one", key=b"k", prio=1)
    assert payloads(store.pop(b"q")) == [b"one", b"zero"]
    assert len(store) == 0


def test_reply_is_selected_first_then_siblings_oldest_first(store: QueueStore) -> None:
    push(store, b"k1", key=b"k", prio=3)
    push(store, b"other", key=b"o", prio=1)
    push(store, b"k2", key=b"k", prio=0)
    push(store, b"k3", key=b"k", prio=1)  # newest prio 1: selected
    push(store, b"k4", key=b"k", prio=5)
    reply = store.pop(b"q")
    assert payloads(reply) == [b"k3", b"k1", b"k2", b"k4"]
    assert [p[KEY] for p in reply] == [b"k"] * 4
    assert payloads(store.pop(b"q")) == [b"other"]


def test_same_key_in_another_queue_stays(store: QueueStore) -> None:
    push(store, b"here", key=b"k", queue=b"a")
    push(store, b"there", key=b"k", queue=b"b")
    assert payloads(store.pop(b"a")) == [b"here"]
    assert payloads(store.pop(b"b")) == [b"there"]


def test_expired_sibling_left_out(store: QueueStore, clock: FakeClock) -> None:
    push(store, b"gone", key=b"k", prio=0, ttl_ms=125)
    push(store, b"kept", key=b"k", prio=2, ttl_ms=0)
    push(store, b"sel", key=b"k", prio=1, ttl_ms=250)
    clock.advance(0.125)
    assert payloads(store.pop(b"q")) == [b"sel", b"kept"]
    assert len(store) == 0


def test_max_pop_leaves_further_siblings_queued(
    store_class: type[QueueStore], clock: FakeClock
) -> None:
    store = store_class(clock, max_pop=3)
    for n in range(1, 6):
        push(store, b"k%d" % n, key=b"k")
    assert payloads(store.pop(b"q")) == [b"k5", b"k1", b"k2"]
    assert store.depth(b"q") == 2
    assert payloads(store.pop(b"q")) == [b"k4", b"k3"]
    store.check_invariants()


def test_max_pop_leftover_prio_zero_siblings_stay_unselectable(
    store_class: type[QueueStore], clock: FakeClock
) -> None:
    store = store_class(clock, max_pop=2)
    push(store, b"z1", key=b"k", prio=0)
    push(store, b"z2", key=b"k", prio=0)
    push(store, b"sel", key=b"k", prio=1)
    assert payloads(store.pop(b"q")) == [b"sel", b"z1"]
    assert store.pop(b"q") == []
    assert store.depth(b"q") == 1


def test_default_max_pop_is_a_reply_count() -> None:
    assert DEFAULT_MAX_POP == wire.MAX_REPLY_PACKETS == 65535


def test_default_store_pops_at_most_65535_packets(store: QueueStore) -> None:
    for n in range(65537):
        store.push(b"q", b"k", b"%d" % n, 0, 0)
    store.push(b"q", b"k", b"sel", 0, 1)
    reply = store.pop(b"q")
    assert len(reply) == 65535
    assert (reply[0][PAYLOAD], reply[1][PAYLOAD], reply[-1][PAYLOAD]) == (b"sel", b"0", b"65533")
    assert store.depth(b"q") == 3


def test_a_stale_entry_of_a_key_pushed_again_is_skipped(store: QueueStore) -> None:
    """A packet taken along with its group leaves a stale entry in its level. When its key is
    pushed again, that entry names a key the queue holds again, but not that packet: it must be
    skipped when it reaches the top, never popped a second time."""
    push(store, b"A", key=b"k", prio=5)
    push(store, b"B", key=b"k", prio=3)
    assert payloads(store.pop(b"q")) == [b"B", b"A"]  # A's prio-5 entry is now stale
    push(store, b"C", key=b"k", prio=7)  # key k is live again, at a worse prio
    assert store.peek_rank(b"q") == (7, -3)
    assert payloads(store.pop(b"q")) == [b"C"]
    assert store.pop(b"q") == []
    store.check_invariants()


def test_unselectable_bytes_count_prio_zero_packets_until_they_leave(
    store: QueueStore, clock: FakeClock
) -> None:
    push(store, b"rider", key=b"k", prio=0)
    push(store, b"timed", prio=0, ttl_ms=125)
    assert store.unselectable_bytes == store.bytes_held
    push(store, b"selectable", key=b"k", prio=1)
    clock.advance(0.125)
    store.expire()
    assert store.unselectable_bytes == len(b"k" + b"rider") + overhead(store)
    assert store.expired == 1
    assert payloads(store.pop(b"q")) == [b"selectable", b"rider"]
    assert (store.unselectable_bytes, store.bytes_held) == (0, 0)


# --- decisions 4 and 5: empty results and queues -------------------------------------------------


def test_missing_queue_pops_empty(store: QueueStore) -> None:
    assert store.pop(b"nothing here") == []
    assert store.queue_count == 0


def test_emptied_queue_pops_empty_and_is_forgotten(store: QueueStore) -> None:
    push(store, b"a")
    store.pop(b"q")
    assert store.pop(b"q") == []
    assert (len(store), store.queue_count, store.depth(b"q")) == (0, 0, 0)
    store.check_invariants()


def test_empty_queue_name_and_key_work(store: QueueStore) -> None:
    store.push(b"", b"", b"payload", 0, 1)
    store.push(b"", b"", b"", 0, 0)
    assert store.queue_count == 1
    reply = store.pop(b"")
    assert [p[:2] for p in reply] == [(b"", b"payload"), (b"", b"")]
    assert store.queue_count == 0


def test_queues_are_independent(store: QueueStore) -> None:
    push(store, b"a1", queue=b"a", prio=2)
    push(store, b"b1", queue=b"b", prio=1)
    push(store, b"a2", queue=b"a", prio=3)
    assert payloads(store.pop(b"a")) == [b"a1"]
    assert (store.depth(b"a"), store.depth(b"b"), store.queue_count) == (1, 1, 2)
    assert payloads(store.pop(b"b")) == [b"b1"]
    assert store.queue_count == 1


def test_depth_counts_unselectable_packets(store: QueueStore) -> None:
    push(store, b"a", prio=0)
    push(store, b"b", prio=7)
    assert store.depth(b"q") == 2
    assert len(store) == 2


# --- peek_rank ------------------------------------------------------------------------------------


def test_peek_rank_none_for_missing_or_unselectable_queue(store: QueueStore) -> None:
    assert store.peek_rank(b"q") is None
    push(store, b"zero", prio=0)
    assert store.peek_rank(b"q") is None


def test_peek_rank_is_prio_then_newest_and_does_not_pop(store: QueueStore) -> None:
    push(store, b"a", prio=4)
    push(store, b"b", prio=2)
    rank = store.peek_rank(b"q")
    assert rank is not None
    assert rank[0] == 2
    assert store.depth(b"q") == 2
    assert payloads(store.pop(b"q")) == [b"b"]
    after = store.peek_rank(b"q")
    assert after is not None
    assert after[0] == 4


def test_peek_rank_comparable_across_queues(store: QueueStore) -> None:
    push(store, b"older", queue=b"a", prio=2)
    push(store, b"newer", queue=b"b", prio=2)
    push(store, b"worse", queue=b"c", prio=3)
    push(store, b"best", queue=b"d", prio=1)
    ranks: dict[bytes, tuple[int, int]] = {}
    for queue in (b"a", b"b", b"c", b"d"):
        rank = store.peek_rank(queue)
        assert rank is not None
        ranks[queue] = rank
    assert sorted(ranks, key=ranks.__getitem__) == [b"d", b"b", b"a", b"c"]


def test_peek_rank_changes_when_a_newer_equal_packet_arrives(store: QueueStore) -> None:
    push(store, b"a", prio=2)
    before = store.peek_rank(b"q")
    push(store, b"b", prio=2)
    after = store.peek_rank(b"q")
    assert before is not None
    assert after is not None
    assert after < before


# --- expiry heap stays bounded -------------------------------------------------------------------


def test_popped_ttl_packets_do_not_grow_expiry_heap(clock: FakeClock) -> None:
    # A popped packet leaves a stale entry in the expiry heap; nothing public shows how many,
    # so this test reads store._expiry to check that compaction bounds them by the live count.
    # (The packed store's heap has no stale entries: its check_invariants counts them.)
    store = QueueStore(clock)
    longest = 0
    for n in range(20_000):
        push(store, b"%d" % n, ttl_ms=60_000)
        if n >= 10:  # keep ten live TTL packets; every other one is popped
            assert len(store.pop(b"q")) == 1
        longest = max(longest, len(store._expiry))
    assert len(store) == 10
    assert longest < 200
    for _ in range(10):
        store.pop(b"q")
    assert len(store._expiry) < 100
    assert store.next_deadline() is None
    store.check_invariants()


# --- a stateful comparison against a naive model -------------------------------------------------


def test_peek_shows_what_pops_would_return_and_removes_nothing(store: QueueStore) -> None:
    store.push(b"q", b"a", b"a1", 0, 2)
    store.push(b"q", b"b", b"b1", 0, 1)
    store.push(b"q", b"a", b"a0", 0, 0)  # prio 0 rides along with a's group
    store.push(b"q", b"c", b"c1", 0, 2)
    assert payloads(store.peek(b"q", 10)) == [b"b1", b"c1", b"a1", b"a0"]
    assert payloads(store.peek(b"q", 2)) == [b"b1", b"c1"]
    assert store.depth(b"q") == 4
    popped = [p for _ in range(3) for p in store.pop(b"q")]
    assert payloads(popped) == [b"b1", b"c1", b"a1", b"a0"]
    store.check_invariants()


def test_peek_skips_expired_packets_and_unselectable_queues(
    store: QueueStore, clock: FakeClock
) -> None:
    store.push(b"q", b"a", b"gone", 125, 1)
    store.push(b"q", b"b", b"stays", 0, 2)
    store.push(b"z", b"a", b"prio-0 only", 0, 0)
    clock.advance(0.125)
    assert payloads(store.peek(b"q", 10)) == [b"stays"]
    assert store.peek(b"z", 10) == []
    assert store.peek(b"missing", 10) == []


def test_peek_of_zero_packets_shows_none_and_a_negative_count_is_refused(
    store: QueueStore,
) -> None:
    """``count`` is at most how many: 0 shows nothing on every store (the Redis store's script
    and the packed store always did; ``QueueStore`` once showed every packet)."""
    push(store, b"a")
    push(store, b"b", prio=2)
    assert store.peek(b"q", 0) == []
    with pytest.raises(ValueError, match="0 or more"):
        store.peek(b"q", -1)
    assert payloads(store.peek(b"q", 1)) == [b"a"]
    assert store.depth(b"q") == 2


def test_purge_removes_every_packet_prio_zero_included(store: QueueStore, clock: FakeClock) -> None:
    store.push(b"q", b"a", b"x", 0, 0)
    store.push(b"q", b"b", b"y", 250, 3)
    store.push(b"q", b"b", b"z", 0, 0)
    store.push(b"other", b"a", b"w", 0, 1)
    assert store.purge(b"q") == 3
    assert store.purge(b"q") == 0
    assert (store.depth(b"q"), len(store), store.purged) == (0, 1, 3)
    assert store.bytes_held == 1 + 1 + overhead(store)
    assert store.unselectable_bytes == 0
    store.check_invariants()
    # Its expiry entries went stale: a reused name and key are not expired with them.
    store.push(b"q", b"b", b"new", 0, 1)
    clock.advance(0.25)
    assert store.expire() == 0
    assert payloads(store.pop(b"q")) == [b"new"]
    store.check_invariants()


def test_queue_info_counts_bytes_and_packets_per_priority(store: QueueStore) -> None:
    store.push(b"q", b"k1", b"abc", 0, 7)
    store.push(b"q", b"k2", b"de", 0, 0)
    store.push(b"q", b"k3", b"f", 0, 7)
    store.push(b"q", b"k4", b"", 0, 255)
    info = store.queue_info(b"q")
    assert info.packets == 4
    assert info.bytes == 2 * 4 + 6 + 4 * overhead(store)
    assert info.by_priority == {0: 1, 7: 2, 255: 1}
    assert info.next_expiry is None
    assert store.queue_info(b"none") == (0, 0, {}, None, None, 0)


def test_queue_info_by_priority_after_grouped_pops_and_expiry(
    store: QueueStore, clock: FakeClock
) -> None:
    # Siblings and expired packets leave stale level entries: they must not be counted.
    for i in range(6):
        store.push(b"q", b"k%d" % (i % 2), b"p", 125 if i >= 4 else 0, 3)
    store.push(b"q", b"solo", b"p", 125, 5)
    assert store.pop(b"q")  # k1: i = 1, 3, 5
    clock.advance(0.125)
    store.expire()  # i = 4 (k0) and solo
    assert store.queue_info(b"q").by_priority == {3: 2}
    store.check_invariants()


def test_queue_info_next_expiry_is_the_queues_own(store: QueueStore, clock: FakeClock) -> None:
    store.push(b"a", b"k", b"p", 500, 1)
    store.push(b"b", b"k", b"p", 250, 1)
    store.push(b"b", b"j", b"p", 1000, 1)
    assert store.queue_info(b"a").next_expiry == 0.5
    assert store.queue_info(b"b").next_expiry == 0.25
    assert store.pop(b"b")  # j, the newest, goes; k's 0.25 stays the next
    clock.advance(0.125)
    assert store.queue_info(b"b").next_expiry == 0.125
    assert store.pop(b"b")
    assert store.queue_info(b"b").next_expiry is None
    store.check_invariants()


def test_oldest_age_reads_the_time_notes(store: QueueStore, clock: FakeClock) -> None:
    store.push(b"q", b"early", b"p", 0, 1)
    assert store.queue_info(b"q").oldest_age is None  # pushed before any note
    store.note_time()
    clock.advance(1.0)
    store.push(b"q", b"a", b"p", 0, 2)
    store.note_time()
    clock.advance(1.0)
    store.push(b"q", b"b", b"p", 0, 3)
    clock.advance(0.5)
    store.pop(b"q")  # early (prio 1) goes: "a" is the oldest, pushed after the first note
    assert store.queue_info(b"q").oldest_age == 2.5
    store.pop(b"q")  # "b": pushed after the second note, 1.5 s ago at most
    assert store.queue_info(b"q").oldest_age == 1.5


def test_a_push_after_a_quiet_spell_is_dated_from_the_latest_note(
    store: QueueStore, clock: FakeClock
) -> None:
    # Notes taken while nothing was pushed still say "nothing new by now": a push after 30 s of
    # quiet is at most a second old, not 30 s.
    store.push(b"old", b"k", b"p", 0, 1)
    for _ in range(31):
        store.note_time()
        clock.advance(1.0)
    clock.advance(-0.5)  # half a second after the last note
    store.push(b"q", b"k", b"p", 0, 1)
    assert store.queue_info(b"q").oldest_age == 0.5
    assert store.queue_info(b"old").oldest_age is None  # pushed before any note


def test_time_notes_stay_bounded(store: QueueStore, clock: FakeClock) -> None:
    store.note_time()
    for i in range(10_000):
        store.push(b"q", b"k%d" % i, b"p", 0, 1)
        clock.advance(1.0)
        store.note_time()
    assert len(store._time_notes) <= 4096
    age = store.queue_info(b"q").oldest_age
    assert age is not None
    assert 10_000 <= age <= 10_001


def test_oldest_packet_of_a_group_that_lost_its_first(store: QueueStore, clock: FakeClock) -> None:
    # A group whose oldest packet expired keeps its place among the keys; the queue's oldest
    # packet is then in another group.
    store.note_time()
    store.push(b"q", b"k", b"first", 125, 0)
    clock.advance(1.0)
    store.note_time()
    store.push(b"q", b"j", b"second", 0, 0)
    clock.advance(1.0)
    store.note_time()
    store.push(b"q", b"k", b"third", 0, 0)
    clock.advance(1.0)
    store.expire()
    store.check_invariants()  # asserts oldest() is the packet with the smallest seq
    assert store.queue_info(b"q").oldest_age == 2.0  # "second", pushed at the second note


@dataclass
class ModelPacket:
    queue: bytes
    key: bytes
    payload: bytes
    prio: int
    seq: int
    deadline: float  # inf for TTL 0
    #: Whether it is in its queue: false while a delayed packet waits for a sweep after its
    #: due time (decision 21).
    arrived: bool = True
    due: float = 0.0


@dataclass
class Model:
    """Decisions 1-5, 21 and 22 as plain list scans. Like the store, it sweeps expired packets,
    and lets delayed packets that are due arrive, on pop, peek and expire, so its counts
    include due packets until one of those runs."""

    max_pop: int
    overhead: int = PACKET_OVERHEAD  # the store's bytes_held estimate per packet
    now: float = 0.0
    packets: list[ModelPacket] = field(default_factory=list)  # push order
    seq: int = 0

    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> None:
        self.seq += 1
        deadline = self.now + ttl_ms / 1000 if ttl_ms else float("inf")
        self.packets.append(ModelPacket(queue, key, payload, prio, self.seq, deadline))

    def push_delayed(
        self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int, delay_ms: int
    ) -> None:
        self.seq += 1
        due = self.now + delay_ms / 1000
        deadline = due + ttl_ms / 1000 if ttl_ms else float("inf")
        packet = ModelPacket(queue, key, payload, prio, self.seq, deadline, False, due)
        self.packets.append(packet)

    def expire(self) -> int:
        live = [p for p in self.packets if self.now < p.deadline]
        removed = len(self.packets) - len(live)
        self.packets = live
        for p in live:
            p.arrived = p.arrived or p.due <= self.now
        return removed

    def queued(self, queue: bytes) -> list[ModelPacket]:
        return [p for p in self.packets if p.queue == queue and p.arrived]

    def best(self, queue: bytes) -> ModelPacket | None:
        self.expire()
        candidates = [p for p in self.queued(queue) if p.prio > 0]
        return min(candidates, key=lambda p: (p.prio, -p.seq), default=None)

    def pop(self, queue: bytes) -> list[ModelPacket]:
        selected = self.best(queue)
        if selected is None:
            return []
        siblings = [p for p in self.queued(queue) if p.key == selected.key and p is not selected][
            : self.max_pop - 1
        ]
        reply = [selected, *siblings]
        self.packets = [p for p in self.packets if all(p is not r for r in reply)]
        return reply

    def depth(self, queue: bytes) -> int:
        return len(self.queued(queue))

    def peek(self, queue: bytes, count: int) -> list[ModelPacket]:
        self.expire()
        kept = list(self.packets)
        found: list[ModelPacket] = []
        while len(found) < count and (reply := self.pop(queue)):
            found += reply
        self.packets = kept
        return found[:count]

    def purge(self, queue: bytes) -> int:
        self.expire()
        gone = sum(p.queue == queue for p in self.packets)
        self.packets = [p for p in self.packets if p.queue != queue]
        return gone

    def info(self, queue: bytes) -> tuple[int, int, dict[int, int], float | None, int]:
        mine = self.queued(queue)
        by_priority: dict[int, int] = {}
        for p in sorted(mine, key=lambda p: p.prio):
            by_priority[p.prio] = by_priority.get(p.prio, 0) + 1
        deadlines = [p.deadline for p in mine if p.deadline != float("inf")]
        next_expiry = max(0.0, min(deadlines) - self.now) if deadlines else None
        held = [p for p in self.packets if p.queue == queue]
        size = sum(len(p.key) + len(p.payload) + self.overhead for p in held)
        return len(mine), size, by_priority, next_expiry, len(held) - len(mine)

    def next_deadline(self) -> float | None:
        """The earliest TTL deadline of a queued packet or due time of a delayed one."""
        times = [p.deadline if p.arrived else p.due for p in self.packets]
        return min((t for t in times if t != float("inf")), default=None)

    def move(self, source: bytes, target: bytes, limit: int) -> int:
        """Decision 22: whole groups in pop order (or all), renumbered as pushes made now."""
        self.expire()
        moving: list[ModelPacket] = []
        if not limit:
            moving = self.queued(source)
        while limit and len(moving) < limit and (selected := self.best(source)) is not None:
            moving += [p for p in self.queued(source) if p.key == selected.key]
            for p in moving:
                p.queue = target  # out of the source, so best() looks further
        for p in sorted(moving, key=lambda p: p.seq):
            self.seq += 1
            p.seq, p.queue = self.seq, target
        self.packets.sort(key=lambda p: p.seq)
        return len(moving)

    def restore(self, queue: bytes, group: list[ModelPacket]) -> int:
        """Taken packets go back where they were in push order, to ``queue``; TTL wins."""
        live = [p for p in group if self.now < p.deadline]
        for p in live:
            p.queue = queue
        self.packets = sorted([*self.packets, *live], key=lambda p: p.seq)
        return len(live)


QUEUES = (b"", b"a", b"b", b"a.dead")
KEYS = (b"", b"x", b"y")


def described(packets: list[QueuedPacket]) -> list[tuple[bytes, bytes, int]]:
    return [(p[KEY], p[PAYLOAD], p[PRIO]) for p in packets]


def described_model(packets: list[ModelPacket]) -> list[tuple[bytes, bytes, int]]:
    return [(p.key, p.payload, p.prio) for p in packets]


class StoreVersusModel(RuleBasedStateMachine):
    MAX_POP = 3
    STORE: type[QueueStore] = QueueStore

    @initialize()
    def start(self) -> None:
        self.clock = FakeClock(0.0)
        self.store = self.STORE(self.clock, max_pop=self.MAX_POP)
        self.model = Model(max_pop=self.MAX_POP, overhead=overhead(self.store))
        self.pushes = 0
        self.taken: list[tuple[list[QueuedPacket], list[ModelPacket]]] = []

    @rule(
        queue=st.sampled_from(QUEUES),
        key=st.sampled_from(KEYS),
        prio=st.sampled_from([0, 1, 2, 3, 255]),
        ttl_ms=st.sampled_from([0, 0, 125, 250, 500]),
    )
    def push(self, queue: bytes, key: bytes, prio: int, ttl_ms: int) -> None:
        self.pushes += 1
        payload = b"%d" % self.pushes  # names the packet
        self.store.push(queue, key, payload, ttl_ms, prio)
        self.model.push(queue, key, payload, ttl_ms, prio)

    @rule(
        queue=st.sampled_from(QUEUES),
        key=st.sampled_from(KEYS),
        prio=st.sampled_from([0, 1, 2, 255]),
        ttl_ms=st.sampled_from([0, 125, 500]),
        delay_ms=st.sampled_from([125, 250, 500]),
    )
    def push_delayed(self, queue: bytes, key: bytes, prio: int, ttl_ms: int, delay_ms: int) -> None:
        self.pushes += 1
        payload = b"%d" % self.pushes
        self.store.push_delayed(queue, key, payload, ttl_ms, prio, delay_ms)
        self.model.push_delayed(queue, key, payload, ttl_ms, prio, delay_ms)

    @rule(
        source=st.sampled_from(QUEUES),
        to=st.sampled_from(QUEUES),  # ``target`` is a keyword of ``rule``
        limit=st.sampled_from([0, 1, 2, 5]),
    )
    def move(self, source: bytes, to: bytes, limit: int) -> None:
        if source != to:
            assert self.store.move(source, to, limit) == self.model.move(source, to, limit)

    @rule(queue=st.sampled_from(QUEUES))
    def pop(self, queue: bytes) -> None:
        assert described(self.store.pop(queue)) == described_model(self.model.pop(queue))

    @rule(queue=st.sampled_from(QUEUES))
    def take(self, queue: bytes) -> None:
        taken, expected = self.store.take(queue), self.model.pop(queue)
        assert described(taken) == described_model(expected)
        if taken:
            self.taken.append((taken, expected))

    @rule(data=st.data(), elsewhere=st.booleans())
    def restore(self, data: st.DataObject, elsewhere: bool) -> None:
        if self.taken:
            taken, expected = self.taken.pop(data.draw(st.integers(0, len(self.taken) - 1)))
            # Back to its own queue, or (a dead letter) to another; the lease count changed.
            queue = expected[0].queue + b".dead" if elsewhere else expected[0].queue
            back = [(*p[:LEASES], p[LEASES] + 1) for p in taken]
            returned = self.store.restore(queue, back)
            assert returned == self.model.restore(queue, expected)

    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        if self.taken:
            taken, _ = self.taken.pop(data.draw(st.integers(0, len(self.taken) - 1)))
            self.store.discard(taken)

    @rule(seconds=st.sampled_from([0.125, 0.25, 0.5]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.model.now += seconds

    @rule()
    def expire(self) -> None:
        assert self.store.expire() == self.model.expire()

    @rule()
    def peek_all(self) -> None:
        # Ranks must name the model's best packet's prio, and order queues as the model does.
        store_ranks: dict[bytes, tuple[int, int]] = {}
        model_ranks: dict[bytes, tuple[int, int]] = {}
        for q in QUEUES:
            rank, best = self.store.peek_rank(q), self.model.best(q)
            assert (rank is None) == (best is None)
            if rank is not None and best is not None:
                assert rank[0] == best.prio
                store_ranks[q], model_ranks[q] = rank, (best.prio, -best.seq)
        assert sorted(store_ranks, key=store_ranks.__getitem__) == sorted(
            model_ranks, key=model_ranks.__getitem__
        )

    @rule()
    def next_deadline(self) -> None:
        assert self.store.next_deadline() == self.model.next_deadline()

    @rule(queue=st.sampled_from(QUEUES), count=st.sampled_from([0, 1, 2, 5, 100]))
    def peek(self, queue: bytes, count: int) -> None:
        peeked = described(self.store.peek(queue, count))
        assert peeked == described_model(self.model.peek(queue, count))

    @rule(queue=st.sampled_from(QUEUES))
    def purge(self, queue: bytes) -> None:
        self.store.expire()  # the model sweeps first; the store's purge counts due packets too
        assert self.store.purge(queue) == self.model.purge(queue)

    @invariant()
    def same_counts(self) -> None:
        self.store.check_invariants()
        assert self.store.taken_bytes == sum(
            len(p[KEY]) + len(p[PAYLOAD]) + overhead(self.store)
            for group, _ in self.taken
            for p in group
        )
        assert len(self.store) == len(self.model.packets)
        assert self.store.queue_count == len({p.queue for p in self.model.packets})
        sizes = {name: (packets, size) for name, packets, size in self.store.sizes()}
        for q in QUEUES:
            assert self.store.depth(q) == self.model.depth(q)
            info = self.store.queue_info(q)
            assert (
                info.packets,
                info.bytes,
                info.by_priority,
                info.next_expiry,
                info.delayed,
            ) == self.model.info(q)
            assert sizes.get(q, (0, 0)) == (info.packets, info.bytes)
        assert self.store.delayed_bytes == sum(
            len(p.key) + len(p.payload) + overhead(self.store)
            for p in self.model.packets
            if not p.arrived
        )


StoreVersusModel.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
test_store_matches_naive_model = StoreVersusModel.TestCase

if packed.available:

    class PackedStoreVersusModel(StoreVersusModel):
        STORE = packed.PackedStore

    PackedStoreVersusModel.TestCase.settings = StoreVersusModel.TestCase.settings
    test_packed_store_matches_naive_model = PackedStoreVersusModel.TestCase


def test_stale_level_entries_stay_bounded() -> None:
    # Packets that leave with a key group or by expiry leave stale entries in their priority
    # levels (lazy deletion); a queue's levels must be rebuilt before those outnumber its live
    # packets, or memory would grow with every grouped pop. White-box: reads the queue's count.
    clock = FakeClock()
    store = QueueStore(clock)
    for i in range(5000):
        store.push(b"q", b"k%d" % (i % 500), b"p", 100 if i % 3 else 0, 1 + i % 255)
    for _ in range(200):
        assert store.pop(b"q")
        store.check_invariants()
    clock.now += 1.0
    store.expire()
    store.check_invariants()
    q = store._queues[b"q"]
    assert q.entries <= 2 * q.size + 65
    assert store.depth(b"q") == len(store)


def test_displaced_keys_stay_bounded(clock: FakeClock) -> None:
    # Groups that lose their oldest packet are remembered (for the queue's oldest packet); the
    # memory must not grow with keys that have since left. White-box: reads the queue's set.
    store = QueueStore(clock)
    for round_number in range(20):
        for i in range(100):
            key = b"k%d-%d" % (round_number, i)
            store.push(b"q", key, b"first", 125, 0)
            store.push(b"q", key, b"second", 0, 1)
        clock.advance(0.125)
        store.expire()  # every group loses its first packet: displaced
        for _ in range(100):
            assert store.pop(b"q")  # and then leaves
    store.push(b"q", b"last", b"p", 125, 0)
    store.push(b"q", b"last", b"p", 0, 0)
    clock.advance(0.125)
    store.expire()
    displaced = store._queues[b"q"].displaced
    assert displaced is not None
    assert len(displaced) <= 100 + 64 + 1


# --- leases: take, restore, discard (decisions 13-16) --------------------------------------------


def test_take_is_a_pop_whose_bytes_stay_held_until_discarded(store: QueueStore) -> None:
    push(store, b"a", key=b"k")
    push(store, b"b", key=b"k", prio=0)
    held = store.bytes_held
    taken = store.take(b"q")
    assert payloads(taken) == [b"a", b"b"]
    assert len(store) == 0
    assert store.pop(b"q") == []
    assert store.bytes_held == held == store.taken_bytes
    assert store.unselectable_bytes == 0  # a taken prio-0 packet leaves with its lease
    store.check_invariants()
    store.discard(taken)
    assert store.bytes_held == store.taken_bytes == 0
    store.check_invariants()


def test_a_packet_restored_takes_its_place_in_push_order(store: QueueStore) -> None:
    push(store, b"old", prio=2)
    taken = store.take(b"q")
    push(store, b"new", prio=2)
    push(store, b"newest", prio=2)
    assert store.restore(b"q", taken) == 1
    store.check_invariants()
    # Newest first among equal priorities (decision 2): "old" is still the oldest.
    assert [payloads(store.pop(b"q")) for _ in range(3)] == [[b"newest"], [b"new"], [b"old"]]


def test_a_restored_group_merges_with_newer_packets_of_its_key_in_push_order(
    store: QueueStore,
) -> None:
    push(store, b"1", key=b"k", prio=3)
    push(store, b"2", key=b"k", prio=0)
    taken = store.take(b"q")
    push(store, b"3", key=b"k", prio=0)
    push(store, b"4", key=b"k", prio=5)
    store.restore(b"q", taken)
    store.check_invariants()
    # The best packet ("1", prio 3) first, then the rest of the key in push order (decision 3).
    assert payloads(store.pop(b"q")) == [b"1", b"2", b"3", b"4"]


def test_a_restored_packet_reuses_the_level_entry_it_left_behind(store: QueueStore) -> None:
    push(store, b"a", key=b"k", prio=1)
    push(store, b"b", key=b"k", prio=4)  # leaves with "a", its prio-4 entry stays, stale
    taken = store.take(b"q")
    assert store.restore(b"q", [(*p[:LEASES], 1) for p in taken]) == 2
    store.check_invariants()  # each packet exactly once in its level, as the new tuple
    assert [p[LEASES] for p in store.pop(b"q")] == [1, 1]


def test_a_restored_packet_keeps_its_ttl_deadline(store: QueueStore, clock: FakeClock) -> None:
    push(store, b"a", ttl_ms=1000)
    taken = store.take(b"q")
    clock.advance(0.5)
    store.restore(b"q", taken)
    assert store.next_deadline() == 1001.0
    clock.advance(0.5)
    assert store.expire() == 1
    assert store.bytes_held == 0
    store.check_invariants()


def test_a_packet_whose_ttl_passed_while_taken_is_dropped_on_restore(
    store: QueueStore, clock: FakeClock
) -> None:
    push(store, b"short", key=b"k", ttl_ms=250)
    push(store, b"long", key=b"k", ttl_ms=1000, prio=2)
    taken = store.take(b"q")
    clock.advance(0.25)
    assert store.restore(b"q", taken) == 1  # TTL wins (decision 15)
    assert store.expired == 1
    assert payloads(store.pop(b"q")) == [b"long"]
    assert store.bytes_held == store.taken_bytes == 0
    store.check_invariants()


def test_restore_to_another_queue_keeps_order_and_deadline(
    store: QueueStore, clock: FakeClock
) -> None:
    push(store, b"a", ttl_ms=1000)
    taken = store.take(b"q")
    push(store, b"b", queue=b"q.dead")
    assert store.restore(b"q.dead", taken) == 1
    assert store.queue_count == 1
    assert payloads(store.pop(b"q.dead")) == [b"b"]  # "a" is older
    assert store.next_deadline() == 1001.0
    store.check_invariants()


def test_two_expiry_entries_of_a_restored_packet_expire_it_once(
    store: QueueStore, clock: FakeClock
) -> None:
    push(store, b"a", ttl_ms=500)
    for _ in range(3):  # each round trip files an expiry entry; the old ones stay in the heap
        store.restore(b"q", store.take(b"q"))
    store.check_invariants()
    clock.advance(0.5)
    assert store.expire() == 1
    assert len(store) == 0
    assert store.next_deadline() is None


def test_expiry_compaction_keeps_one_entry_per_packet() -> None:
    # A packet leased and returned again and again must not grow the heap without bound.
    store = QueueStore(FakeClock())
    push(store, b"a", ttl_ms=60_000)
    for i in range(1000):
        push(store, b"x%d" % i, queue=b"other")
        store.pop(b"other")  # pops compact the heap once it is twice the live packets
        store.restore(b"q", store.take(b"q"))
    assert len(store._expiry) <= 2 * len(store) + 65  # white-box: the heap's length
    store.check_invariants()


@given(
    st.lists(
        st.tuples(
            st.sampled_from([b"a", b"b"]),
            st.sampled_from([b"k1", b"k2", b"k3", b"k4"]),
            st.integers(0, 3),
            st.sampled_from([0, 0, 250, 2000]),
        ),
        max_size=40,
    ),
    st.sampled_from([0.0, 0.125, 1.0]),
)
def test_load_rebuilds_the_order_pushes_made(
    pushes: list[tuple[bytes, bytes, int, int]], later: float
) -> None:
    """What a recovery does: the packets still held (one pop took some, so the log's seqs have
    gaps) put back with their seqs and deadlines pop, and expire, exactly as in the store that
    pushed them."""
    clock = FakeClock(1000.0)
    pushed, restored = QueueStore(clock), QueueStore(clock)
    packets, deadlines = [], {}
    for i, (queue, key, prio, ttl_ms) in enumerate(pushes):
        payload = b"%d" % i
        deadline = pushed.push(queue, key, payload, ttl_ms, prio)
        packets.append((queue, key, payload, prio, pushed.pushed))
        if ttl_ms:
            deadlines[pushed.pushed] = deadline
    popped = {packet[SEQ] for packet in pushed.pop(b"a")}
    packets = [packet for packet in packets if packet[4] not in popped]
    restored.load(packets, deadlines, pushed.pushed)
    restored.check_invariants()
    assert restored.pushed == len(packets)  # the packets pushed before a restart are gone
    assert (len(restored), restored.bytes_held) == (len(pushed), pushed.bytes_held)
    assert restored.unselectable_bytes == pushed.unselectable_bytes
    assert restored.next_deadline() == pushed.next_deadline()
    clock.advance(later)
    for queue in (b"a", b"b"):
        while reply := pushed.pop(queue):
            assert restored.pop(queue) == reply
        assert restored.pop(queue) == []
    assert len(restored) == len(pushed)  # the riders left behind
    restored.push(b"a", b"new", b"", 0, 1)
    pushed.push(b"a", b"new", b"", 0, 1)
    assert restored.pop(b"a")[0][SEQ] == pushed.pop(b"a")[0][SEQ]  # seqs go on after the last


def test_load_refuses_packets_out_of_push_order(clock: FakeClock) -> None:
    store = QueueStore(clock)  # load is the log-backed store's, which is built on QueueStore
    store.load([(b"q", b"k", b"", 1, 5)], {}, 7)
    assert (len(store), store.pushed) == (1, 1)
    with pytest.raises(ValueError, match="loading seq 7 after seq 7"):
        store.load([(b"q", b"k", b"", 1, 7)], {}, 7)


# --- the packed store against the reference ------------------------------------------------------


def _same_state(reference: QueueStore, other: QueueStore, taken: int) -> None:
    """Two stores given the same calls hold the same packets. Their ``bytes_held`` differ only
    by each layout's overhead estimate per packet held (queued, or ``taken`` by leases)."""
    other.check_invariants()
    assert (len(other), other.expired, other.purged, other.pushed) == (
        len(reference),
        reference.expired,
        reference.purged,
        reference.pushed,
    )
    held = len(reference) + taken
    other_delayed = sum(other.queue_info(name).delayed for name, _, _ in other.sizes())
    assert other.bytes_held - held * overhead(other) == (
        reference.bytes_held - held * overhead(reference)
    )
    assert other.delayed_bytes - other_delayed * overhead(other) == (
        reference.delayed_bytes - other_delayed * overhead(reference)
    )

    def net(store: QueueStore, name: bytes, packets: int, held: int) -> tuple[bytes, int, int]:
        return name, packets, held - (packets + store.queue_info(name).delayed) * overhead(store)

    # in no particular order: a queue holding only delayed packets comes last in QueueStore's
    assert sorted(net(other, *row) for row in other.sizes()) == sorted(
        net(reference, *row) for row in reference.sizes()
    )
    assert other.next_deadline() == reference.next_deadline()
    for name, _, _ in reference.sizes():
        assert other.queued(name) == reference.queued(name)
        info, other_info = reference.queue_info(name), other.queue_info(name)
        assert (info.packets, info.by_priority, info.next_expiry, info.delayed) == (
            other_info.packets,
            other_info.by_priority,
            other_info.next_expiry,
            other_info.delayed,
        )


def _same_pop(
    reference: QueueStore, packed_store: packed.PackedStore, queue: bytes, how: str
) -> None:
    """A pop on both stores, the packed one popping as ``how`` says: ``pop`` (tuples), or
    ``pop_reply`` / ``pop_delivery`` (bytes written after what the output held, which must be
    what ``wire.append_reply`` makes of the reference's tuples; a delivery writes nothing when
    nothing was popped)."""
    popped = reference.pop(queue)
    if how == "pop":
        assert packed_store.pop(queue) == popped
        return
    expected, written = bytearray(b"earlier"), bytearray(b"earlier")
    if popped or how == "reply":
        wire.append_reply(expected, popped)
    pop_into = packed_store.pop_reply if how == "reply" else packed_store.pop_delivery
    assert pop_into(queue, written) == len(popped)
    assert written == expected


@pytest.mark.skipif(not packed.available, reason="the packed store's C core is not built")
@pytest.mark.parametrize("seed", range(4))
def test_packed_store_matches_queue_store_at_scale(seed: int) -> None:
    """Thousands of random calls, many keys and priorities, TTLs, leases, delays, moves and
    purges, on both
    stores: every answer the same (packets with their seq, deadline and lease count), which
    drives the packed store through table growth, level compaction and heap removals that the
    state machine's few packets never reach."""
    rng = random.Random(seed)
    clock = FakeClock(0.0)
    reference, packed_store = QueueStore(clock, max_pop=5), packed.PackedStore(clock, max_pop=5)
    queues = [b"a", b"b", b"c", b"a.dead"]
    keys = [b"k%d" % i for i in range(60)]
    taken: list[tuple[bytes, list[QueuedPacket], list[QueuedPacket]]] = []
    taken_count = 0
    for step in range(6000):
        queue = rng.choice(queues)
        roll = rng.random()
        if roll < 0.5:
            args = (
                queue,
                rng.choice(keys),
                b"%d" % step,
                rng.choice([0, 0, 0, 125, 250, 2000]),
                rng.choice([0, 1, 1, 2, 3, 7, 255]),
            )
            assert reference.push(*args) == packed_store.push(*args)
        elif roll < 0.72:
            _same_pop(reference, packed_store, queue, rng.choice(["pop", "reply", "delivery"]))
        elif roll < 0.8:
            group = reference.take(queue)
            assert packed_store.take(queue) == group
            if group:
                taken.append((queue, group, list(group)))
                taken_count += len(group)
        elif roll < 0.86 and taken:
            home, group, same = taken.pop(rng.randrange(len(taken)))
            taken_count -= len(group)
            if rng.random() < 0.3:
                reference.discard(group)
                packed_store.discard(same)
            else:
                target = rng.choice([home, home + b".dead"])
                assert reference.restore(target, group) == packed_store.restore(target, same)
        elif roll < 0.9:
            count = rng.randrange(20)
            assert described(packed_store.peek(queue, count)) == described(
                reference.peek(queue, count)
            )
        elif roll < 0.93:
            assert reference.peek_rank(queue) == packed_store.peek_rank(queue)
            info, packed_info = reference.queue_info(queue), packed_store.queue_info(queue)
            assert (info.packets, info.by_priority, info.next_expiry) == (
                packed_info.packets,
                packed_info.by_priority,
                packed_info.next_expiry,
            )
        elif roll < 0.935:
            assert reference.purge(queue) == packed_store.purge(queue)
        elif roll < 0.965:
            args = (queue, rng.choice(keys), b"d%d" % step, rng.choice([0, 250]), 1 + step % 4)
            delay_ms = rng.choice([125, 500, 1500])
            assert reference.push_delayed(*args, delay_ms) == packed_store.push_delayed(
                *args, delay_ms
            )
        elif roll < 0.975:
            target, limit = rng.choice(queues), rng.choice([0, 1, 7])
            if target != queue:
                assert reference.move(queue, target, limit) == packed_store.move(
                    queue, target, limit
                )
        else:
            clock.advance(rng.choice([0.125, 0.25, 1.0]))
            assert reference.expire() == packed_store.expire()
            assert reference.take_arrived() == packed_store.take_arrived()
        if step % 250 == 0:
            _same_state(reference, packed_store, taken_count)
    _same_state(reference, packed_store, taken_count)
    for queue in queues:
        while reply := reference.pop(queue):
            assert packed_store.pop(queue) == reply
        assert packed_store.pop(queue) == []


@pytest.mark.skipif(not packed.available, reason="the packed store's C core is not built")
def test_a_drained_packed_queue_gives_its_index_memory_back(clock: FakeClock) -> None:
    """A queue that held 50,000 keys and drained to 10 packets keeps indexes of its new size,
    not of its peak: the group table halves as it empties, as levels and heaps do (read
    through the store's own accounting, ``index_bytes``, not RSS)."""
    store = packed.PackedStore(clock)
    for i in range(50_000):
        store.push(b"q", b"k%d" % i, b"p", 0, 1 + i % 3)
    peak = store.index_bytes(b"q")
    assert peak >= 50_000 * 8  # a slot and a level entry per packet at least
    while store.depth(b"q") > 10:
        store.pop(b"q")
    store.check_invariants()
    assert store.index_bytes(b"q") <= 4096  # about 64 slots and a level's minimum room
    for i in range(20):  # and it grows again as it fills
        store.push(b"q", b"again%d" % i, b"p", 0, 1)
    store.check_invariants()
    assert [p[PAYLOAD] for p in store.peek(b"q", 30)] == [b"p"] * 30


@pytest.mark.skipif(not packed.available, reason="the packed store's C core is not built")
def test_prefetching_a_batchs_pushes_changes_nothing(clock: FakeClock) -> None:
    """``prefetch_pushes`` only reads (the broker calls it before each batch): on a table large
    enough for it to probe, with frames of every shape, the store is as it was."""
    store = packed.PackedStore(clock)
    for i in range(40_000):
        store.push(b"q", b"k%d" % i, b"p", 0, 1)
    before = store.queued(b"q")
    frames: list[object] = [
        wire.Push(b"q", b"k7", b"p", 0, 1),  # a key already queued: its record is asked for
        wire.Push(b"q", b"new", b"p", 0, 1),
        wire.Push(b"other", b"k", b"p", 0, 1),  # no such queue
        wire.Pop(b"q"),
        wire.Sync(),
        (b"q", 1, 2, 3, 4),  # push-shaped, but no key
        "not a frame",
    ]
    for start in (0, 3, 100, -1):
        assert store.prefetch_pushes(frames, start) is None
    assert store.prefetch_pushes(tuple(frames), 0) is None  # not the codec's list: skipped
    assert store.queued(b"q") == before
    store.check_invariants()


def _huge_page_mappings() -> int:
    """This process's mappings advised MADV_HUGEPAGE (``hg`` among smaps' VmFlags)."""
    with open("/proc/self/smaps") as smaps:
        return sum(1 for line in smaps if line.startswith("VmFlags:") and " hg" in line)


@pytest.mark.skipif(not packed.available, reason="the packed store's C core is not built")
@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
    reason="no transparent huge pages here (Linux with THP only)",
)
def test_a_large_group_table_asks_for_huge_pages(clock: FakeClock) -> None:
    """A key-group table of 2 MiB or more (262,144 slots) is a mapping of its own, advised
    MADV_HUGEPAGE: at depth 1M a push's and a pop's slot is otherwise a TLB miss besides a
    cache miss. The mapping goes when the table halves below 2 MiB, and the store's answers
    are those of a table in ordinary memory."""
    store = packed.PackedStore(clock)
    before = _huge_page_mappings()
    for i in range(150_000):  # past 3/4 of 131,072 slots: the table doubles to 262,144
        store.push(b"q", b"k%d" % i, b"p%d" % i, 0, 1 + i % 7)
    assert _huge_page_mappings() == before + 1
    store.check_invariants()
    assert store.pop(b"q")[0][KEY] == b"k149996"  # the newest of prio 7
    while store.depth(b"q") > 30_000:  # below 1/8 of 262,144: it halves to 1 MiB
        store.pop(b"q")
    assert _huge_page_mappings() == before
    store.check_invariants()


@pytest.mark.skipif(not packed.available, reason="the packed store's C core is not built")
def test_a_group_table_past_two_million_slots_homes_keys_in_buckets(clock: FakeClock) -> None:
    """Past 2^21 slots (1,572,864 keys) a slot's 21 hash bits no longer name its home: a key's
    home is those bits times cap / 2^21, the same whether found from the key or the slot. Keys
    are found again (a push joins its key's group, a pop takes the group), removals shift
    entries back to where lookups find them, and the table halves back below 2^21."""
    store = packed.PackedStore(clock)
    keys = 1_600_000  # past 3/4 of 2^21 slots: the table doubles to 2^22
    for i in range(keys):
        store.push(b"q", b"k%d" % i, b"", 0, 1 + i % 7)
    assert store.index_bytes(b"q") >= 8 << 22
    grouped = {b"k%d" % i for i in range(0, keys, 100_003)}
    for key in grouped:  # a second packet of these keys joins their groups
        store.push(b"q", key, b"again", 0, 0)
    store.check_invariants()
    newest_first = max(i for i in range(keys) if i % 7 == 0)
    assert store.pop(b"q")[0][KEY] == b"k%d" % newest_first
    popped, seen = 1, 0
    while store.depth(b"q") > 200_000:  # every removal a backward shift in the big table
        group = store.pop(b"q")
        assert len(group) == (2 if group[0][KEY] in grouped else 1)
        if group[0][KEY] in grouped:
            assert [packet[PAYLOAD] for packet in group] == [b"", b"again"]
            seen += 1
        popped += 1
        if popped % 400_000 == 0:
            store.check_invariants()
    assert seen >= 10
    assert store.index_bytes(b"q") < 8 << 21  # halved back to a table the 21 bits name
    store.check_invariants()


@pytest.mark.skipif(not packed.available, reason="the packed store's C core is not built")
def test_popped_records_are_reused_and_few_are_kept(clock: FakeClock) -> None:
    """A record ``pop_reply`` frees is kept for the next push of its 16-byte size class (the
    block is still in cache), at most 16 a class: a reused record holds its new packet alone
    (keys and payloads of every length through each class, checked against what
    ``wire.append_reply`` makes of the reference store's pops), and draining 3,000 packets
    leaves no more than 17 classes' worth kept."""
    rng = random.Random(5)
    reference, store = QueueStore(clock), packed.PackedStore(clock)
    for _ in range(3):
        for _ in range(1_000):
            key, payload = rng.randbytes(rng.randint(1, 40)), rng.randbytes(rng.randint(0, 200))
            prio = rng.randint(1, 9)
            reference.push(b"q", key, payload, 0, prio)
            store.push(b"q", key, payload, 0, prio)
        while reference.depth(b"q"):
            _same_pop(reference, store, b"q", "reply")
        assert store.depth(b"q") == 0
        assert packed._core._spare_records() <= 17 * 16
    store.check_invariants()


# --- delayed packets (decision 21) ---------------------------------------------------------------


def push_delayed(
    store: QueueStore,
    payload: bytes,
    delay_ms: int,
    *,
    queue: bytes = b"q",
    key: bytes | None = None,
    prio: int = 1,
    ttl_ms: int = 0,
) -> float:
    """``push``, delayed by ``delay_ms``."""
    key = payload if key is None else key
    return store.push_delayed(queue, key, payload, ttl_ms, prio, delay_ms)


def test_a_delayed_packet_is_in_no_queue_until_due(store: QueueStore, clock: FakeClock) -> None:
    assert push_delayed(store, b"later", 500) == 1000.5  # its due time
    assert store.pop(b"q") == store.take(b"q") == []
    assert store.peek(b"q", 10) == []
    assert store.peek_rank(b"q") is None
    assert store.depth(b"q") == 0
    assert store.next_deadline() == 1000.5
    clock.advance(0.375)
    assert store.pop(b"q") == []
    clock.advance(0.125)  # due from the instant now >= push time + delay
    assert payloads(store.pop(b"q")) == [b"later"]  # a read makes it arrive, no sweep needed
    assert store.bytes_held == store.delayed_bytes == 0
    store.check_invariants()


def test_a_due_packet_keeps_its_place_in_push_order(store: QueueStore, clock: FakeClock) -> None:
    push_delayed(store, b"delayed", 250, prio=2)
    push(store, b"after", prio=2)
    clock.advance(0.25)
    store.expire()
    store.check_invariants()
    # Newest first among equal priorities: the packet pushed after it is popped first.
    assert [payloads(store.pop(b"q")) for _ in range(2)] == [[b"after"], [b"delayed"]]


def test_expire_files_due_packets_and_names_their_queues(
    store: QueueStore, clock: FakeClock
) -> None:
    push_delayed(store, b"a", 250, queue=b"x")
    push_delayed(store, b"b", 250, queue=b"x")
    push_delayed(store, b"c", 500, queue=b"y")
    assert store.take_arrived() == []
    clock.advance(0.25)
    assert store.expire() == 0  # arrivals are not removals
    assert store.take_arrived() == [b"x"]
    assert store.take_arrived() == []
    assert store.depth(b"x") == 2
    assert store.next_deadline() == 1000.5
    clock.advance(0.25)
    store.expire()
    assert store.take_arrived() == [b"y"]
    assert store.next_deadline() is None
    store.check_invariants()


def test_a_delayed_packets_ttl_counts_from_its_due_time(
    store: QueueStore, clock: FakeClock
) -> None:
    push_delayed(store, b"a", 500, ttl_ms=250)
    clock.advance(0.5)
    store.expire()
    assert store.next_deadline() == 1000.75  # due time plus TTL
    clock.advance(0.125)
    assert payloads(store.peek(b"q", 1)) == [b"a"]
    clock.advance(0.125)
    assert store.expire() == 1
    assert store.pop(b"q") == []
    store.check_invariants()


def test_a_ttl_longer_than_a_u16_is_kept(store: QueueStore, clock: FakeClock) -> None:
    push_delayed(store, b"a", 1000, ttl_ms=wire.MAX_TTL_MS)
    clock.advance(1.0)
    store.expire()
    assert store.next_deadline() == 1001.0 + wire.MAX_TTL_MS / 1000


def test_a_delayed_packet_whose_ttl_passed_before_it_arrived_is_dropped(
    store: QueueStore, clock: FakeClock
) -> None:
    push_delayed(store, b"a", 250, ttl_ms=125, prio=0)
    clock.advance(1.0)  # due and past its deadline when the sweep comes: TTL wins
    assert store.expire() == 1
    assert store.expired == 1
    assert store.take_arrived() == []
    assert len(store) == store.bytes_held == store.unselectable_bytes == store.queue_count == 0
    store.check_invariants()


def test_a_delayed_packet_joins_its_key_group_when_due(store: QueueStore, clock: FakeClock) -> None:
    push(store, b"first", key=b"k", prio=3)
    push_delayed(store, b"second", 250, key=b"k", prio=0)
    push(store, b"third", key=b"k", prio=0)
    taken = store.take(b"q")
    assert payloads(taken) == [b"first", b"third"]  # not in the group while delayed
    store.discard(taken)
    push(store, b"fourth", key=b"k", prio=5)
    clock.advance(0.25)
    assert payloads(store.pop(b"q")) == [b"fourth", b"second"]  # in it, in push order
    store.check_invariants()


def test_delayed_packets_count_as_held_and_delayed_but_not_queued(store: QueueStore) -> None:
    push_delayed(store, b"abc", 250, key=b"k", queue=b"only-delayed")
    push(store, b"de", queue=b"both")
    push_delayed(store, b"f", 250, queue=b"both")
    size = {b"abc": 3 + 1 + overhead(store), b"f": 2 + overhead(store)}
    assert store.delayed_bytes == size[b"abc"] + size[b"f"]
    assert store.bytes_held == store.delayed_bytes + 4 + overhead(store)
    assert len(store) == 3
    assert store.pushed == 3
    assert store.queue_count == 2
    assert sorted(store.sizes()) == [
        (b"both", 1, 4 + overhead(store) + size[b"f"]),
        (b"only-delayed", 0, size[b"abc"]),
    ]
    assert store.queue_info(b"only-delayed") == (0, size[b"abc"], {}, None, None, 1)
    info = store.queue_info(b"both")
    assert (info.packets, info.delayed, info.by_priority) == (1, 1, {1: 1})
    store.check_invariants()


def test_purge_removes_delayed_packets_too(store: QueueStore, clock: FakeClock) -> None:
    push(store, b"a")
    push_delayed(store, b"b", 250, ttl_ms=125)
    push_delayed(store, b"c", 250, queue=b"other")
    assert store.purge(b"q") == 2
    assert store.purged == 2
    assert store.bytes_held == store.delayed_bytes == 2 + overhead(store)  # "c" only
    push_delayed(store, b"d", 500)  # the name again: the purged packet's entry stays stale
    clock.advance(0.25)
    store.expire()
    assert store.take_arrived() == [b"other"]
    assert store.pop(b"q") == []
    store.check_invariants()
    assert store.next_deadline() == 1000.5


# --- move (decision 22) --------------------------------------------------------------------------


def test_move_all_keeps_relative_order_and_makes_the_packets_newest(
    store: QueueStore, clock: FakeClock
) -> None:
    push(store, b"old", queue=b"jobs.dead", prio=2)
    push(store, b"alone", queue=b"jobs.dead", prio=0)  # prio 0, no selectable sibling
    push(store, b"new", queue=b"jobs.dead", prio=2)
    push(store, b"there", queue=b"jobs", prio=2)
    assert store.move(b"jobs.dead", b"jobs", 0) == 3
    assert store.queue_count == 1
    store.check_invariants()
    # Pushes made now, in their old relative order: newer than "there", "new" newer than "old".
    assert [payloads(store.pop(b"jobs")) for _ in range(4)] == [[b"new"], [b"old"], [b"there"], []]
    assert store.depth(b"jobs") == 1  # "alone" moved too
    assert (store.pushed, len(store)) == (4, 1)  # a move is no push


def test_move_keeps_ttl_deadlines_and_resets_attempts(store: QueueStore, clock: FakeClock) -> None:
    push(store, b"a", ttl_ms=1000)
    store.restore(b"q", [(*p[:LEASES], 7) for p in store.take(b"q")])  # leased 7 times
    clock.advance(0.5)
    assert store.move(b"q", b"r", 0) == 1
    (packet,) = store.peek(b"r", 1)
    assert (packet[DEADLINE], packet[LEASES]) == (1001.0, 0)
    clock.advance(0.5)
    assert store.expire() == 1
    store.check_invariants()


def test_move_with_a_limit_takes_whole_groups_in_pop_order(store: QueueStore) -> None:
    push(store, b"g1", key=b"g", prio=3)
    push(store, b"g2", key=b"g", prio=0)
    push(store, b"g3", key=b"g", prio=3)
    push(store, b"best", prio=1)
    push(store, b"next", prio=2)
    push(store, b"lone0", prio=0)
    push(store, b"last", prio=4)
    assert store.move(b"q", b"r", 2) == 2  # "best" and "next", as pops would take them
    assert store.move(b"q", b"r", 1) == 3  # a first group larger than the limit moves whole
    assert store.move(b"q", b"r", 2) == 1  # "last": fewer than 2 moved, nothing else to
    assert store.move(b"q", b"r", 5) == 0  # a prio-0 packet without a selectable sibling stays
    assert payloads(store.peek(b"q", 5)) == []
    assert store.depth(b"q") == 1
    store.check_invariants()
    assert payloads(store.peek(b"r", 10)) == [b"best", b"next", b"g3", b"g1", b"g2", b"last"]
    assert store.move(b"q", b"r", 0) == 1  # without a limit, it goes
    store.check_invariants()


def test_move_leaves_delayed_and_leased_packets(store: QueueStore, clock: FakeClock) -> None:
    push(store, b"leased")
    taken = store.take(b"q")
    push_delayed(store, b"delayed", 250)
    push(store, b"queued")
    assert store.move(b"q", b"r", 0) == 1
    assert store.queue_info(b"q").delayed == 1
    clock.advance(0.25)
    store.restore(b"q", taken)
    assert payloads(store.pop(b"q")) == [b"delayed"]
    assert payloads(store.pop(b"q")) == [b"leased"]
    assert payloads(store.pop(b"r")) == [b"queued"]
    store.check_invariants()


def test_move_of_a_missing_queue_or_to_itself(store: QueueStore) -> None:
    assert store.move(b"none", b"q", 0) == 0
    push(store, b"a")
    with pytest.raises(ValueError, match="itself"):
        store.move(b"q", b"q", 0)
    assert store.depth(b"q") == 1


def test_move_does_not_move_expired_packets(store: QueueStore, clock: FakeClock) -> None:
    push(store, b"a", ttl_ms=125)
    clock.advance(0.125)
    assert store.move(b"q", b"r", 0) == 0
    assert store.expired == 1
