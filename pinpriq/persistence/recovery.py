"""Reading a data directory back: which packets are live, where the log is torn or damaged, and
what a start would do about it. Synchronous file reads only: no trio, no store.

``scan()`` reads every segment, oldest first, block by block, and replays the entries into a
table of live packets (``records.py`` says how). On the way it finds:

* **a torn tail**: a bad block in the newest segment with no valid block after it, which is
  what a crash in the middle of a write leaves. A start cuts the log there and logs how many
  bytes it dropped. (The last block of the newest segment, if damaged, cannot be told from a
  torn write, and is cut the same way.)
* **damage**: a bad block anywhere else, a bad segment header, a block whose sequence does
  not follow the one before, an older segment without blocks (only the newest may lack them),
  or a gap in the segments' numbers (only the oldest are ever deleted). A start refuses, naming
  the file and offset, unless the operator asks to truncate the log there
  (``--truncate-damaged-log``), dropping the rest of that segment and every later one: what
  follows damage may depend on what was lost, so only what precedes it is kept.

``apply()`` makes a scan's cuts in the files, for a start; ``report()`` describes a scan, for
``pinpriq-server --check-log``, which changes nothing.
"""

from __future__ import annotations

import bisect
import logging
import os
from pathlib import Path
from typing import NamedTuple

from pinpriq.persistence.records import (
    BLOCK_HEADER,
    BLOCK_MAGIC,
    REMOVE,
    Block,
    Entries,
    LogFormatError,
    Packet,
    decode_entries,
    read_block,
    zeros_from,
)
from pinpriq.persistence.segments import (
    SEGMENT_HEADER_SIZE,
    DataDir,
    DataDirError,
    Segment,
    check_segment_header,
    fsync_dir,
)

__all__ = ["Cut", "Scan", "apply", "report", "scan"]

log = logging.getLogger("pinpriq.persistence")

BLOCK_HEADER_SIZE = BLOCK_HEADER.size
#: Ages are kept to within this (ms), as the running store notes the time about once a second.
TIME_NOTE_MS = 1000


class Cut(NamedTuple):
    """Where the log stops being readable, and what cutting it there drops."""

    path: Path
    offset: int
    reason: str
    #: Bytes from ``offset`` to the last non-zero byte of that file.
    dropped: int
    #: Later segment files a cut here deletes (damage only; a torn tail has none).
    later: tuple[Path, ...] = ()
    later_bytes: int = 0

    def describe(self) -> str:
        text = f"{self.path} at offset {self.offset}: {self.reason}"
        if self.later:
            text += f" ({len(self.later)} later segment files, {self.later_bytes} bytes)"
        return text


class Scan:
    """What a data directory holds, as read by ``scan()``."""

    def __init__(self) -> None:
        #: Segments that hold blocks, oldest first, with ``first_seq``, ``end``, ``entries``
        #: and ``entry_bytes`` filled in, and ``live`` counted from ``packets``.
        self.segments: list[Segment] = []
        #: Segment files holding a header and nothing else (spares made ahead of need).
        self.spares: list[Segment] = []
        #: Leftovers of a segment whose creation was cut short: no valid header, all zeros.
        self.unfinished: list[Path] = []
        #: Live packets by seq, in seq order: ``(queue, key, payload, prio, seq)``, as
        #: ``QueueStore.load`` takes them.
        self.packets: dict[int, Packet] = {}
        #: Packets whose latest entry is a copy, and the segment (by number) holding it (the
        #: expired ones included, until their removal is logged).
        self.copied: dict[int, int] = {}
        #: Seqs of packets whose deadline had passed: dropped, to be logged as removed.
        self.expired: list[int] = []
        #: The deadlines (wall-clock ms) of the live packets that have one, by seq.
        self.deadlines: dict[int, int] = {}
        #: The due times (wall-clock ms) of packets pushed with a delay, by seq; once the scan
        #: is finished, only of those still delayed at ``now_ms`` (the others are due at once).
        self.dues: dict[int, int] = {}
        #: ``(seq, ms)``: by wall-clock time ``ms``, packets up to ``seq`` had been pushed,
        #: and the later ones were pushed at or after it; in seq order, about one a second of
        #: the log's history (from the blocks' ``base_ms`` and the copies' ``pushed_ms``), so
        #: recovered packets keep their ages (``QueueStore.load``'s ``times``).
        self.times: list[tuple[int, int]] = []
        #: The last seq any block used: pushes go on from the next one.
        self.last_seq = 0
        self.blocks = 0
        self.torn: Cut | None = None
        self.damage: Cut | None = None


def scan(data_dir: DataDir, *, now_ms: int) -> Scan:
    """Read a data directory. Packets whose deadline is at or before ``now_ms`` (wall-clock
    milliseconds) are dropped as expired. Stops at the first damage (``Scan.damage``)."""
    result = Scan()
    files = data_dir.segment_paths()
    last_with_blocks = max(
        (i for i, (_, path) in enumerate(files) if _has_blocks(path)),
        default=-1,
    )
    replay = _Replay(result)
    for index, (number, path) in enumerate(files):
        data = _read(path)
        if index and number != files[index - 1][0] + 1:
            reason = _missing(data_dir, files[index - 1][0], number)
            result.damage = _damage(path, 0, reason, data, files[index + 1 :])
            break
        if index > last_with_blocks:
            _file_spare(result, number, path, data, last=index == len(files) - 1)
            continue
        try:
            version = check_segment_header(data, path)
        except DataDirError as error:
            result.damage = _damage(path, 0, str(error), data, files[index + 1 :])
            break
        segment = Segment(number, path, len(data))
        segment.version = version
        offset = replay.segment(segment, data)
        result.segments.append(segment)
        if offset is None and segment.first_seq is None and index < last_with_blocks:
            # Only the newest segment can lack blocks (it was just rotated into): an older
            # one that has none lost them, and with them records later ones depend on.
            offset, reason = segment.end, "no blocks, though later segments have some"
        elif offset is None:
            continue
        else:
            reason = replay.failure
        if index == last_with_blocks and not _valid_block_after(data, offset):
            result.torn = Cut(path, offset, reason, _nonzero_extent(data, offset))
        else:
            result.damage = _damage(path, offset, reason, data, files[index + 1 :])
            break
    replay.finish(now_ms)
    return result


class _Replay:
    """Replays blocks into a ``Scan``, checking that each block's seq follows the last."""

    def __init__(self, result: Scan) -> None:
        self.result = result
        self.next_seq: int | None = None  # the seq_base the next block must have
        self.failure = ""
        self.unsorted = False
        self._noted_ms = -TIME_NOTE_MS  # the time of the last note kept from a block
        self._copy_noted_ms = -TIME_NOTE_MS  # ... from a copy

    def segment(self, segment: Segment, data: bytes) -> int | None:
        """Replay one segment's blocks; returns ``None`` if all were good, else the offset of
        the first bad one (``failure`` says why), having replayed those before it."""
        offset = SEGMENT_HEADER_SIZE
        while True:
            try:
                block = read_block(data, offset)
                if block is None:
                    segment.end = offset
                    return None
                if self.next_seq is not None and block.seq_base != self.next_seq:
                    raise LogFormatError(
                        f"block seq {block.seq_base} does not follow {self.next_seq}"
                    )
                entries = decode_entries(data, block, old_copies=segment.version == 1)
            except LogFormatError as error:
                segment.end = offset
                self.failure = str(error)
                return offset
            self._apply(segment, block, entries)
            offset = block.end

    def _apply(self, segment: Segment, block: Block, entries: Entries) -> None:
        seq_base, base_ms = block.seq_base, block.base_ms
        result = self.result
        packets, deadlines = result.packets, result.deadlines
        if segment.first_seq is None:
            segment.first_seq = seq_base + 1
        pushes = entries.pushes
        count = len(pushes)
        if count:
            if base_ms >= self._noted_ms + TIME_NOTE_MS:
                result.times.append((seq_base, base_ms))  # its pushes are at or after base_ms
                self._noted_ms = base_ms
            # Each push's seq is its place: file them all in one C-level update.
            packets.update(zip(range(seq_base + 1, seq_base + count + 1), pushes, strict=True))
            deadlines.update(entries.push_deadlines)
            if entries.push_dues:
                result.dues.update(entries.push_dues)
        if entries.copies:
            self._apply_copies(segment.number, entries)
        removed = entries.removed
        if removed:
            copied = result.copied
            dues = result.dues
            for seq in removed:
                packets.pop(seq, None)
                copied.pop(seq, None)
                deadlines.pop(seq, None)
                if dues:
                    dues.pop(seq, None)
        seq = seq_base + count
        segment.entries += count + len(entries.copies)
        segment.entry_bytes += block.end - block.start - len(removed) * REMOVE.size
        self.next_seq = seq
        result.last_seq = max(result.last_seq, seq)
        result.blocks += 1

    def _apply_copies(self, number: int, entries: Entries) -> None:
        """File a block's copy entries: the latest entry of a packet wins, queue included."""
        result = self.result
        packets, copied, deadlines = result.packets, result.copied, result.deadlines
        dues = result.dues
        for packet, deadline_ms, pushed_ms, due_ms in entries.copies_with_times():
            seq = packet[4]
            if seq not in packets:
                self.unsorted = True  # its first entry went with a deleted segment
            packets[seq] = packet
            copied[seq] = number
            if deadline_ms:
                deadlines[seq] = deadline_ms
            else:
                deadlines.pop(seq, None)
            if due_ms:
                dues[seq] = due_ms
            elif dues:
                dues.pop(seq, None)
            if pushed_ms and abs(pushed_ms - self._copy_noted_ms) >= TIME_NOTE_MS:
                result.times.append((seq - 1, pushed_ms))
                self._copy_noted_ms = pushed_ms

    def finish(self, now_ms: int) -> None:
        """Count the live packets per segment, then drop the expired ones (still counted: the
        journal logs their removal, which uncounts them) and put the rest in seq order."""
        result = self.result
        if self.unsorted:
            result.packets = dict(sorted(result.packets.items()))
        result.times.sort()
        packets = result.packets
        segments = result.segments
        # Each segment holds the pushes of a range of seqs: count the live seqs per range by
        # bisecting them (in order now), then move the copied packets to their copy's segment.
        seqs = list(packets)
        first_seqs = [s.first_seq or 0 for s in segments]
        bounds = [bisect.bisect_left(seqs, first) for first in first_seqs] + [len(seqs)]
        for index, segment in enumerate(segments):
            segment.live = bounds[index + 1] - bounds[index]
        by_number = {segment.number: segment for segment in segments}
        for seq, number in result.copied.items():
            pushed_in = bisect.bisect_right(first_seqs, seq) - 1
            if pushed_in >= 0:  # else its push went with a deleted segment: not counted
                segments[pushed_in].live -= 1
            by_number[number].live += 1
        deadlines, dues = result.deadlines, result.dues
        # TTL wins: a delayed packet whose deadline passed is dropped, due or not.
        result.expired = [seq for seq, deadline_ms in deadlines.items() if deadline_ms <= now_ms]
        for seq in result.expired:
            del packets[seq]
            del deadlines[seq]
            dues.pop(seq, None)
        # Due while the server was down: queued at once, in its place in push order.
        result.dues = {seq: due_ms for seq, due_ms in dues.items() if due_ms > now_ms}


def _file_spare(result: Scan, number: int, path: Path, data: bytes, *, last: bool) -> None:
    """A segment file without blocks: a spare if its header is good, the leftover of an
    interrupted creation if it is the newest file and all zeros; anything else is damage."""
    try:
        version = check_segment_header(data, path)
    except DataDirError as error:
        if last and zeros_from(data, 0):
            result.unfinished.append(path)
        else:
            result.damage = result.damage or Cut(path, 0, str(error), _nonzero_extent(data, 0))
        return
    if not zeros_from(data, SEGMENT_HEADER_SIZE):
        reason = "bytes after an empty first block"
        extent = _nonzero_extent(data, SEGMENT_HEADER_SIZE)
        result.damage = result.damage or Cut(path, SEGMENT_HEADER_SIZE, reason, extent)
        return
    spare = Segment(number, path, len(data))
    spare.version = version
    result.spares.append(spare)


def _damage(
    path: Path, offset: int, reason: str, data: bytes, later: list[tuple[int, Path]]
) -> Cut:
    return Cut(
        path,
        offset,
        reason,
        _nonzero_extent(data, offset),
        tuple(p for _, p in later),
        sum(_block_bytes(p) for _, p in later),
    )


def _missing(data_dir: DataDir, before: int, after: int) -> str:
    """Why a jump in the segments' numbers is damage: only the oldest segments are ever
    deleted, so a missing one in the middle took records the later ones depend on (removals
    of older pushes: without them, popped packets would come back)."""
    missing = data_dir.segment_path(before + 1).name
    if after > before + 2:
        missing += f" to {data_dir.segment_path(after - 1).name}"
    return f"segment {missing} is missing (only the oldest segments are ever deleted)"


def _block_bytes(path: Path) -> int:
    """Bytes of a segment file that hold anything (its header and blocks): none for a spare,
    whose reserved zeros hold nothing a cut would drop."""
    if not _has_blocks(path):
        return 0
    return _nonzero_extent(_read(path), 0)


def _valid_block_after(data: bytes, offset: int) -> bool:
    """Whether any valid block starts after ``offset``: if one does, the bad block is not a
    torn tail but damage in the middle of the log."""
    at = data.find(BLOCK_MAGIC, offset + 1)
    while at >= 0:
        try:
            if read_block(data, at) is not None:
                return True
        except LogFormatError:
            pass
        at = data.find(BLOCK_MAGIC, at + 1)
    return False


def _has_blocks(path: Path) -> bool:
    """Whether a segment file has anything where its first block goes (a spare has zeros)."""
    with open(path, "rb") as file:
        file.seek(SEGMENT_HEADER_SIZE)
        return any(file.read(BLOCK_HEADER_SIZE))


def _nonzero_extent(data: bytes, offset: int) -> int:
    """Bytes from ``offset`` to the last non-zero byte (zeros after it are unused space)."""
    return max(len(data.rstrip(b"\x00")) - offset, 0)


def _read(path: Path) -> bytes:
    """A whole file, read with one system call where possible (a buffered ``read()`` of
    megabytes is several times slower)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        parts = []
        while size > 0:
            part = os.read(fd, size)
            if not part:
                break
            parts.append(part)
            size -= len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)
    finally:
        os.close(fd)


def apply(data_dir: DataDir, result: Scan, *, truncate_damaged: bool) -> None:
    """Make a scan's cuts in the files, before a start: delete leftovers of interrupted
    segment creation, cut a torn tail (logged with the bytes dropped) and, only with
    ``truncate_damaged``, cut the log at damage, deleting every later segment (logged).
    Raises ``DataDirError`` naming the damage when not told to truncate."""
    for path in result.unfinished:
        log.warning("deleting %s: a segment file whose creation was cut short (all zeros)", path)
        path.unlink()
    if result.damage is not None:
        damage = result.damage
        if not truncate_damaged:
            raise DataDirError(
                f"damaged log: {damage.describe()}; a start would drop {damage.dropped} bytes "
                "there and everything after; run with --check-log for details, or with "
                "--truncate-damaged-log to cut the log there and start"
            )
        log.warning(
            "--truncate-damaged-log: cutting the log at %s: dropping %d bytes of that file and "
            "%d later segment files (%d bytes)",
            damage.describe(),
            damage.dropped,
            len(damage.later),
            damage.later_bytes,
        )
        _cut(damage.path, damage.offset)
        for path in damage.later:
            path.unlink()
        result.spares = [s for s in result.spares if s.path not in damage.later]
        if damage.offset < SEGMENT_HEADER_SIZE:
            damage.path.unlink()
            result.segments = [s for s in result.segments if s.path != damage.path]
    if result.torn is not None:
        torn = result.torn
        log.warning(
            "torn tail: cutting %s at offset %d, dropping %d bytes (%s): a write the server "
            "did not finish",
            torn.path,
            torn.offset,
            torn.dropped,
            torn.reason,
        )
        _cut(torn.path, torn.offset)
    _demote_emptied(result)
    if result.unfinished or result.damage is not None:
        fsync_dir(data_dir.path)


def _demote_emptied(result: Scan) -> None:
    """A segment a cut left without blocks (its first block torn or damaged) is the newest
    left: it is a spare now, which the journal writes into next, instead of a segment whose
    first seq no block gives."""
    emptied = [segment for segment in result.segments if segment.first_seq is None]
    if emptied:
        result.segments = [s for s in result.segments if s.first_seq is not None]
        result.spares = emptied + result.spares


def _cut(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.truncate(offset)
        os.fsync(file.fileno())


def report(data_dir: DataDir, result: Scan, refusal: str | None = None) -> tuple[list[str], bool]:
    """Lines describing what a start would recover from ``result``, and whether it would
    start (without ``--truncate-damaged-log``); ``refusal``: why a start would fail whatever
    the log holds (``DataDir.check_startable``)."""
    lines = [f"pinpriq log in {data_dir.path}"]
    for segment in result.segments:
        lines.append(
            f"  {segment.path.name}: {segment.end} bytes of blocks, "
            f"{segment.entries} packet entries, {segment.live} live packets"
        )
    for spare in result.spares:
        lines.append(f"  {spare.path.name}: unused (a spare segment)")
    for path in result.unfinished:
        lines.append(f"  {path.name}: an unfinished segment file; a start deletes it")
    queues = {packet[0] for packet in result.packets.values()}
    lines.append(
        f"{result.blocks} blocks; a start recovers {len(result.packets)} packets in "
        f"{len(queues)} queues, next seq {result.last_seq + 1}"
        + (f", and drops {len(result.expired)} expired packets" if result.expired else "")
    )
    if result.torn is not None:
        torn = result.torn
        lines.append(
            f"torn tail: {torn.path} at offset {torn.offset} ({torn.reason}); a start cuts it "
            f"there, dropping {torn.dropped} bytes"
        )
    if result.damage is not None:
        damage = result.damage
        lines.append(
            f"DAMAGED: {damage.describe()}. A start refuses. --truncate-damaged-log would cut "
            f"the log there, dropping {damage.dropped} bytes of {damage.path.name}"
            + (
                f" and {len(damage.later)} later segment files ({damage.later_bytes} bytes)"
                if damage.later
                else ""
            )
            + "; the counts above are what it would recover"
        )
        return lines, False
    if refusal is not None:
        lines.append(f"A start refuses: {refusal}")
        return lines, False
    lines.append("OK: a start recovers the packets above")
    return lines, True
