"""Compaction: copying the live packets of the oldest segment forward, so it can be deleted.

Segments are deleted oldest first, once no live packet's entry is in them (``journal.py``).
Most die on their own: TTLs are at most 65.5 s, and pops remove what was pushed. A segment
that still holds a few live packets (a prio-255 packet nobody pops, a TTL-0 packet waiting for
a worker) would pin itself and every later segment, as one unacked message pins a RabbitMQ
quorum queue's segments. So once the log's dead bytes exceed its live bytes, the compactor
reads the oldest segment and writes each of its live packets again, as a
copy entry, into the block being sealed; when it has read the whole segment, nothing live is
left in it and the journal deletes it once the copies are on disk (it asks the keeper for that
fsync at once), while the compactor reads on into the next segment.

While the disk is full, compaction waits: its copies would use up the reserved segment that
pops' remove entries need, and those pops free whole segments as they empty them.

No full rewrite and no fork: each seal reads a bounded slice of the oldest segment,
``STEP_FACTOR`` times the bytes of new entries the seal adds (its copies not counted, so copying
does not feed itself), and at least one block, so compaction's cost is spread over the writes
that make it necessary, and the log cannot outgrow it: reading a segment whose live share is
``u`` frees its size at the cost of ``u`` of it in copies, so the log shrinks while
``STEP_FACTOR * (1 - u) > 1``, for any segment up to three quarters live.

Paced by the new writes, compaction lets a draining queue empty the old segments itself: a
queue drained in priority order leaves every segment half dead halfway through, and the pops'
remove entries are small, so they pay for reading little, and the drain overtakes compaction
instead of compaction copying forward packets about to be popped (docs/persistence.md has the
figures). A block is read whole but its entries are looked at a seal's budget at a time: a
block of a stream of pushes holds thousands.

What this module must not know: the store (it asks ``Locate`` whether a packet lives, and
where), the journal's class (it is handed a ``CompactedLog``, which ``journal.Journal`` is: the
journal owns its compactor, so imports go one way), trio.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

from pinpriq.persistence.records import (
    BLOCK_HEADER,
    Entries,
    LogFormatError,
    decode_entries,
    read_block,
)
from pinpriq.persistence.segments import SEGMENT_HEADER_SIZE, Segment

__all__ = ["MIN_SEGMENTS", "STEP_FACTOR", "CompactedLog", "Compactor", "Locate"]

#: ``locate(queue, key, seq)``: the queue a packet lives in now if it is live, else ``None``
#: (``queue`` is the one its latest entry names: a moved packet's latest entry is the copy a
#: move writes). The log-backed store answers from its queues; a store with leases must also
#: answer for leased packets, which are live in the log.
Locate = Callable[[bytes, bytes, int], bytes | None]

#: Fewest segments (the active one included) of a log worth compacting.
MIN_SEGMENTS = 3
#: Bytes read per byte of new entries sealed, while compaction is due: above 2, so that reading
#: the old segments outpaces writing new ones even when the copies are half the reads.
STEP_FACTOR = 4


class CompactedLog(Protocol):
    """What the compactor reads and calls of the log it compacts (``journal.Journal``)."""

    disk_full: bool
    #: Segments holding blocks, oldest first; the last is the active one.
    segments: list[Segment]
    #: The previous active segment while it is fsynced after a rotation, else ``None``.
    rotating: Segment | None
    segment_size: int
    used_bytes: int

    @property
    def active(self) -> Segment: ...

    def live_bytes(self) -> float: ...

    def where(self, seq: int) -> Segment: ...

    def add_copy(
        self,
        seq: int,
        deadline_ms: int,
        pushed_ms: int,
        prio: int,
        queue: bytes,
        key: bytes,
        payload: bytes,
        due_ms: int = 0,
    ) -> None: ...


class Compactor:
    """Reads the oldest segment a slice at a time and copies its live packets forward."""

    def __init__(self, journal: CompactedLog, locate: Locate) -> None:
        self._journal = journal
        self._locate = locate
        self._where = journal.where  # a bound method: no lookup per packet
        #: The segment being read, if any: a plain attribute, which the journal reads at every
        #: seal for what ``idle`` says, without a property call.
        self.reading: Segment | None = None
        self._fd: int | None = None
        self._offset = 0  # of the next block to read in it
        #: The last block read: its entries, its base_ms and its pushes' deadlines and due
        #: times by seq; how many of its push and copy entries there are, the next one to look
        #: at (its pushes first), and what each costs of a seal's budget (its share of the
        #: block's bytes). Most are of packets gone, so their times are looked up only for
        #: the live ones, as they are copied.
        self._entries = Entries()
        self._base_ms = 0
        self._deadlines: dict[int, int] = {}
        self._dues: dict[int, int] = {}
        self._count = 0
        self._next = 0
        self._cost = 0
        self._read_through = 0  # the number of the last segment read to its end
        #: The log's size (``used_bytes``) it must reach before compaction may be due again:
        #: a segment above its size when compaction was last found not due (``due``); 0
        #: once reached, until then.
        self._armed_at = 0
        #: Packets copied forward since the server started.
        self.copied = 0

    def due(self) -> bool:
        """Whether the dead bytes of the log pass its live bytes (in a log of more than a
        couple of segments: a small log is not worth copying), and the log has grown by a
        segment since compaction was last found not due.

        The growth is what makes compaction worth its cost: a drain (pops, expiries) makes
        dead bytes but writes only 9-byte remove entries, and the segments it empties go by
        themselves, so compacting behind it copies forward packets about to be popped and
        reads entries already dead (a drain of 1,500,000 packets ran at half the speed of one
        in a single segment). A log that grows while over half dead (a packet nobody pops
        pinning the segments behind it) re-arms compaction within a segment, as Redis
        rewrites its AOF when it has grown since the last rewrite."""
        journal = self._journal
        used = journal.used_bytes
        if used <= 2 * journal.segment_size or len(journal.segments) < MIN_SEGMENTS:
            return False
        live = journal.live_bytes()
        if used - live <= live:
            self._armed_at = used + journal.segment_size
            return False
        if used < self._armed_at:
            return False
        self._armed_at = 0  # due from now on, until found not due
        return True

    @property
    def idle(self) -> bool:
        """Whether ``step`` would do nothing now: nothing under way, in a log too small to
        be due."""
        return self.reading is None and len(self._journal.segments) < MIN_SEGMENTS

    def step(self, sealed: int) -> None:
        """Read on in the oldest segments, copying their live packets into the block being
        sealed (``sealed``: the bytes of its new entries), if compaction is due or under way:
        ``STEP_FACTOR`` times ``sealed`` bytes, into the next segment when one is read
        through."""
        if self.idle:
            return  # the common case
        if self._journal.disk_full:
            return  # copies would eat the reserve the pops' removals need; pops free space
        budget = STEP_FACTOR * sealed
        segment = self.reading
        while budget > 0:
            if segment is None:
                segment = self._next_segment()
                if segment is None:
                    return
                self._open(segment)
            if self._next < self._count:
                self._look_at(segment, self._next)
                self._next += 1
                budget -= self._cost
            elif self._offset < segment.end:
                if not self._read(segment):
                    budget -= self._cost  # a block of remove entries only: its bytes
            else:
                # The journal deletes it once its copies are on disk; meanwhile read on into
                # the next one, so compaction is not held to one segment per fsync.
                self._read_through = segment.number
                self.close()
                segment = None

    def _next_segment(self) -> Segment | None:
        """The oldest segment not read through yet, if compaction is due and the segment is
        no longer written to."""
        journal = self._journal
        for segment in journal.segments:
            if segment.number > self._read_through:
                break
        else:
            return None
        if segment is journal.active or segment is journal.rotating or not self.due():
            return None
        return segment

    def _open(self, segment: Segment) -> None:
        self.reading = segment
        self._fd = os.open(segment.path, os.O_RDONLY | os.O_CLOEXEC)
        self._offset = SEGMENT_HEADER_SIZE

    def close(self) -> None:
        """Stop reading the segment under way, if any."""
        if self._fd is not None:
            os.close(self._fd)
        self.reading = None
        self._fd = None
        self._entries = Entries()
        self._count = self._next = 0

    def forget(self, segment: Segment) -> None:
        """The journal deletes ``segment``: stop reading it."""
        if self.reading is segment:
            self.close()

    def _read_block(self, segment: Segment) -> bytes:
        """The next whole block of ``segment``, which the journal wrote and read back whole
        at start, so anything else is damage appearing under a running server."""
        assert self._fd is not None
        header = os.pread(self._fd, BLOCK_HEADER.size, self._offset)
        _, length, _ = BLOCK_HEADER.unpack(header)
        data = header + os.pread(self._fd, length, self._offset + BLOCK_HEADER.size)
        if len(data) != BLOCK_HEADER.size + length:
            raise LogFormatError(f"{segment.path}: a block at {self._offset} reads short")
        self._offset += len(data)
        return data

    def _read(self, segment: Segment) -> bool:
        """Read the next block of ``segment``, whose push and copy entries are looked at next:
        whether it has any."""
        data = self._read_block(segment)
        block = read_block(data, 0)
        if block is None:
            raise LogFormatError(f"{segment.path}: no block where one was written")
        entries = decode_entries(data, block, old_copies=segment.version == 1)
        self._entries, self._base_ms = entries, block.base_ms
        self._deadlines, self._dues = dict(entries.push_deadlines), dict(entries.push_dues)
        self._count, self._next = len(entries.pushes) + len(entries.copies), 0
        self._cost = len(data) // max(1, self._count)
        return self._count > 0

    def _look_at(self, segment: Segment, i: int) -> None:
        """Copy forward the packet of the block's ``i``-th push or copy entry if it is live
        and its latest entry is that one. One pushed with a delay is copied with its due
        time, as a delayed copy: whether it has arrived since or not (a due time that has
        passed is due at once when read back)."""
        entries = self._entries
        pushes = entries.pushes
        packet = pushes[i] if i < len(pushes) else entries.copies[i - len(pushes)]
        queue, key, payload, prio, seq = packet
        current = self._locate(queue, key, seq)  # first: most packets read are gone
        if current is None or self._where(seq) is not segment:
            return  # gone, or copied forward already
        if i < len(pushes):
            deadline_ms, pushed_ms = self._deadlines.get(seq, 0), self._base_ms
            due_ms = self._dues.get(seq, 0)
        else:
            j = i - len(pushes)
            deadline_ms, pushed_ms = entries.copy_deadlines[j], entries.copy_times[j]
            due_ms = entries.copy_dues[j]
        self._journal.add_copy(seq, deadline_ms, pushed_ms, prio, current, key, payload, due_ms)
        self.copied += 1
