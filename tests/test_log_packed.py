"""The log on the packed store (``LoggedPackedStore``, whose C core writes the entries) against
the reference, ``LoggedStore`` on ``QueueStore``: the same operations write the same log, byte
for byte, and recover the same queues."""

from __future__ import annotations

import bisect
import random
import sys
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from pinpriq import packed
from pinpriq.cli.server import open_store as open_server_store
from pinpriq.cli.server import server_parser
from pinpriq.packed import DEFAULT_STORE_OVERHEAD
from pinpriq.persistence.journal import MIN_SEGMENT_SIZE
from pinpriq.persistence.packed_store import LoggedPackedStore
from pinpriq.persistence.records import REMOVE, Kind, encode_block
from pinpriq.persistence.store import LoggedStore, block_base_ms
from pinpriq.store import QueuedPacket
from pinpriq.wire import append_reply
from tests.logtools import FakeClock, commit, open_store

pytestmark = pytest.mark.skipif(not packed.available, reason="the packed store is not built")

QUEUES = [b"a", b"b", b"a.dead"]
KEYS = [b"k%d" % i for i in range(8)]


class Twins:
    """A ``LoggedStore`` and a ``LoggedPackedStore``, each in its own directory on its own
    fake clock, given the same operations; every result must agree."""

    def __init__(self, root: Path) -> None:
        self.clocks = [FakeClock(), FakeClock()]
        self.dirs = [root / "reference", root / "packed"]
        self.stores = [self._open(i) for i in range(2)]
        #: Leases outstanding: the queue, and what each store's take returned.
        self.leases: list[tuple[bytes, list[list[QueuedPacket]]]] = []

    def _open(self, i: int) -> LoggedStore:
        store_class = LoggedStore if i == 0 else LoggedPackedStore
        return open_store(
            self.dirs[i], self.clocks[i], segment_size=MIN_SEGMENT_SIZE, store_class=store_class
        )

    def both(self, method: str, *args: object) -> object:
        reference, packed_result = (getattr(store, method)(*args) for store in self.stores)
        assert packed_result == reference, method
        return reference

    def step(self, rng: random.Random) -> None:
        """One random operation (all of the contract's changes that log something)."""
        op = rng.choice(
            ["push"] * 6
            + ["pop"] * 3
            + ["delayed", "lease", "end", "move", "purge", "time", "commit", "churn"]
        )
        queue, key = rng.choice(QUEUES[:2]), rng.choice(KEYS)
        if op == "push":
            ttl_ms = rng.choice([0, 0, 500, 5500, 100_000])  # 100 s: a push with options
            payload = bytes([rng.randrange(256)]) * rng.choice([0, 10, 1500])
            self.both("push", queue, key, payload, ttl_ms, rng.randrange(4))
        elif op == "pop" and rng.random() < 0.5:
            self.both("pop", queue)
        elif op == "pop":  # the broker's pop on the packed store: the reply's bytes
            expected, got = bytearray(), bytearray()
            append_reply(expected, self.stores[0].pop(queue))
            self.stores[1].pop_reply(queue, got)
            assert got == expected
        elif op == "delayed":
            self.both(
                "push_delayed",
                queue,
                key,
                b"d",
                rng.choice([0, 500, 9000]),
                rng.randrange(4),
                rng.choice([500, 2500]),
            )
        elif op == "lease":
            taken = [store.take(queue) for store in self.stores]
            assert taken[0] == taken[1]
            if taken[0]:
                self.leases.append((queue, taken))
        elif op == "end" and self.leases:
            queue, taken = self.leases.pop(rng.randrange(len(self.leases)))
            end = rng.choice(["ack", "release", "dead letter"])
            if end == "ack":
                for store, packets in zip(self.stores, taken, strict=True):
                    store.discard(packets)
            else:
                into = queue if end == "release" else queue + b".dead"
                back = [s.restore(into, p) for s, p in zip(self.stores, taken, strict=True)]
                assert back[0] == back[1]
        elif op == "move":
            source = rng.choice(QUEUES)
            target = rng.choice([q for q in QUEUES if q != source])
            self.both("move", source, target, rng.choice([0, 1, 3]))
        elif op == "purge":
            if rng.random() < 0.2:
                self.both("purge", queue)
        elif op == "time":
            self.commit()
            seconds = rng.choice([0.3, 1.0, 7.0])
            for clock in self.clocks:
                clock.now += seconds
            self.both("expire")
        elif op == "churn":  # dead bytes, so compaction becomes due
            for i in range(30):
                self.both("push", b"churn", b"%d" % i, bytes(1500), 0, 1)
            self.commit()
            for _ in range(30):
                self.both("pop", b"churn")
        self.commit() if op == "commit" else None

    def commit(self) -> None:
        for store in self.stores:
            commit(store)

    def restart(self) -> None:
        self.commit()
        for store in self.stores:
            store.close()
        self.stores = [self._open(i) for i in range(2)]
        self.leases.clear()  # leased packets are back in their queues

    def close(self) -> None:
        for store in self.stores:
            store.close()

    def logs(self) -> list[dict[str, bytes]]:
        return [{p.name: p.read_bytes() for p in sorted(d.glob("*.log"))} for d in self.dirs]


@pytest.mark.parametrize("seed", range(6))
def test_the_packed_store_writes_the_reference_log_byte_for_byte(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    twins = Twins(tmp_path)
    try:
        for round_ in range(4):
            for _ in range(300):
                twins.step(rng)
            twins.commit()
            for store in twins.stores:
                store.check_invariants()
            if round_ < 3:
                twins.restart()
                queues = [sorted(name for name, _, _ in s.sizes()) for s in twins.stores]
                assert queues[0] == queues[1]
                for name in queues[0]:
                    twins.both("queued", name)
    finally:
        twins.close()
    reference, packed_log = twins.logs()
    assert reference.keys() == packed_log.keys()
    assert len(reference) > 1  # rotated: compaction and deletion took part
    for name in reference:
        assert packed_log[name] == reference[name], name


async def test_a_data_dir_server_runs_on_the_packed_store_and_counts_its_overhead(
    tmp_path: Path,
) -> None:
    """``pinpriq-server --data-dir`` opens the logged packed store, so the memory cap counts
    the packed store's bookkeeping per packet (``DEFAULT_STORE_OVERHEAD``), not QueueStore's."""
    args = server_parser().parse_args(["--data-dir", str(tmp_path)])
    store = open_server_store(args)
    assert isinstance(store, LoggedPackedStore)
    try:
        store.recover(trio.current_time(), FakeClock().wall_ms())
        store.push(b"q", b"key", b"payload", 0, 1)
        assert store.bytes_held == len(b"key") + len(b"payload") + DEFAULT_STORE_OVERHEAD
        assert DEFAULT_STORE_OVERHEAD == packed.PACKET_OVERHEAD
    finally:
        store.close()


def test_the_c_core_frames_a_block_as_encode_block_does(tmp_path: Path) -> None:
    """``frame_block`` makes ``records.encode_block``'s bytes (its own CRC-32 against zlib's,
    its own ``base_ms`` against ``block_base_ms``), for blocks of every length modulo 64 (the
    CRC folds 64 bytes a step, then 16, then takes the rest a byte at a time) and of several
    kilobytes, and clears the open block."""
    clock = FakeClock()
    store = open_store(tmp_path, clock, store_class=LoggedPackedStore)
    journal = store.journal
    try:
        for pushes in [1, 2, 3, 5, 8, 13, 64, 200]:
            for payload in range(64 if pushes < 8 else 8):
                for i in range(pushes):
                    store.push(b"q", b"k%d" % i, bytes([i % 256]) * (payload + i), i % 2000, 1)
                clock.now += 0.0015
                store.pop(b"q")
                seq_base = store._seq - pushes
                base_ms = block_base_ms(journal, store._block_wall)
                expected = encode_block(seq_base, base_ms, journal.pushes, journal.removals)
                assert store.frame_block(seq_base) == expected
                assert not journal.pushes
                assert not journal.removals
        store.pop(b"q")
        expected = encode_block(0, 0, journal.removals)  # no push: base_ms 0
        assert store.frame_block(0) == expected
        assert store.frame_block(0) is None  # an empty block
    finally:
        store.close()


def test_frame_into_frames_the_block_frame_block_would_make_in_place(tmp_path: Path) -> None:
    """``frame_into`` writes ``frame_block``'s bytes into a writable buffer at an offset,
    touching nothing else, and clears the open block; an empty block is 0 bytes; a block
    that would end past the buffer is -1, with nothing written and the open block kept."""
    clock = FakeClock()
    store = open_store(tmp_path, clock, store_class=LoggedPackedStore)
    journal = store.journal
    try:
        for i in range(5):
            store.push(b"q", b"k%d" % i, b"v" * i, 0, 1)
        store.pop(b"q")
        seq_base = store._seq - 5
        expected = encode_block(
            seq_base, block_base_ms(journal, store._block_wall), journal.pushes, journal.removals
        )
        buffer = bytearray(b"\xee" * (len(expected) + 10))
        assert store.frame_into(seq_base, buffer, 11) == -1  # one byte short of room
        assert buffer == b"\xee" * len(buffer)
        assert journal.pushes  # kept for the next try
        assert journal.removals
        assert store.frame_into(seq_base, buffer, 7) == len(expected)
        assert buffer == b"\xee" * 7 + expected + b"\xee" * 3
        assert not journal.pushes
        assert not journal.removals
        assert store.frame_into(seq_base, buffer, 0) == 0  # nothing left to frame
        store.push(b"q", b"later", b"v", 0, 1)
        with pytest.raises(BufferError):
            store.frame_into(store._seq - 1, bytes(100), 0)  # read-only
        assert journal.pushes
    finally:
        store.close()


def test_a_mapped_segment_gets_framed_blocks_without_a_bytes_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a mapped segment with nothing queued, ``seal_framed`` frames each block into the
    mapping (``frame_into``) and never asks for its ``bytes``; the log reads back whole."""
    clock = FakeClock()
    store = open_store(tmp_path, clock, store_class=LoggedPackedStore, mapped=True)
    assert store.journal.active.mapping is not None
    asked: list[int] = []

    def frame_block(seq_base: int) -> bytes | None:
        asked.append(seq_base)
        raise AssertionError("framed as bytes")

    monkeypatch.setattr(store, "frame_block", frame_block, raising=False)
    for i in range(30):
        store.push(b"q", b"%d" % i, b"v" * i, 0, 1)
        store.flush()
        if i % 3 == 0:
            store.pop(b"q")
            store.flush()
    assert not asked
    assert store.journal.blocks_written == 40
    store.check_invariants()
    left = len(store)
    store.close()
    store = open_store(tmp_path, clock, store_class=LoggedPackedStore)
    try:
        assert len(store) == left == 20
    finally:
        store.close()


def test_the_open_block_keeps_its_room_only_up_to_a_mebibyte(tmp_path: Path) -> None:
    """The C core appends entries into room the open block keeps from block to block, but a
    block of more than a mebibyte gives its room back once framed: one huge batch does not
    pin its size for the server's life."""
    clock = FakeClock()
    store = open_store(tmp_path, clock, store_class=LoggedPackedStore)
    journal = store.journal
    try:
        store.push(b"q", b"small", b"v" * 100, 0, 1)
        store.flush()
        assert not journal.pushes
        for i in range(20):  # 1.3 MB of push entries in one block
            store.push(b"q", b"big%d" % i, b"x" * 65_000, 0, 1)
        assert len(journal.pushes) > 1 << 20
        store.flush()
        assert not journal.pushes
        assert sys.getsizeof(journal.pushes) < sys.getsizeof(bytearray()) + 1024
        store.pop(b"q")
        store.flush()
        store.check_invariants()
    finally:
        store.close()
    store = open_store(tmp_path, clock, store_class=LoggedPackedStore)
    try:
        assert len(store) == 20  # the small packet and the big ones, less the one popped
    finally:
        store.close()


def test_the_c_core_frames_each_request_and_the_journal_counts_it(tmp_path: Path) -> None:
    """At -P 1 each request is a block the C core frames (``seal_framed``, never the
    journal's ``encode_block``): the journal's positions and counts move as its own path
    moves them, and the log reads back."""
    framed: list[bool] = []

    class Watched(LoggedPackedStore):
        def flush(self) -> None:
            framed.append(self.journal.seal_framed(self._seq, self))
            super().flush()  # nothing left to seal if it framed the block

    clock = FakeClock()
    store = open_store(tmp_path, clock, store_class=Watched)
    journal = store.journal
    for i in range(50):
        store.push(b"q", b"%d" % i, b"v", 0, 1)
        store.flush()
        if i % 2:
            store.pop(b"q")
            store.flush()
    assert framed == [True] * 75
    assert journal.blocks_written == 75
    assert journal.written_pos == journal.sealed_pos == journal.stats().bytes_written
    assert journal.active.live == 25
    store.check_invariants()
    store.close()
    store = open_store(tmp_path, clock, store_class=LoggedPackedStore)
    try:
        assert len(store) == 25
    finally:
        store.close()


@given(
    st.lists(st.integers(1, 2**64 - 1), min_size=1, max_size=5, unique=True).map(sorted),
    st.lists(st.integers(0, 2**64 - 1), max_size=40, unique=True),
    st.data(),
)
def test_the_c_core_counts_removals_by_segment_as_the_journal_would(
    firsts: list[int], seqs: list[int], data: st.DataObject
) -> None:
    """``count_removals``, which the journal uses for a block's remove entries in a log of
    several segments: each seq counts against the last segment starting at or before it
    (bisect), unless compaction copied it forward, when its entry leaves ``copied_to`` and its
    segment is named instead."""
    seqs = list(dict.fromkeys(max(seq, firsts[0]) for seq in seqs))  # a packet goes once
    copied = set(data.draw(st.lists(st.sampled_from(seqs), unique=True))) if seqs else set()
    copied_to = {seq: f"segment copied to, of {seq}" for seq in copied} | {0: "not removed"}
    removed = b"".join(REMOVE.pack(Kind.REMOVE, seq) for seq in seqs)
    counts, moved = packed.count_removals(bytearray(removed), firsts, copied_to)
    expected = [0] * len(firsts)
    for seq in seqs:
        if seq not in copied:
            expected[bisect.bisect_right(firsts, seq) - 1] += 1
    assert counts == expected
    assert sorted(moved) == sorted(f"segment copied to, of {seq}" for seq in copied)
    assert copied_to == {0: "not removed"}


def test_locate_answers_as_the_reference_for_queued_delayed_leased_and_gone_packets(
    tmp_path: Path,
) -> None:
    """The C core's ``locate`` (compaction's question of every packet it reads) against
    ``LoggedStore.locate``: queued, delayed (by seq, from an index that grows to thousands and
    shrinks as they arrive), arrived, leased and popped packets, and a queue never seen."""
    twins = Twins(tmp_path)
    seqs = {}  # key -> seq, as both stores numbered the pushes
    for i in range(3000):
        twins.both("push_delayed", b"a", b"d%d" % i, b"", 0, 1, 1000 + i)
        seqs[b"d%d" % i] = i + 1
    for i in range(5):
        twins.both("push", b"a", b"k%d" % i, b"", 0, 2)
        seqs[b"k%d" % i] = 3001 + i
    twins.both("pop", b"a")  # k4, the newest: gone
    taken = [store.take(b"a") for store in twins.stores]  # k3, leased
    assert taken[0] == taken[1]
    for clock in twins.clocks:
        clock.now += 2.5  # d0..d1500 arrive, the rest stay delayed
    twins.both("expire")

    def located() -> list[object]:
        asks = [(b"a", key, seq) for key, seq in seqs.items()]
        asks += [(b"a", b"d7", 10**9), (b"none", b"k0", seqs[b"k0"])]
        return [twins.both("locate", *ask) for ask in asks]

    answers = located()
    assert answers.count(b"a") == len(seqs) - 1  # all but the popped k4 (leased k3 included)
    assert answers[-3:] == [None, None, None]
    for clock in twins.clocks:
        clock.now += 10  # every delayed packet has arrived: the index shrinks
    twins.both("expire")
    assert located() == answers
    twins.commit()
    for store in twins.stores:
        store.check_invariants()
    twins.close()
