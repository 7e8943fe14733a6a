"""The log's write side: the open block the store fills, sealing, writing in order, the segment
lifecycle, and holding output back until records are stored as the fsync policy promises.
Synchronous and single-threaded; what must wait (fsyncs, new segments, a full disk) is done by
``keeper.Keeper`` in trio, which calls back in here. Compiled with mypyc where it can be
(``setup.py``'s list; its per-block bookkeeping is then native ints and C calls), else run as
plain Python: so ``Journal`` is a native class, whose methods cannot be patched on an instance.

Theory of operation.

* **Open block.** The store appends push entries to ``pushes`` and remove/move entries to
  ``removals`` as it applies frames (``store.LoggedStore``); the driver calls ``seal`` once per
  batch of frames, which turns them into one block (``records.py``), queues it and writes it:
  one ``pwrite`` per batch, never one per packet. The removed packets' seqs are read back
  from the remove entries when the counts need them, so a removal makes no Python object. On
  the packed store a block without copies (all but compaction's and a dead-letter move's) is
  framed by its C core instead of ``encode_block`` (``seal_framed``).
* **Writing.** Under ``everysec`` and ``no`` a block is copied into a shared mapping of the
  active segment (``Segment.map``), not written with ``pwrite``: either way its bytes are in
  the kernel's page cache when the call returns, which is all a kill -9 needs, but a copy
  costs a ``memcpy`` and a minor fault per new page where ``pwrite`` costs a system call and
  the file system's write path per block (docs/performance.md has the figures). A new
  segment is read through by the thread that makes it (``create_segment``), so the first
  write into each page finds it cached. Only a segment whose whole size is allocated is
  mapped: a write into a mapped page with no disk block behind it raises SIGBUS on a full
  disk, where ``pwrite`` says ENOSPC. Under ``always`` blocks are written with ``pwrite``:
  each batch's fsync cleans its pages, so the next batch's copy into the same page would
  fault again. A mapped page the disk cannot read back (evicted, then EIO) raises SIGBUS,
  which stops the server as a kill -9 would, the log as after a crash; an error writing
  pages back is reported by the next fsync, mapped or not, and fails the journal.
* **Positions.** ``sealed_pos``, ``written_pos`` and ``synced_pos`` count bytes of blocks since
  the server started: sealed, handed to the kernel, known to be on disk. ``released`` is true
  when output may be written: every sealed block is written and, under ``always``, synced. A
  reply or delivery produced while ``released`` is false waits (``Keeper.wait_released``) until
  what was sealed before it has been stored; so a pop's reply never reaches its client before
  the pop's remove entry is in the log (kill -9 loses nothing acknowledged, under any policy),
  and under ``always`` never before it is on disk.
* **Holds.** Writing stops while ``hold`` is set: a full segment is being fsynced before the
  next is written (``ROTATION``: so that only the newest segment can ever be torn), no spare
  segment is ready to rotate into (``SPARE``), the disk is full (``SPACE``), or a write failed
  (``FAILED``: the server stops; the log can no longer promise anything). Sealed blocks queue up
  meanwhile, and output waits with them.
* **Segments and deletion.** Each segment counts ``live``: packets whose latest push or copy
  entry it holds. Pushes are logged in seq order, so a packet's segment is found by bisecting
  the segments' first seqs (``where``), unless compaction copied it forward (``_copied_to``).
  The oldest segment is deleted once it holds no live packet (and the copies made of its
  packets are on disk): only the oldest, since a younger segment's remove entries are what keep
  older pushes dead.
* **The reserve.** Segments are created whole, with their space reserved, one ahead of need
  (the spare). When a spare cannot be made because the disk is full, ``on_disk_full(True)``
  stops pushes (the broker treats it like its memory cap) while the active segment, just
  rotated into and so nearly empty, takes the remove entries of pops. If even that fills, the
  hold stops all output, pops' replies included, until space is found.
"""

from __future__ import annotations

import bisect
import enum
import errno
import logging
import mmap
import os
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple, Protocol

from pinpriq.persistence.compaction import MIN_SEGMENTS, Compactor
from pinpriq.persistence.records import (
    REMOVE,
    LogFormatError,
    encode_block,
    encode_copy,
)
from pinpriq.persistence.recovery import Scan
from pinpriq.persistence.segments import (
    FORMAT_VERSION,
    SEGMENT_HEADER_SIZE,
    DataDir,
    Segment,
    create_segment,
)

__all__ = [
    "DEFAULT_SEGMENT_SIZE",
    "MIN_SEGMENT_SIZE",
    "FsyncPolicy",
    "Hold",
    "Journal",
    "JournalStats",
]

log = logging.getLogger("pinpriq.persistence")

DEFAULT_SEGMENT_SIZE = 32 * 1024 * 1024
#: Smallest segment size allowed: tests use small segments to exercise rotation and deletion.
MIN_SEGMENT_SIZE = 64 * 1024
#: Under everysec the active segment is also fsynced as soon as this share of a segment
#: (a quarter) is written and not synced, as Redis fsyncs its AOF rewrite every 4 MB: the fsync
#: at a rotation holds all output (only the newest segment may be torn), and at -P 64 a whole
#: segment's writeback held it 22-88 ms; so it has at most a quarter segment to write back.
EARLY_SYNC_SHARE = 4
#: ``Journal._early_sync_bytes`` under the other policies: no amount of writes is early due.
_NEVER = 1 << 60  # within a mypyc short int


class FsyncPolicy(enum.Enum):
    """When the log is fsynced (``--fsync``)."""

    #: Before any reply or delivery that follows the logged frames (one fsync per batch).
    ALWAYS = "always"
    #: About once a second, in a thread: at most about a second of operations lost on power
    #: failure.
    EVERYSEC = "everysec"
    #: Only when a segment is full: the kernel writes the rest back when it likes.
    NO = "no"


class Hold(enum.Enum):
    """Why the journal is not writing its sealed blocks."""

    ROTATION = "the full segment is being fsynced before the next is written"
    SPARE = "no new segment is ready yet"
    SPACE = "the disk is full"
    FAILED = "reading, writing or syncing the log failed"


class JournalStats(NamedTuple):
    """What an operator (the admin listener's /metrics and /stats) reads about the log."""

    policy: str
    recovering: bool
    recovery_seconds: float
    segments: int  # segment files holding blocks, the spare not included
    disk_bytes: int  # bytes the log's files take, spare included (space is reserved whole)
    log_bytes: int  # bytes of blocks in the segments
    live_packets: int  # packets the log holds live (packets queued, plus leased ones)
    blocks_written: int
    bytes_written: int
    fsyncs: int
    fsync_seconds: float  # in all
    last_fsync_seconds: float
    copied: int  # packets compaction copied forward
    segments_deleted: int
    disk_full: bool


class _Sealed:
    """A block waiting to be written, with what its writing changes in the segments' counts."""

    __slots__ = ("copied", "data", "done", "entries", "entry_bytes", "pushes", "removed", "seq")

    def __init__(
        self,
        data: bytes,
        seq: int,
        pushes: int,
        entries: int,
        entry_bytes: int,
        removed: bytes,
        copied: list[int],
    ) -> None:
        self.data = data
        self.done = 0  # bytes of it written so far
        self.seq = seq  # the store's seq after its pushes
        self.pushes = pushes
        self.entries = entries  # push and copy entries
        self.entry_bytes = entry_bytes
        self.removed = removed  # the block's remove entries
        self.copied = copied


class BlockFramer(Protocol):
    """The packed store's C core framing the open block (``PackedCore``): the whole block
    ``encode_block`` would make of ``pushes`` and ``removals`` (``seq_base``: the store's seq
    before its first push; its ``base_ms`` the core's own). Framing clears them."""

    def frame_block(self, seq_base: int, /) -> bytes | None:
        """The block as ``bytes``; ``None`` if the open block is empty."""
        ...

    def frame_into(self, seq_base: int, buffer: mmap.mmap, at: int, /) -> int:
        """The block framed straight into ``buffer`` at ``at``: its size; 0 if the open block
        is empty; -1 if it would end past the buffer, in which case nothing is framed."""
        ...


class RemovalCounter(Protocol):
    """The packed store's C core counting a block's remove entries out of their segments
    (``_packed.count_removals``): per segment of ``firsts``, the removed seqs it holds, and
    the segments of those found in ``copied_to``, which it takes out of it."""

    def __call__(
        self, removed: bytes | bytearray, firsts: list[int], copied_to: dict[int, Segment], /
    ) -> tuple[list[int], list[Segment]]: ...


def _nothing() -> None:
    """The default ``wake``: no keeper yet."""


def _ignore(full: bool) -> None:
    """The default ``on_disk_full``: no broker to tell."""


class Journal:
    """The write side of one data directory's log."""

    def __init__(
        self,
        data_dir: DataDir,
        *,
        policy: FsyncPolicy = FsyncPolicy.EVERYSEC,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
        mapped: bool | None = None,
    ) -> None:
        """``mapped``: whether blocks are copied into a shared mapping of the active segment
        rather than written with ``pwrite`` (see the module's docstring); by default under
        ``everysec`` and ``no``, where a block is not fsynced at once."""
        if segment_size < MIN_SEGMENT_SIZE:
            raise ValueError(f"segment size {segment_size} is below {MIN_SEGMENT_SIZE}")
        self.data_dir = data_dir
        self.policy = policy
        self.segment_size = segment_size
        self._always = policy is FsyncPolicy.ALWAYS
        #: Unsynced bytes past which everysec fsyncs without waiting for its second.
        self._early_sync_bytes = (
            segment_size // EARLY_SYNC_SHARE if policy is FsyncPolicy.EVERYSEC else _NEVER
        )
        self.mapped = not self._always if mapped is None else mapped
        #: The open block's entries, appended to by the store on its hot path (in place:
        #: ``seal`` clears them, so the store may keep references).
        self.pushes = bytearray()
        self.removals = bytearray()  # remove entries only: the seqs are read back from them
        self._copies = bytearray()
        self._copied: list[int] = []
        self.compactor: Compactor | None = None
        #: Segments holding blocks, oldest first; the last is the active one.
        self.segments: list[Segment] = []
        self._firsts: list[int] = []  # their first seqs, for ``where``
        self._copied_to: dict[int, Segment] = {}
        self.spare: Segment | None = None
        #: The previous active segment while it is fsynced, after a rotation.
        self.rotating: Segment | None = None
        self._next_number = 1
        self._pending: deque[_Sealed] = deque()
        self.hold: Hold | None = None
        #: Why the log failed (``Hold.FAILED``): one line, which the keeper stops the server with.
        self.failure: str | None = None
        self.sealed_pos = 0
        self.written_pos = 0
        self.synced_pos = 0
        #: Whether output may be written now (see the module's docstring).
        self.released = True
        self._sealed_seq = 0  # the store's seq at the last seal
        self._written_seq = 0  # the store's seq after the last block written
        self.used_bytes = 0  # header and block bytes in ``segments``
        #: Called when the keeper has work: a sync, a rotation, a spare, a retry.
        self.wake: Callable[[], None] = _nothing
        #: Called with True when pushes must wait for disk space, False when they may go on.
        self.on_disk_full: Callable[[bool], None] = _ignore
        #: Where the C core is built, what counts each block's removals in one C loop (the
        #: packed store sets it); else ``_count_removals`` reads them in Python.
        self.count_removals: RemovalCounter | None = None
        self.disk_full = False
        self.recovering = False
        self.recovery_seconds = 0.0
        self.last_sync = 0.0  # time.monotonic() of the last fsync's start
        self.fsyncs = 0
        self.fsync_seconds = 0.0
        self.last_fsync_seconds = 0.0
        self.blocks_written = 0
        self.segments_deleted = 0

    # -- start ----------------------------------------------------------------------------

    def open(self, scan: Scan) -> None:
        """Take over the segments a recovery read: the newest becomes the active segment (or
        a spare, or a new segment), one spare is kept, other spares are deleted."""
        by_number = {segment.number: segment for segment in scan.segments}
        for segment in scan.segments:
            self._add(segment)
            self.used_bytes += segment.end
        self._copied_to = {seq: by_number[number] for seq, number in scan.copied.items()}
        self._sealed_seq = self._written_seq = scan.last_seq
        numbers = [s.number for s in scan.segments]
        # One spare is kept, of this format: blocks are never appended to an older one.
        spares = [spare for spare in scan.spares if spare.version == FORMAT_VERSION][:1]
        for extra in [spare for spare in scan.spares if spare not in spares]:
            extra.path.unlink()
        # Numbered on from the files kept, so that deleting extra spares leaves no gap in the
        # numbers (recovery takes a gap for a lost segment).
        numbers += [spare.number for spare in spares]
        self._next_number = max(numbers, default=0) + 1
        if self.segments and self.segments[-1].version == FORMAT_VERSION:
            self._reopen(self.segments[-1])
            if spares:
                self._reopen(spares[0])
                self.spare = spares[0]
        else:
            if spares:
                active = spares[0]
                self._reopen(active)
            else:
                active = self._new_segment()
            active.first_seq = scan.last_seq + 1
            self._add(active)
            self.used_bytes += active.end

    def _reopen(self, segment: Segment) -> None:
        """Open a recovered segment (the newest, or a spare) to write into, its reserve
        restored (a spare cut back to its header by recovery has none)."""
        segment.fd = os.open(segment.path, os.O_RDWR | os.O_CLOEXEC)
        segment.size = max(segment.size, self.segment_size, segment.end)
        try:
            os.posix_fallocate(segment.fd, 0, segment.size)
        except OSError as error:
            log.warning("cannot reserve space in %s: %s", segment.path, error.strerror)
            segment.size = max(segment.end, os.fstat(segment.fd).st_size)
        self._map(segment)

    def _new_segment(self) -> Segment:
        number = self._next_number
        path = self.data_dir.segment_path(number)
        segment = Segment(number, path, self.segment_size)
        segment.fd = create_segment(path, self.segment_size)
        self._next_number += 1
        self._map(segment)
        return segment

    def _map(self, segment: Segment) -> None:
        """Map a segment about to be written to, if the journal writes through mappings and
        the segment's space is reserved (``Segment.map``)."""
        if self.mapped and not segment.map():
            log.info("%s: space not reserved on disk, written with pwrite", segment.path.name)

    def _add(self, segment: Segment) -> None:
        assert segment.first_seq is not None
        self.segments.append(segment)
        self._firsts.append(segment.first_seq)

    @property
    def active(self) -> Segment:
        return self.segments[-1]

    # -- the open block -------------------------------------------------------------------

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
    ) -> None:
        """Write a live packet again into the open block, whole, with the queue it lives in
        now and the wall-clock time of its push (0: unknown): compaction's copies, and moves
        to another queue (its seq, so its place in push order, kept). Its latest entry is then
        in the active segment. ``due_ms``: the wall-clock due time of a packet pushed with a
        delay (a delayed copy), 0 for others."""
        self._copies += encode_copy(seq, deadline_ms, pushed_ms, prio, queue, key, payload, due_ms)
        self._copied.append(seq)

    def seal(self, seq: int, base_ms: int) -> None:
        """Close the open block (``seq``: the store's push counter now; ``base_ms``: the
        wall-clock time its first push's TTL counts from), queue it and write what can be
        written. Does nothing if the block is empty."""
        if not self.pushes and not self.removals and not self._copies:
            return
        self._step_compaction()
        self.seal_stepped(seq, base_ms)

    def seal_stepped(self, seq: int, base_ms: int) -> None:
        """``seal``, compaction's step taken already (by ``seal_framed``)."""
        pushes, removals = self.pushes, self.removals
        copies, copied = self._copies, self._copied
        data = encode_block(self._sealed_seq, base_ms, pushes, copies, removals)
        self._queue(data, seq, len(pushes) + len(copies), removals, copied)
        pushes.clear()
        removals.clear()
        copies.clear()
        self._copied = []

    def seal_framed(self, seq: int, framer: BlockFramer) -> bool:
        """``seal`` on the packed store, whose C core frames the block (``framer``) unless it
        holds copies: whether it did. If not, compaction's step is taken and the caller seals
        with ``seal_stepped``. At -P 1 every block is framed here; into the active segment's
        mapping, with no ``bytes`` made, when nothing is queued or held and it fits."""
        pushes, removals = self.pushes, self.removals
        if not pushes and not removals:
            return not self._copies  # nothing to seal, or a move's copies alone
        compactor = self.compactor
        # ``not Compactor.idle``, read inline: its step may add copies.
        if compactor is not None and (
            compactor.reading is not None or len(self.segments) >= MIN_SEGMENTS
        ):
            self._step_compaction()
        if self._copies:
            return False
        entry_bytes, removed = len(pushes), bytes(removals)  # framing clears them
        segment = self.segments[-1]
        mapping = segment.mapping
        if mapping is not None and not self._pending and not self.hold:
            size = framer.frame_into(self._sealed_seq, mapping, segment.end)
            if size > 0:
                self._sealed_written(size, seq, entry_bytes, removed, [], segment)
                return True
        data = framer.frame_block(self._sealed_seq)
        assert data is not None
        self._queue(data, seq, entry_bytes, removed, [])
        return True

    def _step_compaction(self) -> None:
        if self.compactor is not None and self.hold is not Hold.FAILED:
            try:
                self.compactor.step(len(self.pushes) + len(self.removals))
            except (OSError, LogFormatError) as error:
                # EIO, or a block that no longer reads as written: the log cannot be trusted.
                self.fail(f"compaction's read of {self.segments[0].path} failed", error)

    def _queue(
        self,
        data: bytes,
        seq: int,
        entry_bytes: int,
        removed: bytes | bytearray,
        copied: list[int],
    ) -> None:
        """Queue sealed block ``data`` (``seq``: the store's seq after it; ``entry_bytes``:
        its push and copy entries' bytes; ``removed``: its remove entries; ``copied``: the
        seqs it copied) and write what can be written.

        The common case, every request at -P 1 on a segment written with ``pwrite``, is
        written here (``Segment.write``) with no ``_Sealed``: nothing is queued or held and
        the block fits the active segment."""
        size = len(data)
        segment = self.segments[-1]
        at = segment.end
        if (
            segment.fd is not None
            and at + size <= segment.size
            and not self._pending
            and not self.hold
        ):
            try:
                done = segment.write(data, at)
            except OSError:
                done = 0  # ``write`` tries again, and meets the error itself
            if done == size:
                self._sealed_written(size, seq, entry_bytes, removed, copied, segment)
                return
            # A short write counts nothing: ``write`` writes the block again, whole.
        pushed = self._count_sealed(size, seq)
        entries = pushed + len(copied)
        block = _Sealed(data, seq, pushed, entries, entry_bytes, bytes(removed), copied)
        self._pending.append(block)
        self.write()

    def _sealed_written(
        self,
        size: int,
        seq: int,
        entry_bytes: int,
        removed: bytes | bytearray,
        copied: list[int],
        segment: Segment,
    ) -> None:
        """A block just sealed (its fields as ``_queue``'s) is in ``segment`` already, whole,
        with nothing queued before it: count it sealed and written."""
        pushed = self._count_sealed(size, seq)
        entries = pushed + len(copied)
        self._written(size, seq, pushed, entries, entry_bytes, removed, copied, segment)
        self.released = not self._always  # nothing queued; under always, not synced

    def _count_sealed(self, size: int, seq: int) -> int:
        """Count a block of ``size`` bytes sealed, the store's seq ``seq`` after it; returns
        how many pushes it holds."""
        pushed = seq - self._sealed_seq
        self.sealed_pos += size
        self._sealed_seq = seq
        return pushed

    # -- writing --------------------------------------------------------------------------

    def write(self) -> None:
        """Write sealed blocks, in order, until none is left or a hold stops it."""
        pending = self._pending
        while pending and self.hold is None:
            block = pending[0]
            segment = self.segments[-1]
            size = len(block.data)
            at = segment.end + block.done
            if not block.done and at + size > segment.size and at > SEGMENT_HEADER_SIZE:
                self._rotate()
                continue
            try:
                block.done += segment.write(memoryview(block.data)[block.done :], at)
            except OSError as error:
                self._write_failed(error)
                break
            if block.done == size:
                pending.popleft()
                self._written(
                    size,
                    block.seq,
                    block.pushes,
                    block.entries,
                    block.entry_bytes,
                    block.removed,
                    block.copied,
                    segment,
                )
        self._update_released()

    def _written(
        self,
        size: int,
        seq: int,
        pushes: int,
        entries: int,
        entry_bytes: int,
        removed: bytes | bytearray,
        copied: list[int],
        segment: Segment,
    ) -> None:
        """A block of ``size`` bytes is written whole into ``segment``: count it (its fields
        as ``_Sealed``'s)."""
        segment.end += size
        self.used_bytes += size
        self.written_pos += size
        self.blocks_written += 1
        self._written_seq = seq
        segment.live += pushes
        segment.entries += entries
        segment.entry_bytes += entry_bytes
        copied_to = self._copied_to
        for copy in copied:
            source = self.where(copy)
            source.live -= 1
            source.copies_at = self.written_pos
            segment.live += 1
            copied_to[copy] = segment
        self._count_removals(removed)
        unsynced, early = self.written_pos - self.synced_pos, self._early_sync_bytes
        if self._always or unsynced == size or unsynced - size < early <= unsynced:
            self.wake()  # a sync is due now (always, or everysec's early one), or in a second
        if len(self.segments) > 1 and not self.segments[0].live:
            self._collect()

    def _count_removals(self, removed: bytes | bytearray) -> None:
        """Count the packets of ``removed`` (remove entries) out of their segments."""
        segments, firsts, copied_to = self.segments, self._firsts, self._copied_to
        if len(segments) == 1 and not copied_to:  # the common small case: one segment
            segments[0].live -= len(removed) // REMOVE.size
            return
        if self.count_removals is not None:  # per packet in a log of several segments
            counts, moved = self.count_removals(removed, firsts, copied_to)
            for i, count in enumerate(counts):
                segments[i].live -= count
            for segment in moved:
                segment.live -= 1
            return
        for _, seq in REMOVE.iter_unpack(removed):
            source = copied_to.pop(seq, None) if copied_to else None
            if source is None:
                source = segments[bisect.bisect_right(firsts, seq) - 1]
            source.live -= 1

    def where(self, seq: int) -> Segment:
        """The segment holding the latest push or copy entry of live packet ``seq``."""
        segment = self._copied_to.get(seq)
        if segment is None:
            segment = self.segments[bisect.bisect_right(self._firsts, seq) - 1]
        return segment

    def _rotate(self) -> None:
        """The active segment is full: switch to the spare, and hold writes until the full
        segment is on disk, so that a crash can tear only the newest segment."""
        spare = self.spare
        if spare is None:
            self.hold = Hold.SPARE
            self.wake()
            return
        self.rotating = self.segments[-1]
        self.hold = Hold.ROTATION
        self.spare = None
        spare.first_seq = self._written_seq + 1
        self._add(spare)
        self.used_bytes += spare.end
        self.wake()

    def _write_failed(self, error: OSError) -> None:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            self.hold = Hold.SPACE
            self._set_disk_full(True, error)
            self.wake()
        else:
            self.fail("writing the log failed", error)

    def fail(self, what: str, error: Exception) -> None:
        """Reading, writing or syncing the log failed: nothing more is written, output waits
        for ever, and the keeper stops the server with ``failure``."""
        if self.hold is Hold.FAILED:
            return
        self.hold = Hold.FAILED
        self.failure = f"{what}: {error}"
        log.critical("%s; the server stops", self.failure)
        self.wake()

    def _update_released(self) -> None:
        self.released = not self._pending and (
            not self._always or self.synced_pos >= self.written_pos
        )

    @property
    def reached(self) -> int:
        """How far output waiting on the log may go: blocks up to here are stored as the
        policy promises."""
        return self.synced_pos if self._always else self.written_pos

    # -- what the keeper calls ------------------------------------------------------------

    def sync_due(self, now: float) -> bool:
        """Whether the keeper should fsync the active segment now (``now``: monotonic)."""
        unsynced = self.written_pos - self.synced_pos
        if unsynced > 0:
            if self._always:
                return True
            if unsynced >= self._early_sync_bytes:
                return True
            if self.policy is FsyncPolicy.EVERYSEC and now - self.last_sync >= 1.0:
                return True
        oldest = self.segments[0]
        return len(self.segments) > 1 and not oldest.live and self.synced_pos < oldest.copies_at

    def synced(self, position: int, seconds: float) -> None:
        """An fsync of the active segment that began at ``position`` has returned."""
        self.fsyncs += 1
        self.fsync_seconds += seconds
        self.last_fsync_seconds = seconds
        self.synced_pos = max(self.synced_pos, position)
        self._update_released()
        self._collect()

    def rotated(self, seconds: float) -> None:
        """The full segment is on disk: close it and write into the new one."""
        if self.hold is Hold.FAILED:  # meanwhile: the server is stopping
            return
        full = self.rotating
        assert full is not None
        assert self.hold is Hold.ROTATION
        assert full.fd is not None
        full.unmap()  # no page of the mapping may lie past the end of the file
        try:  # give back the reserved space the last block did not fit in
            os.ftruncate(full.fd, full.end)
            full.size = full.end
        except OSError as error:
            log.warning("cannot trim %s to %d bytes: %s", full.path, full.end, error.strerror)
        full.close()
        self.rotating = None
        self.synced(self.written_pos, seconds)  # nothing was written since the rotation
        self.hold = None
        self.write()

    @property
    def next_number(self) -> int:
        """The number the next spare segment gets."""
        return self._next_number

    def spare_ready(self, number: int, fd: int) -> None:
        """The keeper made the next spare: room for pushes again, and writes may go on."""
        assert number == self._next_number
        assert self.spare is None
        self._next_number += 1
        spare = Segment(number, self.data_dir.segment_path(number), self.segment_size)
        spare.fd = fd
        self._map(spare)
        self.spare = spare
        if self.hold is Hold.SPARE:
            self.hold = None
        if self.hold is not Hold.SPACE:
            self._set_disk_full(False, None)
        self.write()

    def spare_failed(self, error: OSError) -> None:
        """The keeper could not make the next spare: for lack of space, pushes wait until it
        can; any other error (EIO, a read-only file system) is the log failing."""
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            self._set_disk_full(True, error)
        else:
            self.fail(f"creating {self.data_dir.segment_path(self._next_number)} failed", error)

    def retry(self) -> None:
        """Try writing again after the disk was full."""
        if self.hold is Hold.SPACE:
            self.hold = None
            self.write()
            if self._held() is None and self.spare is not None:
                self._set_disk_full(False, None)

    def _held(self) -> Hold | None:
        """``hold``, read again after a call that may have changed it: compiled by mypyc, a
        read of ``self.hold`` right after the function set or tested it keeps the type mypy
        narrowed it to, and a call in between does not widen it."""
        return self.hold

    def _set_disk_full(self, full: bool, error: OSError | None) -> None:
        if full == self.disk_full:
            return
        self.disk_full = full
        if full:
            log.warning(
                "the log's disk is full (%s): pushes wait; pops go on while the reserved "
                "segment has room",
                error.strerror if error is not None else "no space",
            )
        else:
            log.warning("the log has disk space again: pushes resume")
        self.on_disk_full(full)

    # -- deletion -------------------------------------------------------------------------

    def _collect(self) -> None:
        """Delete the oldest segments while they hold no live packet (oldest first only: a
        younger segment's remove entries keep older pushes dead)."""
        segments = self.segments
        while len(segments) > 1:
            oldest = segments[0]
            if oldest.live or oldest is self.rotating:
                return
            if self.synced_pos < oldest.copies_at:
                self.wake()  # its copies must be on disk before it goes: fsync them now
                return
            assert oldest.live == 0, f"{oldest.path}: {oldest.live} live packets"
            if self.compactor is not None:
                self.compactor.forget(oldest)
            try:
                oldest.close()
                oldest.path.unlink()
            except OSError as error:
                self.fail(f"deleting {oldest.path} failed", error)
                return
            del segments[0]
            del self._firsts[0]
            self.used_bytes -= oldest.end
            self.segments_deleted += 1
            log.debug("deleted %s: no live packets left in it", oldest.path.name)
            if self.disk_full:
                self.wake()  # space freed: the keeper tries again at once

    def live_bytes(self) -> float:
        """An estimate of the bytes of live packet entries in the log."""
        return sum(segment.live_bytes() for segment in self.segments)

    # -- stop -----------------------------------------------------------------------------

    def close(self) -> None:
        """Write what is sealed, fsync, close every file and release the directory. For a
        server's graceful stop, after its last batch: blocking is fine then. Safe to call on
        a journal that never opened (a start that failed)."""
        if not self.segments:
            self.data_dir.close()
            return
        if self.hold is not Hold.FAILED:  # after a failure nothing more can be promised
            try:
                self._finish()
            except OSError as error:
                log.error("closing the log: %s", error)
        if self._pending:
            log.error(
                "stopping with %d bytes of log records unwritten (%s): their pops' replies were "
                "never sent, and those pushes were never confirmed",
                self.sealed_pos - self.written_pos,
                self.hold.value if self.hold else "unknown",
            )
        for segment in [*self.segments, *([self.spare] if self.spare else [])]:
            segment.close()
        if self.compactor is not None:
            self.compactor.close()
        self.data_dir.close()
        stats = self.stats()
        log.info(
            "log closed: %d blocks (%d bytes) written, %d fsyncs taking %.3f s, %d packets "
            "copied forward, %d segments deleted, %d segments left",
            stats.blocks_written,
            stats.bytes_written,
            stats.fsyncs,
            stats.fsync_seconds,
            stats.copied,
            stats.segments_deleted,
            stats.segments,
        )

    def _finish(self) -> None:
        """Write and fsync everything sealed, doing the keeper's work here (blocks may span
        several rotations); gives up on a full disk."""
        for _ in range(2 * len(self._pending) + 2):  # a rotation and a spare per block
            if self.hold is Hold.ROTATION:
                self._sync_now(self.rotating)
                self.rotated(0.0)
            elif self.hold is Hold.SPARE:
                number = self._next_number
                path = self.data_dir.segment_path(number)
                self.spare_ready(number, create_segment(path, self.segment_size))
            elif self.hold is Hold.SPACE:
                self.retry()
                if self._held() is Hold.SPACE:
                    break
            else:
                break
        if self.written_pos > self.synced_pos:
            self._sync_now(self.segments[-1])

    def _sync_now(self, segment: Segment | None) -> None:
        if segment is not None and segment.fd is not None:
            started = time.monotonic()
            os.fdatasync(segment.fd)
            self.synced(self.written_pos, time.monotonic() - started)

    def stats(self) -> JournalStats:
        """The figures an operator watches. O(segments)."""
        spare = self.spare.size if self.spare is not None else 0
        return JournalStats(
            policy=self.policy.value,
            recovering=self.recovering,
            recovery_seconds=self.recovery_seconds,
            segments=len(self.segments),
            disk_bytes=sum(max(s.size, s.end) for s in self.segments) + spare,
            log_bytes=self.used_bytes,
            live_packets=sum(segment.live for segment in self.segments),
            blocks_written=self.blocks_written,
            bytes_written=self.written_pos,
            fsyncs=self.fsyncs,
            fsync_seconds=self.fsync_seconds,
            last_fsync_seconds=self.last_fsync_seconds,
            copied=self.compactor.copied if self.compactor is not None else 0,
            segments_deleted=self.segments_deleted,
            disk_full=self.disk_full,
        )
