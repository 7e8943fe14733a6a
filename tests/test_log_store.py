"""The log-backed store on real files: whatever happens, a store recovered from its directory
pops exactly what a memory store that never stopped would (a hypothesis state machine against
``QueueStore``), and the journal's segment counts stay right through rotation, compaction and
deletion."""

from __future__ import annotations

import ast
import ctypes
import mmap
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pinpriq import packed, persistence
from pinpriq.persistence.journal import MIN_SEGMENT_SIZE, FsyncPolicy
from pinpriq.persistence.packed_store import LoggedPackedStore
from pinpriq.persistence.segments import SEGMENT_HEADER_SIZE, Segment, create_segment
from pinpriq.persistence.store import LoggedStore
from pinpriq.store import QueuedPacket, QueueStore
from tests.logtools import FakeClock, commit, open_store, settle

#: Runs a test on each log-backed store (the ``logged_store`` fixture).
each_log_store = pytest.mark.usefixtures("logged_store")

QUEUES = [b"a", b"b", b""]
KEYS = [b"k1", b"k2", b"k3", b"k4", b"k5", b"k6"]


class LogMachine(RuleBasedStateMachine):
    """Pushes, pops, time passing, batches and restarts, against a store that never stops.

    Segments are as small as allowed and payloads large, so a run rotates through many
    segments, deletes them and compacts. TTLs and clock steps keep deadlines away from the
    instants the stores are compared at (a logged deadline may be up to a millisecond early).
    """

    #: The log-backed store under test, and the memory store it must match (its base).
    store_class: type[LoggedStore] = LoggedStore
    model_class: type[QueueStore] = QueueStore

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="pinpriq-log-"))
        self.clock = FakeClock()
        self.model = self.model_class(self.clock)
        self.store = self._open()
        self.batch = 0  # frames since the last commit
        #: Leases outstanding: the queue, and the packets the store and the model took.
        self.leases: list[tuple[bytes, list[QueuedPacket], list[QueuedPacket]]] = []

    def _open(self) -> LoggedStore:
        return open_store(
            self.dir, self.clock, segment_size=MIN_SEGMENT_SIZE, store_class=self.store_class
        )

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir)

    @rule(
        queue=st.sampled_from(QUEUES),
        key=st.sampled_from(KEYS),
        size=st.sampled_from([0, 10, 1000, 6000]),
        ttl_ms=st.sampled_from([0, 0, 500, 5500]),
        prio=st.integers(0, 3),
    )
    def push(self, queue: bytes, key: bytes, size: int, ttl_ms: int, prio: int) -> None:
        payload = bytes([self.model.pushed % 256]) * size
        self.model.push(queue, key, payload, ttl_ms, prio)
        self.store.push(queue, key, payload, ttl_ms, prio)
        self.batch += 1

    @rule(
        queue=st.sampled_from(QUEUES),
        key=st.sampled_from(KEYS),
        ttl_ms=st.sampled_from([0, 500, 5500, 100_000]),
        delay_ms=st.sampled_from([500, 2500, 5500]),
        prio=st.integers(0, 3),
    )
    def push_delayed(self, queue: bytes, key: bytes, ttl_ms: int, delay_ms: int, prio: int) -> None:
        """Decision 21: held until due, logged with its due time; a restart keeps it delayed."""
        payload = bytes([self.model.pushed % 256]) * 100
        self.model.push_delayed(queue, key, payload, ttl_ms, prio, delay_ms)
        self.store.push_delayed(queue, key, payload, ttl_ms, prio, delay_ms)
        self.batch += 1

    @rule(
        source=st.sampled_from([*QUEUES, b"a.dead"]),
        into=st.sampled_from(QUEUES),
        limit=st.sampled_from([0, 1, 3]),
    )
    def move(self, source: bytes, into: bytes, limit: int) -> None:
        """Decision 22: logged as the old seqs' removals and pushes made now."""
        if source != into:
            assert self.store.move(source, into, limit) == self.model.move(source, into, limit)
            self.batch += 1

    @rule(count=st.integers(1, 40))
    def churn(self, count: int) -> None:
        """Packets pushed and popped at once: dead bytes, which make compaction due."""
        for i in range(count):
            self.model.push(b"churn", b"%d" % i, bytes(2000), 0, 1)
            self.store.push(b"churn", b"%d" % i, bytes(2000), 0, 1)
        commit(self.store)
        for _ in range(count):
            assert self.store.pop(b"churn") == self.model.pop(b"churn")
        commit(self.store)

    @rule(queue=st.sampled_from([*QUEUES, b"a.dead"]))
    def pop(self, queue: bytes) -> None:
        expected = [(p[0], p[1]) for p in self.model.pop(queue)]
        got = [(p[0], p[1]) for p in self.store.pop(queue)]
        assert got == expected
        self.batch += 1

    @rule(queue=st.sampled_from(QUEUES))
    def reserve(self, queue: bytes) -> None:
        got, expected = self.store.take(queue), self.model.take(queue)
        assert [(p[0], p[1]) for p in got] == [(p[0], p[1]) for p in expected]
        if got:
            self.leases.append((queue, got, expected))
        self.batch += 1

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), end=st.sampled_from(["ack", "release", "dead letter"]))
    def end_lease(self, data: st.DataObject, end: str) -> None:
        """Decision 19: an ack is a logged removal, a release puts packets back with nothing
        logged, a dead-letter move logs them again under the new queue."""
        index = data.draw(st.integers(0, len(self.leases) - 1))
        queue, got, expected = self.leases.pop(index)
        if end == "ack":
            self.store.discard(got)
            self.model.discard(expected)
        else:
            into = queue if end == "release" else queue + b".dead"
            assert self.store.restore(into, got) == self.model.restore(into, expected)
        self.batch += 1

    def _leases_come_back(self) -> None:
        """After a restart the log holds leased packets as queued: so does the model now."""
        for queue, _, expected in self.leases:
            self.model.restore(queue, expected)
        self.leases.clear()

    @rule(seconds=st.sampled_from([1.0, 1.0, 7.0]))
    def time_passes(self, seconds: float) -> None:
        commit(self.store)
        self.clock.now += seconds
        assert self.store.expire() == self.model.expire()
        commit(self.store)

    @rule()
    def end_batch(self) -> None:
        commit(self.store)
        self.batch = 0

    @rule()
    def restart(self) -> None:
        commit(self.store)
        self.store.close()
        self.store = self._open()
        self._leases_come_back()

    @rule()
    def crash(self) -> None:
        """A kill -9 after the batch's block was written: nothing closed, nothing synced."""
        commit(self.store)
        journal = self.store.journal
        for segment in [*journal.segments, *([journal.spare] if journal.spare else [])]:
            segment.close()
        journal.data_dir.close()
        self.store = self._open()
        self._leases_come_back()

    @invariant()
    def same_contents(self) -> None:
        assert len(self.store) == len(self.model)
        assert self.store.bytes_held == self.model.bytes_held

    @precondition(lambda self: self.batch == 0)
    @invariant()
    def counts_are_right(self) -> None:
        self.store.check_invariants()


TestLogMachine = LogMachine.TestCase
TestLogMachine.settings = settings(max_examples=30, stateful_step_count=50, deadline=None)


class PackedLogMachine(LogMachine):
    """The same against the log on the packed store, whose C core writes the entries."""

    store_class = LoggedPackedStore  # type: ignore[assignment]
    model_class = packed.PackedStore


if packed.available:
    TestPackedLogMachine = PackedLogMachine.TestCase
    TestPackedLogMachine.settings = TestLogMachine.settings


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def drain(store: QueueStore, queue: bytes) -> list[list[tuple[bytes, bytes]]]:
    replies = []
    while reply := store.pop(queue):
        replies.append([(p[0], p[1]) for p in reply])
    return replies


@each_log_store
def test_a_restart_keeps_priorities_ties_groups_and_riders(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = open_store(tmp_path, clock)
    model = QueueStore(clock)
    pushes = [
        (b"q", b"a", b"a1", 0, 3),
        (b"q", b"b", b"b1", 0, 1),
        (b"q", b"a", b"a-rider", 0, 0),
        (b"q", b"c", b"c1", 0, 1),  # newer than b1 at prio 1: first out
        (b"q", b"b", b"b-rider", 0, 0),
        (b"q", b"a", b"a2", 0, 2),
        (b"r", b"z", b"only-rider", 0, 0),
    ]
    for push in pushes:
        store.push(*push)
        model.push(*push)
    commit(store)
    store.close()
    store = open_store(tmp_path, clock)
    assert drain(store, b"q") == drain(model, b"q")
    assert drain(store, b"r") == []
    assert len(store) == 1
    store.push(b"r", b"z", b"sweeper", 0, 9)
    assert drain(store, b"r") == [[(b"z", b"sweeper"), (b"z", b"only-rider")]]
    store.close()


@each_log_store
def test_ages_after_a_restart_and_a_quiet_spell(tmp_path: Path, clock: FakeClock) -> None:
    # A packet read back keeps its age (the log's blocks carry their time). One pushed after
    # the restart and 30 s of quiet is dated from the latest note, not from the first.
    store = open_store(tmp_path, clock)
    store.push(b"old", b"k", b"p", 0, 1)
    commit(store)
    store.close()
    store = open_store(tmp_path, clock)
    for _ in range(30):
        store.note_time()
        clock.now += 1.0
    store.push(b"new", b"k", b"p", 0, 1)
    assert store.queue_info(b"new").oldest_age == 1.0
    assert store.queue_info(b"old").oldest_age == 30.0
    store.close()


@each_log_store
def test_ttl_deadlines_are_wall_clock_and_keep_their_remaining_time(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = open_store(tmp_path, clock)
    store.push(b"q", b"short", b"", 2000, 1)
    store.push(b"q", b"long", b"", 60000, 2)
    commit(store)
    store.close()
    clock.now += 30.0  # the server was down for 30 s: "short" expired meanwhile
    store = open_store(tmp_path, clock)
    assert len(store) == 1
    assert store.next_deadline() == pytest.approx(clock.now + 30.0, abs=0.002)
    clock.now += 29.9
    assert drain(store, b"q") == [[(b"long", b"")]]
    store.close()


@each_log_store
def test_packets_expired_while_down_stay_gone_if_the_clock_goes_back(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = open_store(tmp_path, clock)
    store.push(b"q", b"k", b"", 1000, 1)
    commit(store)
    store.close()
    clock.now += 5.0
    open_store(tmp_path, clock).close()  # drops it as expired, and logs its removal
    clock.now -= 4.5  # the wall clock was set back: the deadline is in the future again
    store = open_store(tmp_path, clock)
    assert len(store) == 0
    store.close()


@each_log_store
def test_segments_are_deleted_oldest_first_and_only_when_dead(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    journal = store.journal
    store.push(b"keep", b"pinned", b"x" * 100, 0, 255)  # pins the first segment
    commit(store)
    most = 0
    for _ in range(40):  # ~40 segments of pushes, each popped in the next batch
        for i in range(30):
            store.push(b"q", b"%d" % i, bytes(2000), 0, 1)
        commit(store)
        assert len(drain(store, b"q")) == 30
        commit(store)
        store.check_invariants()
        numbers = [segment.number for segment in journal.segments]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), "a gap"
        assert journal.where(1) is journal.segments[0], "the pinned packet's segment went"
        most = max(most, len(numbers))
    # Compaction copied the pinned packet forward, so the dead segments behind it went.
    assert journal.stats().copied >= 1
    assert journal.stats().segments_deleted > 30
    assert most <= 5
    store.close()
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    assert drain(store, b"keep") == [[(b"pinned", b"x" * 100)]]
    store.close()


@each_log_store
def test_a_drain_is_not_compacted_until_the_log_grows_again(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A backlog drained in priority order leaves every segment over half dead halfway
    through, but writes only remove entries: compaction copies nothing behind it (it would
    copy packets about to be popped), the segments it empties go by themselves, and those
    the packets left pin wait. Once the log has grown by a segment, compaction is due again
    and frees them."""
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    journal = store.journal
    rng = random.Random(3)
    for i in range(600):  # about 10 segments of pushes, priorities spread over all of them
        store.push(b"q", b"%d" % i, bytes(1000), 0, rng.randint(1, 255))
        if i % 64 == 63:
            commit(store)
    commit(store)
    backlog = len(journal.segments)
    for i in range(590):  # the drain, leaving 10 packets scattered over the segments
        assert len(store.pop(b"q")) == 1
        if i % 64 == 63:
            commit(store)
    commit(store)
    assert journal.stats().copied == 0
    assert len(journal.segments) >= backlog - 2  # the 10 left pin most of them
    for round_ in range(6):  # churn: a segment's growth, and more
        for i in range(30):
            store.push(b"c", b"%d-%d" % (round_, i), bytes(2000), 0, 1)
        commit(store)
        assert len(drain(store, b"c")) == 30
        commit(store)
    store.check_invariants()
    assert journal.stats().copied >= 1
    assert len(journal.segments) <= 5, f"{len(journal.segments)} segments: not compacted"
    store.close()
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    assert len(drain(store, b"q")) == 10
    store.close()


@each_log_store
def test_compaction_catches_up_with_a_backlog_while_fsyncs_lag_behind_the_writes(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A backlog of segments, each pinned by a packet nobody pops (a queue that filled up,
    then drained), on a loaded machine where an fsync takes as long as several batches: the
    keeper gets its turn every 4th batch. A compacted segment may go only once its copies are
    on disk, so a compactor that waits for that before reading the next segment compacts one
    segment per fsync, fewer than the churn adds, and the log grows for ever (from 21 segments
    to 39 here). Reading on into the next segment meanwhile brings it back to a few."""
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    journal = store.journal
    batches = 0

    def batch() -> None:  # the server's flush; the keeper catches up every 4th batch
        nonlocal batches
        store.flush()
        batches += 1
        if batches % 4 == 0:
            settle(journal)

    for round_ in range(20):  # live data fills about 20 segments: compaction is not due
        store.push(b"keep", b"%d" % round_, b"x" * 100, 0, 255)
        for i in range(30):
            store.push(b"fill", b"%d-%d" % (round_, i), bytes(2000), 0, 1)
        batch()
    assert len(drain(store, b"fill")) == 600  # now each segment holds one live packet
    batch()
    backlog = len(journal.segments)
    for _ in range(40):  # churn: about a segment every round, two batches a round
        for i in range(30):
            store.push(b"q", b"%d" % i, bytes(2000), 0, 1)
        batch()
        assert len(drain(store, b"q")) == 30
        batch()
    settle(journal)
    store.check_invariants()
    assert backlog >= 18
    assert len(journal.segments) <= 5, (
        f"{len(journal.segments)} segments after 40 rounds of churn, from a backlog of "
        f"{backlog}: compaction did not keep up"
    )
    store.close()
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    assert len(drain(store, b"keep")) == 20
    store.close()


@pytest.mark.parametrize("policy", list(FsyncPolicy))
@each_log_store
def test_released_means_written_and_under_always_synced(
    tmp_path: Path, clock: FakeClock, policy: FsyncPolicy
) -> None:
    store = open_store(tmp_path, clock, policy=policy)
    journal = store.journal
    journal.last_sync = 100.0
    store.push(b"q", b"k", b"v", 0, 1)
    store.flush()
    assert journal.written_pos == journal.sealed_pos > 0
    assert journal.released is (policy is not FsyncPolicy.ALWAYS)
    assert journal.sync_due(100.5) is (policy is FsyncPolicy.ALWAYS)
    assert journal.sync_due(101.0) is (policy is not FsyncPolicy.NO)
    settle(journal)
    assert journal.released
    store.close()


@pytest.mark.parametrize("policy", [FsyncPolicy.EVERYSEC, FsyncPolicy.NO])
@each_log_store
def test_everysec_fsyncs_early_once_a_quarter_segment_is_unsynced(
    tmp_path: Path, clock: FakeClock, policy: FsyncPolicy
) -> None:
    """Under everysec a quarter of a segment written and not synced is due for an fsync at
    once, not at its second: the fsync at a rotation, which holds all output, then has at most
    that much to write back. The keeper is woken when that quarter is crossed, not at every
    block. ``no`` never fsyncs for it."""
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE, policy=policy)
    journal = store.journal
    wakes: list[int] = []
    journal.wake = lambda: wakes.append(journal.written_pos - journal.synced_pos)
    journal.last_sync = 100.0
    quarter = MIN_SEGMENT_SIZE // 4
    for i in range(1000):
        if journal.written_pos - journal.synced_pos >= quarter:
            break
        assert not journal.sync_due(100.5), f"due after {i} blocks, before a quarter segment"
        store.push(b"q", b"k%d" % i, b"v" * 100, 0, 1)
        store.flush()
    assert len(journal.segments) == 1, "no rotation on the way"
    everysec = policy is FsyncPolicy.EVERYSEC
    assert journal.sync_due(100.5) is everysec
    if everysec:  # its first unsynced block (the second's timer), then the quarter crossed
        assert len(wakes) == 2, wakes
        assert wakes[1] >= quarter
    else:
        assert all(unsynced < quarter for unsynced in wakes), wakes
    settle(journal)
    if everysec:
        assert journal.written_pos == journal.synced_pos
    assert not journal.sync_due(100.5)
    store.close()


@each_log_store
def test_a_block_written_in_part_is_written_again_whole(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short ``pwrite`` (a signal, a nearly full disk) of a block ``seal`` writes at once:
    the block queues and is written whole, and not released before. (A mapped segment is
    written by a copy, which is never short.)"""
    store = open_store(tmp_path, clock, mapped=False)
    journal = store.journal
    real = os.pwrite
    shorts: list[int] = []

    def short_once(fd: int, data: bytes, offset: int) -> int:
        if not shorts:
            shorts.append(len(data))
            return real(fd, bytes(data)[: len(data) // 2], offset)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", short_once)
    store.push(b"q", b"k", b"v" * 100, 0, 1)
    store.flush()
    assert shorts
    assert journal.written_pos == journal.sealed_pos
    store.push(b"q", b"k2", b"w", 0, 2)
    commit(store)
    store.close()
    store = open_store(tmp_path, clock)
    assert [(p[0], p[1]) for p in store.queued(b"q")] == [(b"k", b"v" * 100), (b"k2", b"w")]
    store.close()


@each_log_store
def test_a_dead_letter_move_comes_back_in_its_new_queue_in_push_order(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Decision 19: a group restored into another queue is logged there, seq and TTL kept."""
    store = open_store(tmp_path, clock)
    for key in (b"1", b"2", b"3", b"4"):
        store.push(b"jobs", key, key, 60_000 if key == b"2" else 0, 1)
    deadline = store.next_deadline()
    commit(store)
    four, three = store.take(b"jobs"), store.take(b"jobs")  # newest first
    two = store.take(b"jobs")
    assert store.restore(b"jobs.dead", two) == store.restore(b"jobs.dead", four) == 1
    assert store.restore(b"jobs", three) == 1  # released: nothing logged
    commit(store)
    store.close()
    clock.now += 10
    store = open_store(tmp_path, clock)
    assert store.next_deadline() == pytest.approx(deadline, abs=0.002)
    assert drain(store, b"jobs.dead") == [[(b"4", b"4")], [(b"2", b"2")]]
    assert drain(store, b"jobs") == [[(b"3", b"3")], [(b"1", b"1")]]
    store.close()


@each_log_store
def test_leased_packets_are_back_after_a_restart_and_acked_ones_gone(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = open_store(tmp_path, clock)
    for key in (b"acked", b"held", b"rider"):
        store.push(b"q", key, b"", 0, 0 if key == b"rider" else 1)
    commit(store)
    store.discard(store.take(b"q"))  # "held", the newest of prio 1: acked
    assert [p[0] for p in store.take(b"q")] == [b"acked"]  # leased when the server stops
    commit(store)
    store.close()
    store = open_store(tmp_path, clock)
    assert len(store) == 2  # the leased one, and the rider
    assert drain(store, b"q") == [[(b"acked", b"")]]
    store.close()


@each_log_store
def test_compaction_keeps_leased_packets(tmp_path: Path, clock: FakeClock) -> None:
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    store.push(b"keep", b"leased", b"x" * 100, 0, 1)
    commit(store)
    assert len(store.take(b"keep")) == 1
    for _ in range(30):  # segments of churn: compaction copies the leased packet forward
        for i in range(30):
            store.push(b"q", b"%d" % i, bytes(2000), 0, 1)
        commit(store)
        assert len(drain(store, b"q")) == 30
        commit(store)
        store.check_invariants()
    assert store.journal.stats().segments_deleted > 20
    store.close()
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    assert drain(store, b"keep") == [[(b"leased", b"x" * 100)]]
    store.close()


@each_log_store
def test_a_packet_whose_ttl_passed_while_leased_is_logged_removed(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = open_store(tmp_path, clock)
    store.push(b"q", b"k", b"", 1000, 1)
    commit(store)
    taken = store.take(b"q")
    clock.now += 2.0
    assert store.restore(b"q", taken) == 0
    commit(store)
    assert store.journal.stats().live_packets == 0
    store.close()
    clock.now -= 1.5  # even if the wall clock goes back, it stays gone: its removal is logged
    store = open_store(tmp_path, clock)
    assert len(store) == 0
    store.close()


@each_log_store
def test_totals_add_up_after_a_restart(tmp_path: Path, clock: FakeClock) -> None:
    store = open_store(tmp_path, clock)
    for i in range(5):
        store.push(b"q", b"%d" % i, b"", 0, 1)
    store.pop(b"q")
    commit(store)
    store.close()
    store = open_store(tmp_path, clock)
    assert store.pushed == 4
    assert len(store) == 4
    store.push(b"q", b"new", b"", 0, 1)
    assert store.pushed == 5
    store.close()


@each_log_store
def test_a_purge_is_logged(tmp_path: Path, clock: FakeClock) -> None:
    store = open_store(tmp_path, clock)
    store.push(b"q", b"a", b"", 0, 1)
    store.push(b"q", b"b", b"", 0, 0)
    store.push(b"r", b"c", b"", 0, 1)
    commit(store)
    assert store.purge(b"q") == 2
    commit(store)
    store.close()
    store = open_store(tmp_path, clock)
    assert len(store) == 1
    assert drain(store, b"r") == [[(b"c", b"")]]
    store.close()


def allocated(path: Path) -> int:
    """Bytes the directory's files take on disk, as ``du`` counts them."""
    return sum(entry.stat().st_blocks * 512 for entry in path.iterdir() if entry.is_file())


@each_log_store
def test_disk_use_stays_within_twice_the_live_data_plus_five_segments(
    tmp_path: Path, clock: FakeClock
) -> None:
    """``benchmarks/persistence.py disk`` scaled down: 20 MB of 1 KiB payloads through a queue
    held at 1,000 packets, with priorities 1..255, so that some packets stay for long and pin
    old segments: the log stays within the bound the design promises however long it runs
    (twice the live data: compaction's trigger; a segment of growth, after which compaction
    is due again once it has found the log at most half dead; a segment being compacted; the
    active segment and the spare, reserved whole; a segment of slack)."""
    segment, depth = 256 * 1024, 1000
    store = open_store(tmp_path, clock, segment_size=segment)
    rng = random.Random(7)
    payload = bytes(1024)
    for i in range(depth):
        store.push(b"q", b"%08d" % i, payload, 0, rng.randint(1, 255))
    commit(store)
    entry = 10 + 1 + 8 + len(payload)  # a push entry of this queue, key and payload
    bound = 2 * depth * entry + 5 * segment
    most = 0
    for round_ in range(300):  # 64 pushes and 64 pops a round: 19.7 MB of payloads
        for i in range(64):
            key = b"%08d" % (depth + round_ * 64 + i)
            store.push(b"q", key, payload, 0, rng.randint(1, 255))
        commit(store)
        for _ in range(64):
            assert len(store.pop(b"q")) == 1
        commit(store)
        most = max(most, allocated(tmp_path))
    assert len(store) == depth
    assert most <= bound, f"{most} bytes on disk for {depth * entry} of live data"
    assert store.journal.stats().segments_deleted > 50
    store.check_invariants()
    store.close()


@each_log_store
def test_the_log_modules_import_one_way() -> None:
    """Each module of ``pinpriq/persistence`` imports only those listed before it in the
    package's docstring, type-checking imports included (compaction once imported journal
    for a type while journal imported compaction)."""
    package = Path(persistence.__file__).parent
    order = ["records", "segments", "recovery", "compaction", "journal", "keeper", "store"]
    for index, name in enumerate(order):
        tree = ast.parse((package / f"{name}.py").read_text())
        imported = {
            node.module.removeprefix("pinpriq.persistence.")
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and node.module is not None
            and node.module.startswith("pinpriq.persistence.")
        }
        assert imported <= set(order[:index]), f"{name} imports {imported - set(order[:index])}"


@each_log_store
def test_recovered_packets_keep_their_ages(tmp_path: Path, clock: FakeClock) -> None:
    """Ages come from the blocks' base_ms, to within a second (the running store's notes are
    about a second apart too), and are never younger than the packets are."""
    store = open_store(tmp_path, clock)
    store.push(b"q", b"old", b"", 0, 1)
    commit(store)
    clock.now += 30
    store.push(b"r", b"new", b"", 0, 1)
    commit(store)
    store.close()
    clock.now += 5  # the server was down
    store = open_store(tmp_path, clock)
    old_age, new_age = store.queue_info(b"q").oldest_age, store.queue_info(b"r").oldest_age
    assert old_age is not None
    assert new_age is not None
    assert 35 <= old_age < 36
    assert 5 <= new_age < 6
    store.close()


@each_log_store
def test_a_block_counts_from_its_first_push_however_late_it_is_sealed(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A block's ``base_ms`` is its first push's time on the wall clock, not its seal's: a
    TTL logged in a block sealed late still ends when it would have, and an age is not
    younger than it is."""
    store = open_store(tmp_path, clock)
    store.push(b"q", b"first", b"", 10_000, 1)
    clock.now += 4  # a long batch: the block is sealed 4 s after its first push
    store.push(b"q", b"later", b"", 0, 1)
    commit(store)
    store.close()
    clock.now += 5  # 9 s after the first push
    store = open_store(tmp_path, clock)
    age = store.queue_info(b"q").oldest_age
    assert age is not None
    assert 9 <= age < 10
    assert store.next_deadline() == pytest.approx(clock.now + 1, abs=0.002)
    store.close()


@each_log_store
def test_packets_keep_their_ages_through_compaction(tmp_path: Path, clock: FakeClock) -> None:
    """A packet copied forward, its push's segment deleted: its copy entry carries its push
    time, so after a restart its age is still known."""
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    store.push(b"keep", b"pinned", b"x", 0, 255)
    commit(store)
    for _ in range(40):  # segments of churn: the pinned packet is copied forward
        clock.now += 1
        for i in range(30):
            store.push(b"q", b"%d" % i, bytes(2000), 0, 1)
        commit(store)
        assert len(drain(store, b"q")) == 30
        commit(store)
    assert store.journal.stats().copied >= 1
    assert not (tmp_path / "0000000000000001.log").exists()
    store.close()
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    age = store.queue_info(b"keep").oldest_age
    assert age is not None
    assert 40 <= age < 41
    store.close()


# Protocol 1.2 in the log (decisions 21-22): delayed packets, long TTLs and moves.


@each_log_store
def test_a_delayed_packet_survives_a_restart_still_delayed(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = open_store(tmp_path, clock)
    store.push(b"q", b"now", b"", 0, 1)
    store.push_delayed(b"q", b"later", b"x", 0, 9, 10_000)
    commit(store)
    store.close()
    clock.now += 4.0  # down for 4 s: 6 s of its delay are left
    store = open_store(tmp_path, clock)
    assert len(store) == 2
    assert store.queue_info(b"q").delayed == 1
    assert drain(store, b"q") == [[(b"now", b"")]]  # the delayed one is in no queue yet
    assert store.next_deadline() == pytest.approx(clock.now + 6.0, abs=0.002)
    clock.now += 5.9
    store.expire()
    assert store.pop(b"q") == []
    clock.now += 0.1
    store.expire()
    assert store.take_arrived() == [b"q"]
    assert drain(store, b"q") == [[(b"later", b"x")]]
    commit(store)
    store.check_invariants()
    store.close()


@each_log_store
def test_a_packet_due_while_down_arrives_at_once_in_its_place_in_push_order(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = open_store(tmp_path, clock)
    store.push_delayed(b"q", b"first", b"", 0, 1, 2_000)
    store.push(b"q", b"second", b"", 0, 1)
    store.push(b"q", b"third", b"", 0, 1)
    commit(store)
    store.close()
    clock.now += 10.0
    store = open_store(tmp_path, clock)
    assert store.queue_info(b"q").delayed == 0
    # Newest first among equal priorities: the delayed push, read first, comes out last.
    assert drain(store, b"q") == [[(b"third", b"")], [(b"second", b"")], [(b"first", b"")]]
    store.close()


@each_log_store
def test_a_delayed_packet_whose_ttl_passed_while_down_is_dropped_for_good(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = open_store(tmp_path, clock)
    store.push_delayed(b"q", b"k", b"", 3_000, 1, 2_000)  # due at +2 s, gone at +5 s
    store.push_delayed(b"q", b"kept", b"", 60_000, 1, 2_000)
    commit(store)
    store.close()
    clock.now += 6.0
    store = open_store(tmp_path, clock)  # TTL wins: dropped, and its removal logged
    assert drain(store, b"q") == [[(b"kept", b"")]]
    commit(store)
    store.close()
    clock.now -= 5.0  # a wall clock set back does not bring it back
    store = open_store(tmp_path, clock)
    assert len(store) == 0
    store.close()


@each_log_store
def test_a_ttl_above_65535_ms_is_logged_whole(tmp_path: Path, clock: FakeClock) -> None:
    store = open_store(tmp_path, clock)
    store.push(b"q", b"k", b"", 7_200_000, 1)  # 2 h: a u32 TTL (protocol 1.2)
    store.push_delayed(b"q", b"d", b"", 4_000_000_000, 1, 2_592_000_000)  # the largest
    commit(store)
    store.close()
    clock.now += 3600.0
    store = open_store(tmp_path, clock)
    assert store.next_deadline() == pytest.approx(clock.now + 3600.0, abs=0.002)
    clock.now += 3599.9
    assert drain(store, b"q") == [[(b"k", b"")]]
    assert store.queue_info(b"q").delayed == 1
    store.close()


@each_log_store
def test_a_purge_logs_the_removal_of_delayed_packets(tmp_path: Path, clock: FakeClock) -> None:
    store = open_store(tmp_path, clock)
    store.push(b"q", b"a", b"", 0, 1)
    store.push_delayed(b"q", b"b", b"", 0, 1, 5_000)
    commit(store)
    assert store.purge(b"q") == 2
    commit(store)
    assert store.journal.stats().live_packets == 0
    store.close()
    store = open_store(tmp_path, clock)
    assert len(store) == 0
    store.close()


@each_log_store
def test_a_move_is_logged_and_comes_back_in_its_new_order(tmp_path: Path, clock: FakeClock) -> None:
    """Decision 22: moved packets are pushes made now (newer than what the target held),
    keeping prio and TTL deadline; delayed packets stay."""
    store = open_store(tmp_path, clock)
    store.push(b"jobs.dead", b"a", b"1", 0, 1)
    store.push(b"jobs.dead", b"b", b"2", 30_000, 1)
    store.push_delayed(b"jobs.dead", b"c", b"3", 0, 1, 60_000)
    store.push(b"jobs", b"old", b"", 0, 1)
    commit(store)
    assert store.move(b"jobs.dead", b"jobs", 0) == 2
    commit(store)
    store.check_invariants()
    store.close()
    clock.now += 10.0
    store = open_store(tmp_path, clock)
    assert store.queue_info(b"jobs").next_expiry == pytest.approx(20.0, abs=0.002)
    assert drain(store, b"jobs") == [[(b"b", b"2")], [(b"a", b"1")], [(b"old", b"")]]
    assert store.queue_info(b"jobs.dead").delayed == 1
    assert store.pop(b"jobs.dead") == []
    commit(store)
    store.check_invariants()
    store.close()


@each_log_store
def test_compaction_keeps_delayed_packets(tmp_path: Path, clock: FakeClock) -> None:
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    store.push_delayed(b"keep", b"waiting", b"x" * 100, 0, 1, 3_600_000)
    store.push_delayed(b"keep", b"arrived", b"y" * 100, 0, 1, 1_000)
    commit(store)
    clock.now += 2.0
    store.expire()
    for _ in range(30):  # segments of churn: compaction copies both forward
        for i in range(30):
            store.push(b"q", b"%d" % i, bytes(2000), 0, 1)
        commit(store)
        assert len(drain(store, b"q")) == 30
        commit(store)
        store.check_invariants()
    assert store.journal.stats().segments_deleted > 20
    store.close()
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    assert store.queue_info(b"keep").delayed == 1
    assert drain(store, b"keep") == [[(b"arrived", b"y" * 100)]]
    clock.now += 3600.0
    store.expire()
    assert drain(store, b"keep") == [[(b"waiting", b"x" * 100)]]
    store.close()


def cached_pages(path: Path) -> list[bool]:
    """Which of the file's pages are in the page cache (``mincore`` on a mapping of it, which
    reads nothing in: only the file's existing pages are reported)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    resident = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), size) as mapped:
        first = ctypes.c_char.from_buffer(mapped)
        try:
            assert libc.mincore(ctypes.addressof(first), size, resident) == 0, ctypes.get_errno()
        finally:
            del first  # no buffer exported: the mapping may close
    return [bool(page & 1) for page in resident]


def test_a_new_segment_is_read_through_so_its_first_writes_find_its_pages(
    tmp_path: Path,
) -> None:
    """A pwrite into a reserved page nothing has touched allocates and zeroes it, in the
    event loop; a segment is made by the keeper's worker thread ahead of need, which reads it
    whole, so its pages are in the page cache before its first block (docs/performance.md).
    Dropping them first shows the read is what put them there."""
    path = tmp_path / "0000000000000001.log"
    fd = create_segment(path, MIN_SEGMENT_SIZE)
    try:
        assert all(cached_pages(path))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped at once
        assert not any(cached_pages(path)[1:])
    finally:
        os.close(fd)


def test_a_segment_whose_space_is_not_reserved_is_not_mapped(tmp_path: Path) -> None:
    """A write into a mapped page with no disk block behind it raises SIGBUS on a full disk,
    where ``pwrite`` says ENOSPC: a sparse segment (a file system that cannot reserve space)
    is written with pwrite; a reserved one is mapped."""
    sparse = Segment(1, tmp_path / "sparse.log", MIN_SEGMENT_SIZE)
    sparse.fd = os.open(sparse.path, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(sparse.fd, MIN_SEGMENT_SIZE)  # the size, and no block
    assert not sparse.map()
    sparse.close()
    reserved = Segment(2, tmp_path / "reserved.log", MIN_SEGMENT_SIZE)
    reserved.fd = create_segment(reserved.path, MIN_SEGMENT_SIZE)
    assert reserved.map()
    assert reserved.mapping is not None
    reserved.mapping[SEGMENT_HEADER_SIZE : SEGMENT_HEADER_SIZE + 5] = b"block"
    reserved.close()
    assert reserved.mapping is None
    assert reserved.fd is None
    with open(reserved.path, "rb") as written:  # the copy is the file's, once unmapped
        assert written.read()[SEGMENT_HEADER_SIZE:][:6] == b"block\0"


@each_log_store
def test_a_reopened_segment_is_read_through_past_its_last_block(
    tmp_path: Path, clock: FakeClock
) -> None:
    """After a restart the active segment's unwritten pages are in the cache too, as a new
    segment's are, so its next writes find them: recovery reads each segment whole (in its
    worker thread), its reserved zeros included."""
    store = open_store(tmp_path, clock)
    store.push(b"q", b"k", b"v", 0, 1)
    commit(store)
    path = store.journal.active.path
    store.close()
    with open(path, "rb") as file:
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert not any(cached_pages(path))
    store = open_store(tmp_path, clock)
    assert store.journal.active.path == path
    assert all(cached_pages(path))
    store.close()
