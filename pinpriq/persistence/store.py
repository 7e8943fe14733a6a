"""The log-backed store: ``QueueStore`` with every change recorded in a ``Journal``.

It keeps the store contract (``store_contract.Store``) exactly, so the broker cannot tell it
from the memory store; only the driver knows, because it must call ``flush`` after each batch
and hold output back until the journal has stored what the batch did (``server.py``). Without
``--data-dir`` the server uses plain ``QueueStore`` and none of this runs.

* ``push`` appends a push entry to the journal's open block, then pushes; ``pop``, expiry,
  ``purge`` and an ack (``discard``) append a remove entry per packet that left. The cost per
  packet is one ``struct.pack`` and a few appends to a bytearray: no call into the journal, no
  clock read (the block's first push reads the clock once).
* Leases (decision 19): a ``take`` (reserve, leased delivery) logs nothing, so after a restart
  leased packets are back in their queues; a ``restore`` into another queue (a dead-letter
  move) logs a copy entry naming that queue, with the packet's seq, so push order is kept.
* ``flush`` seals the open block: the journal writes it with one ``pwrite``.
* ``recover`` reads the data directory back (``recovery.py``) and loads its live packets in
  push order, with their seqs and deadlines, so that pops come out as they would have had the
  server never stopped.

TTLs are logged as wall-clock deadlines (the store's clock is monotonic and starts anew with
each process): a push's TTL counts from its block's ``base_ms``, taken at or before the push,
and is turned back into the monotonic clock when replayed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Protocol

from mypy_extensions import mypyc_attr

from pinpriq.persistence.compaction import Compactor
from pinpriq.persistence.journal import Journal
from pinpriq.persistence.records import MOVED_HEADER, OPTIONS_HEADER, PUSH_HEADER, REMOVE, Kind
from pinpriq.persistence.recovery import apply, scan
from pinpriq.persistence.segments import DataDirError
from pinpriq.store import (
    DEADLINE,
    DEFAULT_MAX_POP,
    KEY,
    PAYLOAD,
    PRIO,
    SEQ,
    Clock,
    LoadedPacket,
    QueuedPacket,
    QueueStore,
)

__all__ = [
    "LoggedStore",
    "block_base_ms",
    "check_live_counts",
    "log_copy",
    "log_removed",
    "recover",
]

log = logging.getLogger("pinpriq.persistence")

# Final: mypyc keeps each in a C variable (the hot path reads them per packet).
_pack_push: Final = PUSH_HEADER.pack
_pack_options: Final = OPTIONS_HEADER.pack
_pack_moved: Final = MOVED_HEADER.pack
_pack_remove: Final = REMOVE.pack
_PUSH: Final = int(Kind.PUSH)
_REMOVE: Final = int(Kind.REMOVE)
_OPTIONS: Final = int(Kind.PUSH_OPTIONS)
_MOVED: Final = int(Kind.MOVED)
#: The largest TTL a push entry (``70``) holds; a longer one is logged with options (``71``).
_MAX_PUSH_TTL: Final = 0xFFFF


def _seq_of(packet: QueuedPacket) -> int:
    return packet[SEQ]


@mypyc_attr(allow_interpreted_subclasses=True)
class LoggedStore(QueueStore):
    """Queues whose every push and removal is logged to ``journal`` before anyone sees it.

    Compiled with the store (mypyc, ``pinpriq/_build.py``): the broker's calls into ``push``
    and ``pop`` then run no interpreted frame, which was most of what logging added to a
    push's instructions. Tests may subclass it (to slow ``recover`` down, say)."""

    def __init__(
        self,
        clock: Clock,
        journal: Journal,
        *,
        max_pop: int = DEFAULT_MAX_POP,
        truncate_damaged: bool = False,
        wall_clock: Clock = time.time,
    ) -> None:
        """``clock`` is the store's monotonic clock; ``wall_clock`` gives seconds since the
        Unix epoch, read once per block to log TTLs as wall-clock deadlines."""
        super().__init__(clock, max_pop=max_pop)
        self.journal = journal
        self._wall_clock = wall_clock
        #: Cut the log at damage instead of refusing to start (``--truncate-damaged-log``).
        self.truncate_damaged = truncate_damaged
        # The journal's open block, kept by reference: the hot path appends to it directly.
        self._pushes = journal.pushes
        self._removals = journal.removals
        self._block_wall = 0.0  # the wall clock at the open block's first push: its base_ms
        #: Leased packets (``take``n, not yet acked or restored): their seq, and the queue
        #: they were taken from. Compaction must keep them (``locate``), and a restore into
        #: another queue is a dead-letter move, logged as one.
        self._taken: dict[int, bytes] = {}
        journal.compactor = Compactor(journal, self.locate)

    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> float:
        """Log, then queue a packet; returns its deadline on the store's clock."""
        pushes = self._pushes
        if not pushes:
            self._block_wall = self._wall_clock()
        if ttl_ms <= _MAX_PUSH_TTL:
            pushes += _pack_push(_PUSH, ttl_ms, prio, len(queue), len(key), len(payload))
        else:  # protocol 1.2's u32 TTL
            pushes += _pack_options(_OPTIONS, ttl_ms, 0, prio, len(queue), len(key), len(payload))
        pushes += queue
        pushes += key
        pushes += payload
        return QueueStore.push(self, queue, key, payload, ttl_ms, prio)

    def push_delayed(
        self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int, delay_ms: int
    ) -> float:
        """Log, then hold a packet until it is due (decision 21): a push-with-options entry,
        whose due time and TTL deadline count from its block's ``base_ms``, on the wall clock,
        so it survives a restart still delayed. Returns its due time on the store's clock."""
        pushes = self._pushes
        if not pushes:
            self._block_wall = self._wall_clock()
        pushes += _pack_options(
            _OPTIONS, ttl_ms, delay_ms, prio, len(queue), len(key), len(payload)
        )
        pushes += queue
        pushes += key
        pushes += payload
        return QueueStore.push_delayed(self, queue, key, payload, ttl_ms, prio, delay_ms)

    def _moved(self, target: bytes, old: list[QueuedPacket], new: list[QueuedPacket]) -> None:
        """A move (decision 22): the old seqs are removed, and each packet is logged anew, in
        its new seq's order, as a moved entry (a push made now, keeping its wall-clock TTL
        deadline). ``QueueStore.move`` calls it once its packets are filed."""
        self.record_removed(old)
        pushes = self._pushes
        if not pushes:
            self._block_wall = self._wall_clock()
        to_wall = self._wall_clock() - self._clock()
        for packet in new:
            key, payload = packet[KEY], packet[PAYLOAD]
            deadline_ms = _wall_ms(packet[DEADLINE], to_wall)
            pushes += _pack_moved(
                _MOVED, deadline_ms, packet[PRIO], len(target), len(key), len(payload)
            )
            pushes += target
            pushes += key
            pushes += payload

    def pop(self, queue: bytes) -> list[QueuedPacket]:
        """Pop as ``QueueStore.pop`` does, logging a removal for each packet returned."""
        reply = QueueStore.pop(self, queue)
        if reply:
            removals = self._removals
            for packet in reply:
                removals += _pack_remove(_REMOVE, packet[SEQ])
        return reply

    def _removed_by_expiry(self, packets: list[QueuedPacket]) -> None:
        self.record_removed(packets)

    # Leases (decision 19): a take is not logged (after a restart, leased packets are back in
    # their queues), an ack is a removal, a dead-letter move a copy entry naming the new queue.

    def take(self, queue: bytes) -> list[QueuedPacket]:
        """Lease what a pop would take, logging nothing."""
        packets = QueueStore.take(self, queue)
        taken = self._taken
        for packet in packets:
            taken[packet[SEQ]] = queue
        return packets

    def discard(self, packets: Sequence[QueuedPacket]) -> None:
        """An ack: the packets are gone for good, and logged so."""
        QueueStore.discard(self, packets)
        self._forget_taken(packets)
        self.record_removed(packets)

    def restore(self, queue: bytes, packets: Sequence[QueuedPacket]) -> int:
        """Put taken packets back into ``queue``: into their own, nothing to log (the log never
        saw them leave); into another (a dead-letter queue), a copy entry each. Those past
        their TTL deadline are dropped, and logged as removed."""
        now = self._clock()
        gone = [packet for packet in packets if packet[DEADLINE] <= now]
        back = QueueStore.restore(self, queue, packets)
        taken_from = self._forget_taken(packets)
        if gone:
            self.record_removed(gone)
        if back and taken_from != queue:
            for packet in packets:
                if packet[DEADLINE] > now:
                    self.record_moved(packet, queue, packet[DEADLINE])
        return back

    def _forget_taken(self, packets: Sequence[QueuedPacket]) -> bytes | None:
        """Forget that these packets are leased; the queue they were taken from."""
        taken, queue = self._taken, None
        for packet in packets:
            queue = taken.pop(packet[SEQ], None)
        return queue

    def purge(self, queue: bytes) -> int:
        """Remove every packet of ``queue``, delayed ones too, and log each removal, in seq
        order (as the packed store does: one log for one history)."""
        q = self._queues.get(queue)
        packets = list(q.packets()) if q is not None else []
        packets += self.delayed_packets(queue)
        packets.sort(key=_seq_of)
        purged = QueueStore.purge(self, queue)
        self.record_removed(packets)
        return purged

    def record_removed(self, packets: Sequence[QueuedPacket]) -> None:
        """Log that these packets left the store for good: the removal path of anything other
        than pop and expiry (a purge, an ack, a TTL that ran out on a lease). Call it in the
        same batch as the removal, before ``flush``."""
        log_removed(self.journal, packets)

    def record_moved(self, packet: QueuedPacket, queue: bytes, deadline: float) -> None:
        """Log that a live packet now lives in ``queue`` with its seq (its place in push
        order), prio and ``deadline`` (on the store's clock; ``inf``: none) kept: a dead-letter
        move (decision 19). It is written whole, as a copy entry naming its new queue. Call it
        in the same batch as the move, before ``flush``."""
        now = self._clock()
        log_copy(
            self.journal,
            packet,
            queue,
            deadline,
            now,
            self._wall_clock() - now,
            self._age(packet[SEQ], now),
        )

    def locate(self, queue: bytes, key: bytes, seq: int) -> bytes | None:
        """The queue live packet ``seq`` is in now, ``None`` if it is gone (compaction asks
        before copying it forward). A leased packet is live: the queue it was taken from; a
        delayed one, the queue it waits for."""
        if self.holds(queue, key, seq):  # queued, or delayed
            return queue
        return self._taken.get(seq)  # leased: it comes back after a restart, so it is kept

    def flush(self) -> None:
        """Seal what this batch logged into a block and write it (see ``Journal.seal``)."""
        self.journal.seal(self._seq, block_base_ms(self.journal, self._block_wall))

    def check_invariants(self) -> None:
        """Also check the journal's counts: each segment's ``live`` is the number of queued
        packets whose latest entry it holds. For tests; O(n log n)."""
        super().check_invariants()
        live: list[int] = []
        for q in self._queues.values():
            for group in q.groups.values():
                for packet in group.values() if isinstance(group, dict) else (group,):
                    live.append(packet[SEQ])
        for name, _, _ in list(self.sizes()):  # and delayed ones
            live += [packet[SEQ] for packet in self.delayed_packets(name)]
        check_live_counts(self.journal, live + list(self._taken))

    def close(self) -> None:
        """Write what is logged, fsync, close the log's files and release its directory (a
        graceful stop; also after a failed start)."""
        if self.journal.segments:
            self.flush()
        self.journal.close()

    def recover(self, now: float, now_ms: int) -> None:
        """Read the data directory, cut a torn tail, restore the live packets and open the
        journal for writing. ``now`` is the store's clock and ``now_ms`` the wall clock (ms),
        read together by the caller: this may run in a worker thread, where the store's clock
        cannot be read. Raises ``segments.DataDirError`` for damage unless
        ``truncate_damaged``."""
        recover(self, self.journal, now, now_ms, truncate_damaged=self.truncate_damaged)


# What the log-backed stores share (this one, and ``packed_store.LoggedPackedStore``).


class Recoverable(Protocol):
    """What ``recover`` needs of a log-backed store."""

    @property
    def queue_count(self) -> int: ...

    @property
    def _seq(self) -> int: ...

    def __len__(self) -> int: ...

    def load(
        self,
        packets: Iterable[LoadedPacket],
        deadlines: Mapping[int, float],
        last_seq: int,
        *,
        times: Sequence[tuple[int, float]] = (),
        delayed: Mapping[int, float] | None = None,
    ) -> None: ...


def recover(
    store: Recoverable, journal: Journal, now: float, now_ms: int, *, truncate_damaged: bool
) -> None:
    """A log-backed store's ``recover``: read ``journal``'s directory, cut a torn tail, load
    the live packets into ``store`` and open the journal for writing."""
    started = time.monotonic()
    journal.recovering = True
    try:
        try:
            result = scan(journal.data_dir, now_ms=now_ms)
            apply(journal.data_dir, result, truncate_damaged=truncate_damaged)
        except OSError as error:
            raise DataDirError(f"cannot read the log in {journal.data_dir.path}: {error}") from None
        store.load(
            result.packets.values(),
            {seq: now + (ms - now_ms) / 1000 for seq, ms in result.deadlines.items()},
            result.last_seq,
            times=[(seq, now + (ms - now_ms) / 1000) for seq, ms in result.times],
            delayed={seq: now + (ms - now_ms) / 1000 for seq, ms in result.dues.items()},
        )
        try:
            journal.open(result)
        except OSError as error:  # a full disk for the first segment, among others
            raise DataDirError(
                f"cannot write to data directory {journal.data_dir.path}: {error.strerror or error}"
            ) from None
        for seq in result.expired:  # gone for good, whatever the clock says next time
            journal.removals += _pack_remove(_REMOVE, seq)
        journal.seal(store._seq, 0)
    finally:
        journal.recovering = False
        journal.recovery_seconds = time.monotonic() - started
    log.info(
        "recovered %d packets in %d queues from %s in %.2f s (%d segments, %d blocks%s)",
        len(store),
        store.queue_count,
        journal.data_dir.path,
        journal.recovery_seconds,
        len(result.segments),
        result.blocks,
        f"; {len(result.expired)} packets expired while the server was down"
        if result.expired
        else "",
    )


def log_removed(journal: Journal, packets: Sequence[QueuedPacket]) -> None:
    """Remove entries for ``packets`` in ``journal``'s open block."""
    removals = journal.removals
    for packet in packets:
        removals += _pack_remove(_REMOVE, packet[SEQ])


def log_copy(
    journal: Journal,
    packet: QueuedPacket,
    queue: bytes,
    deadline: float,
    now: float,
    to_wall: float,
    age: float | None,
) -> None:
    """A copy entry for ``packet``, now in ``queue`` with ``deadline`` (store's clock), in
    ``journal``'s open block: ``now`` is the store's clock, ``to_wall`` the seconds from it to
    the wall clock, ``age`` the packet's (at most; ``None``: unknown)."""
    pushed_ms = 0 if age is None else _wall_ms(now - age, to_wall)  # 0: unknown
    deadline_ms = _wall_ms(deadline, to_wall)
    key, payload, prio, seq = packet[KEY], packet[PAYLOAD], packet[PRIO], packet[SEQ]
    journal.add_copy(seq, deadline_ms, pushed_ms, prio, queue, key, payload)


def block_base_ms(journal: Journal, block_wall: float) -> int:
    """The open block's ``base_ms``: its first push's time on the wall clock (``block_wall``)
    in ms, rounded down, so a logged deadline is never later than the real one; 0 for a block
    without pushes. (Read at the first push, not converted from the store's clock at the
    seal: under trio that clock is interpreted, and each call costs several of ``time.time``.)"""
    if not journal.pushes:
        return 0
    return int(block_wall * 1000)


def check_live_counts(journal: Journal, live: Iterable[int]) -> None:
    """Assert each segment's ``live`` is the number of ``live`` seqs (queued, delayed and
    leased packets) whose latest entry it holds. For tests."""
    if not journal.segments:
        return
    counted = {id(segment): 0 for segment in journal.segments}
    for seq in live:
        counted[id(journal.where(seq))] += 1
    for segment in journal.segments:
        assert segment.live == counted[id(segment)], (
            f"{segment.path.name}: live {segment.live}, but {counted[id(segment)]} "
            "queued packets have their entry there"
        )


def _wall_ms(when: float, to_wall: float) -> int:
    """A time on the store's clock as wall-clock milliseconds (``to_wall``: seconds from the
    one clock to the other), rounded down, so a logged deadline is never later than the real
    one; ``inf`` (none) is 0."""
    if when == math.inf:
        return 0
    return int((when + to_wall) * 1000)
