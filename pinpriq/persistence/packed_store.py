"""The log on the packed store: ``packed.PackedStore`` with every change recorded in a
``Journal``, what a ``--data-dir`` server runs on where the packed store's C core is built.

``store.LoggedStore`` (on ``QueueStore``) stays the pure-Python path and the reference: for the
same operations both write the same log, byte for byte (``tests/test_log_packed.py``). Here the
C core writes the entries itself (``_packed.c``'s "Log hooks"): ``attach_log`` hands it the
journal's open block, and each push appends its entry (the layout of ``records.py``), each
packet that leaves for good (pop, ``pop_reply``, expiry, purge, a move) a remove entry, as the
packet is in hand, with no Python frame on the push or pop path; and at the end of a batch it
frames the block (header, CRC-32: ``frame_into`` the active segment's mapping, or
``frame_block``) when it holds no copies (``Journal.seal_framed``). What is off the hot path is
here, in Python, as ``LoggedStore`` does it: leases (a take logs nothing; an ack is a removal,
a dead-letter move a copy entry), ``flush``, ``recover``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeGuard

from pinpriq import packed
from pinpriq.packed import PackedStore
from pinpriq.persistence.compaction import Compactor
from pinpriq.persistence.journal import Journal
from pinpriq.persistence.store import (
    LoggedStore,
    block_base_ms,
    check_live_counts,
    log_copy,
    log_removed,
    recover,
)
from pinpriq.store import (
    DEADLINE,
    SEQ,
    Clock,
    LoadedPacket,
    QueuedPacket,
    age,
    load_time_notes,
)

__all__ = ["LogBacked", "LoggedPackedStore", "is_logged", "logged_store"]


class LoggedPackedStore(PackedStore):
    """Packed queues whose every push and removal is logged to ``journal`` before anyone
    sees it (the contract and the log of ``store.LoggedStore``)."""

    def __init__(
        self,
        clock: Clock,
        journal: Journal,
        *,
        max_pop: int = 0xFFFF,
        truncate_damaged: bool = False,
        wall_clock: Clock = time.time,
    ) -> None:
        """As ``LoggedStore``: ``clock`` is the store's monotonic clock, ``wall_clock`` gives
        seconds since the Unix epoch."""
        super().__init__(clock, max_pop=max_pop)
        self.journal = journal
        self._wall_clock = wall_clock
        #: Cut the log at damage instead of refusing to start (``--truncate-damaged-log``).
        self.truncate_damaged = truncate_damaged
        #: Leased packets: their seq, and the queue they were taken from (``LoggedStore``);
        #: the C core's ``locate`` reads it too.
        self._taken: dict[int, bytes] = {}
        self.attach_log(journal.pushes, journal.removals, wall_clock, self._taken)
        journal.count_removals = packed.count_removals
        journal.compactor = Compactor(journal, self.locate)

    # Leases (decision 19), as LoggedStore: a take is not logged, an ack is a removal, a
    # dead-letter move a copy entry naming the new queue.

    def take(self, queue: bytes) -> list[QueuedPacket]:
        """Lease what a pop would take, logging nothing."""
        packets: list[QueuedPacket] = super().take(queue)
        taken = self._taken
        for packet in packets:
            taken[packet[SEQ]] = queue
        return packets

    def discard(self, packets: Sequence[QueuedPacket]) -> None:
        """An ack: the packets are gone for good, and logged so."""
        super().discard(packets)
        self._forget_taken(packets)
        log_removed(self.journal, packets)

    def restore(self, queue: bytes, packets: Sequence[QueuedPacket]) -> int:
        """As ``LoggedStore.restore``: back into their own queue, nothing to log; into
        another, a copy entry each; those past their deadline, a removal."""
        now = self.now()
        gone = [packet for packet in packets if packet[DEADLINE] <= now]
        back: int = super().restore(queue, packets)
        taken_from = self._forget_taken(packets)
        if gone:
            log_removed(self.journal, gone)
        if back and taken_from != queue:
            to_wall = self._wall_clock() - now
            for packet in packets:
                if packet[DEADLINE] > now:
                    packet_age = age(self._time_notes, packet[SEQ], now)
                    deadline = packet[DEADLINE]
                    log_copy(self.journal, packet, queue, deadline, now, to_wall, packet_age)
        return back

    def _forget_taken(self, packets: Sequence[QueuedPacket]) -> bytes | None:
        taken, queue = self._taken, None
        for packet in packets:
            queue = taken.pop(packet[SEQ], None)
        return queue

    def record_removed(self, packets: Sequence[QueuedPacket]) -> None:
        """As ``LoggedStore.record_removed``."""
        log_removed(self.journal, packets)

    # ``locate``, as ``LoggedStore.locate``, is the C core's: compaction asks it of every
    # packet it reads.

    def load(
        self,
        packets: Iterable[LoadedPacket],
        deadlines: Mapping[int, float],
        last_seq: int,
        *,
        times: Sequence[tuple[int, float]] = (),
        delayed: Mapping[int, float] | None = None,
    ) -> None:
        """``QueueStore.load``'s contract, filed by the C core in one loop."""
        as_dict: Any = deadlines if isinstance(deadlines, dict) else dict(deadlines)
        due: Any = delayed if delayed is None or isinstance(delayed, dict) else dict(delayed)
        self._load(packets, as_dict or None, due or None, last_seq)
        load_time_notes(self._time_notes, times)

    def flush(self) -> None:
        """Seal what this batch logged into a block and write it: framed by the C core when
        the block holds no copies (``Journal.seal_framed``), else by ``Journal.seal_stepped``."""
        journal = self.journal
        if not journal.seal_framed(self._seq, self):
            base_ms = block_base_ms(journal, self._block_wall)
            journal.seal_stepped(self._seq, base_ms)

    def check_invariants(self) -> None:
        """Also the journal's counts (``LoggedStore.check_invariants``). For tests."""
        super().check_invariants()
        check_live_counts(self.journal, [*self._live_seqs(), *self._taken])

    def close(self) -> None:
        """Write what is logged, fsync, close the log's files and release its directory."""
        if self.journal.segments:
            self.flush()
        self.journal.close()

    def recover(self, now: float, now_ms: int) -> None:
        """As ``LoggedStore.recover``."""
        recover(self, self.journal, now, now_ms, truncate_damaged=self.truncate_damaged)


#: A store that logs: what a server with ``--data-dir`` runs on.
LogBacked = LoggedStore | LoggedPackedStore


def is_logged(store: object) -> TypeGuard[LogBacked]:
    """Whether ``store`` logs its changes (the server must then flush it after each batch)."""
    return isinstance(store, (LoggedStore, LoggedPackedStore))


def logged_store(clock: Clock, journal: Journal, *, truncate_damaged: bool = False) -> LogBacked:
    """The log-backed store a ``--data-dir`` server runs on: on the packed store where its C
    core is built and wanted, else ``LoggedStore`` (as ``packed.default_store`` chooses)."""
    if packed.available:
        return LoggedPackedStore(clock, journal, truncate_damaged=truncate_damaged)
    return LoggedStore(clock, journal, truncate_damaged=truncate_damaged)
