"""The log's bytes: blocks of entries, each block with a checksum. Pure: no files, no clock.

The log is a sequence of **blocks**; a block holds the entries one batch of frames produced
(group commit: a block is written with one write, and fsynced as one). A block is the unit a
checksum covers, so "a bad record" below means a block whose checksum or layout is wrong.
Integers are big-endian and unsigned, as on the wire.

Block::

    u32 magic "PQLB" · u32 body length · u32 CRC-32 of (the body length's 4 bytes + body) · body
    body = u64 seq_base · u64 base_ms · entries

``seq_base`` is the store's push counter before the block's first push: the push entries of
the block are packets ``seq_base + 1``, ``seq_base + 2``, ... in order (every push the store
accepts is logged, in order, so a push needs no sequence number of its own). ``base_ms`` is the
wall-clock time (ms since the Unix epoch) at or before the block's first push; a push's TTL
counts from it, so a logged deadline is never later than the packet's real one.

Entries, each starting with its kind byte:

* push ``70`` · u16 ttl_ms · u8 prio · u16 queue_len · u16 key_len · u16 payload_len · queue ·
  key · payload. TTL 0: never expires.
* copy ``63`` · u64 seq · u64 deadline_ms (0: never) · u64 pushed_ms (0: unknown) · u8 prio ·
  u16 queue_len · u16 key_len · u16 payload_len · queue · key · payload: a live packet written
  again, whole, by compaction (its old segment can then go), or by a move to another queue (a
  dead-letter move: seq, and so its place in push order, prio and deadline kept), written
  with the queue it is in now. ``pushed_ms`` is the wall-clock time at or before its push, so
  a packet keeps its age once the block it was pushed in is gone. Format 1 (read, never
  written) had no ``pushed_ms``: ``decode_entries(..., old_copies=True)``.
* remove ``72`` · u64 seq: the packet left for good (pop, delivery, expiry, purge, ack).

Protocol 1.2 (decisions 21-22) added three kinds to format 2 (before any release wrote it):

* push with options ``71`` · u32 ttl_ms · u32 delay_ms · u8 prio · u16 queue_len · u16
  key_len · u16 payload_len · queue · key · payload: a push (the block's next seq) whose TTL
  does not fit a u16 or which is delayed. Its due time is ``base_ms + delay_ms`` (delay 0: not
  delayed) and its deadline its due time (or ``base_ms``) plus its TTL (0: never).
* moved ``6d`` · u64 deadline_ms (0: never) · u8 prio · u16 queue_len · u16 key_len · u16
  payload_len · queue · key · payload: a push (the block's next seq) made by a move (decision
  22), which files a packet anew, as a push made now, keeping its TTL deadline; the block
  removes its old seq too.
* delayed copy ``64`` · u64 seq · u64 due_ms · u64 deadline_ms · u64 pushed_ms · u8 prio · u16
  queue_len · u16 key_len · u16 payload_len · queue · key · payload: a copy of a packet pushed
  with a delay (compaction's): held until ``due_ms`` if that is still to come.

Replaying entries in log order rebuilds the live packets: a push or copy files the packet
under its seq (the latest entry wins), a remove forgets it. Within a block the writer puts
pushes and copies before removes; that order gives the same result as the order of the
frames, since an entry names its packet by seq alone.

What this module must not know: files, segments, the store.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Iterator
from typing import Final, NamedTuple

__all__ = [
    "BLOCK_HEADER",
    "BLOCK_MAGIC",
    "BODY_HEADER",
    "COPY_HEADER",
    "COPY_HEADER_1",
    "DELAYED_COPY_HEADER",
    "MOVED_HEADER",
    "OPTIONS_HEADER",
    "PUSH_HEADER",
    "REMOVE",
    "Block",
    "Entries",
    "Kind",
    "LogFormatError",
    "Packet",
    "decode_entries",
    "encode_block",
    "encode_copy",
    "encode_moved",
    "encode_options",
    "encode_push",
    "encode_remove",
    "read_block",
    "zeros_from",
]


class Kind(enum.IntEnum):
    PUSH = 0x70  # "p"
    COPY = 0x63  # "c"
    REMOVE = 0x72  # "r"
    PUSH_OPTIONS = 0x71  # "q", as the wire's push with options
    MOVED = 0x6D  # "m"
    DELAYED_COPY = 0x64  # "d"


#: The first four bytes of every block: lets a reader tell a block from zeros or garbage, and
#: look for a later block after a damaged one.
BLOCK_MAGIC: Final = b"PQLB"
BLOCK_HEADER = struct.Struct(">4sII")  # magic, body length, CRC-32
BODY_HEADER = struct.Struct(">QQ")  # seq_base, base_ms
PUSH_HEADER = struct.Struct(">BHBHHH")  # kind, ttl_ms, prio, queue_len, key_len, payload_len
#: kind, seq, deadline_ms, pushed_ms, prio, queue/key/payload lens
COPY_HEADER = struct.Struct(">BQQQBHHH")
#: The copy entry of log format 1: no pushed_ms.
COPY_HEADER_1 = struct.Struct(">BQQBHHH")
REMOVE = struct.Struct(">BQ")  # kind, seq
#: kind, ttl_ms, delay_ms, prio, queue/key/payload lens
OPTIONS_HEADER = struct.Struct(">BIIBHHH")
MOVED_HEADER = struct.Struct(">BQBHHH")  # kind, deadline_ms, prio, queue/key/payload lens
#: kind, seq, due_ms, deadline_ms, pushed_ms, prio, queue/key/payload lens
DELAYED_COPY_HEADER = struct.Struct(">BQQQQBHHH")
_LENGTH = struct.Struct(">I")
_PUSH_SIZE: Final = PUSH_HEADER.size
_COPY_SIZE: Final = COPY_HEADER.size
_COPY_1_SIZE: Final = COPY_HEADER_1.size
_REMOVE_SIZE: Final = REMOVE.size
_OPTIONS_SIZE: Final = OPTIONS_HEADER.size
_MOVED_SIZE: Final = MOVED_HEADER.size
_DELAYED_COPY_SIZE: Final = DELAYED_COPY_HEADER.size


class LogFormatError(ValueError):
    """Bytes that are not a valid block or entry: the one error the codec raises."""


class Block(NamedTuple):
    """A block read back: where its entries are in the data it was read from."""

    start: int  # offset of its first entry
    end: int  # offset just past the block
    seq_base: int
    base_ms: int


#: A push or copy entry's packet, as recovery files it: ``(queue, key, payload, prio, seq)``,
#: the order ``QueueStore.load`` takes (recovery hands these tuples to it as they are: one
#: object per packet, made once, since there are millions).
Packet = tuple[bytes, bytes, bytes, int, int]


class Entries:
    """The entries of one block, by kind, each in log order. The writer puts a block's pushes
    first, then its copies, then its removes, so replaying them in that order (pushes,
    copies, removes) is replaying the block; an entry names its packet by seq alone."""

    def __init__(self) -> None:
        #: Push entries (with options and moved ones too): packets ``seq_base + 1``,
        #: ``seq_base + 2``, ..., in order.
        self.pushes: list[Packet] = []
        #: ``(seq, deadline_ms)`` of the pushes with a TTL (a push's deadline is its block's
        #: ``base_ms``, or its due time, plus its TTL; its push time is ``base_ms``).
        self.push_deadlines: list[tuple[int, int]] = []
        #: ``(seq, due_ms)`` of the pushes with a delay.
        self.push_dues: list[tuple[int, int]] = []
        #: Copy entries (delayed ones too), and beside each its deadline (0: none), push time
        #: (0: unknown) and due time (0: not delayed).
        self.copies: list[Packet] = []
        self.copy_deadlines: list[int] = []
        self.copy_times: list[int] = []
        self.copy_dues: list[int] = []
        #: Seqs of the remove entries.
        self.removed: list[int] = []

    def copies_with_times(self) -> Iterator[tuple[Packet, int, int, int]]:
        """Each copy entry with its deadline, push time and due time, in log order."""
        return zip(self.copies, self.copy_deadlines, self.copy_times, self.copy_dues, strict=True)


# The kinds as plain ints, for the loops that compare every entry's first byte: each ``Final``
# on its own line, which mypyc keeps in a C variable (a tuple assignment left them names to
# look up in the module's dict, three lookups per entry).
_PUSH: Final = int(Kind.PUSH)
_COPY: Final = int(Kind.COPY)
_REMOVE: Final = int(Kind.REMOVE)
_OPTIONS: Final = int(Kind.PUSH_OPTIONS)
_MOVED: Final = int(Kind.MOVED)
_DELAYED_COPY: Final = int(Kind.DELAYED_COPY)


def encode_push(queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> bytes:
    """A push entry (the store appends the same bytes piece by piece on its hot path)."""
    header = PUSH_HEADER.pack(Kind.PUSH, ttl_ms, prio, len(queue), len(key), len(payload))
    return b"".join((header, queue, key, payload))


def encode_copy(
    seq: int,
    deadline_ms: int,
    pushed_ms: int,
    prio: int,
    queue: bytes,
    key: bytes,
    payload: bytes,
    due_ms: int = 0,
) -> bytes:
    """A copy entry; a delayed copy if ``due_ms`` (wall-clock) is not 0."""
    if due_ms:
        header = DELAYED_COPY_HEADER.pack(
            Kind.DELAYED_COPY,
            seq,
            due_ms,
            deadline_ms,
            pushed_ms,
            prio,
            len(queue),
            len(key),
            len(payload),
        )
    else:
        header = COPY_HEADER.pack(
            Kind.COPY, seq, deadline_ms, pushed_ms, prio, len(queue), len(key), len(payload)
        )
    return b"".join((header, queue, key, payload))


def encode_options(
    queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int, delay_ms: int
) -> bytes:
    """A push-with-options entry: a delayed push, or one whose TTL does not fit a u16."""
    header = OPTIONS_HEADER.pack(
        Kind.PUSH_OPTIONS, ttl_ms, delay_ms, prio, len(queue), len(key), len(payload)
    )
    return b"".join((header, queue, key, payload))


def encode_moved(queue: bytes, key: bytes, payload: bytes, deadline_ms: int, prio: int) -> bytes:
    """A moved entry: a push made by a move, with its wall-clock TTL deadline (0: none)."""
    header = MOVED_HEADER.pack(Kind.MOVED, deadline_ms, prio, len(queue), len(key), len(payload))
    return b"".join((header, queue, key, payload))


def encode_remove(seq: int) -> bytes:
    return REMOVE.pack(Kind.REMOVE, seq)


def encode_block(seq_base: int, base_ms: int, *sections: bytes | bytearray) -> bytes:
    """A whole block around entries already encoded (given as one or more sections, joined
    in order)."""
    body = b"".join((BODY_HEADER.pack(seq_base, base_ms), *sections))
    length = _LENGTH.pack(len(body))
    crc = zlib.crc32(body, zlib.crc32(length))
    return b"".join((BLOCK_MAGIC, length, _LENGTH.pack(crc), body))


def read_block(data: bytes, offset: int) -> Block | None:
    """The block starting at ``offset``; ``None`` if the data ends there or holds only zero
    bytes from there on (a preallocated segment's unused tail). Raises ``LogFormatError`` if the
    bytes there are anything else: cut short, damaged, or not a block.

    The checksum covers the length and the body; entries are checked by ``iter_entries``.
    """
    end = len(data)
    if not data.startswith(BLOCK_MAGIC, offset):
        if zeros_from(data, offset):
            return None
        raise LogFormatError("no block starts here (bad magic)")
    if end - offset < BLOCK_HEADER.size:
        raise LogFormatError(f"{end - offset} bytes, too few for a block header")
    _, length, crc = BLOCK_HEADER.unpack_from(data, offset)
    if length < BODY_HEADER.size:
        raise LogFormatError(f"a block body of {length} bytes is impossible")
    start = offset + BLOCK_HEADER.size
    stop = start + length
    if stop > end:
        raise LogFormatError(f"a block of {length} bytes cut short at {end - start}")
    if zlib.crc32(memoryview(data)[start:stop], zlib.crc32(data[offset + 4 : offset + 8])) != crc:
        raise LogFormatError("checksum mismatch")
    seq_base, base_ms = BODY_HEADER.unpack_from(data, start)
    return Block(start + BODY_HEADER.size, stop, seq_base, base_ms)


_ZEROS = bytes(1 << 20)


def zeros_from(data: bytes, offset: int) -> bool:
    """Whether every byte from ``offset`` on is zero, compared a megabyte at a time with
    ``startswith``, which compares in place (a slice would copy each megabyte first: a
    preallocated segment is megabytes of zeros until written, and recovery checks the unused
    rest of each segment)."""
    step = len(_ZEROS)
    for start in range(offset, len(data), step):
        size = min(step, len(data) - start)
        if not data.startswith(_ZEROS if size == step else _ZEROS[:size], start):
            return False
    return True


def decode_entries(data: bytes, block: Block, *, old_copies: bool = False) -> Entries:
    """The entries of a block of ``data``, by kind (copies laid out as log format 1 wrote them
    with ``old_copies``). Raises ``LogFormatError`` at an entry that is cut short or of an
    unknown kind (only a writer bug or a newer format makes one: the block's checksum was
    right).

    One tight loop over the bytes, since recovery decodes every entry of the log. The fields
    are read byte by byte rather than with ``struct``: this module is compiled (mypyc), where
    indexing ``bytes`` and native integer arithmetic are C, while a ``struct`` call and the
    tuple it returns cost more than the rest of the entry. Each packet becomes one tuple, in
    the order the store loads it, and nothing else per packet unless it has a TTL or is a
    copy (recovery of a million packets spent most of its time making, reordering and
    freeing objects per packet)."""
    entries = Entries()
    pushes, copies, removed = entries.pushes, entries.copies, entries.removed
    pos: int = block.start
    end: int = block.end
    seq: int = block.seq_base
    base_ms: int = block.base_ms
    copy_size = _COPY_1_SIZE if old_copies else _COPY_SIZE
    while pos < end:
        kind = data[pos]
        if kind == _REMOVE:
            if end - pos < _REMOVE_SIZE:
                raise LogFormatError("a remove entry cut short")
            removed.append(_u64(data, pos + 1))
            pos += _REMOVE_SIZE
            continue
        if kind == _PUSH:
            size = _PUSH_SIZE
        elif kind == _COPY:
            size = copy_size
        elif kind == _OPTIONS:
            size = _OPTIONS_SIZE
        elif kind == _MOVED:
            size = _MOVED_SIZE
        elif kind == _DELAYED_COPY and not old_copies:
            size = _DELAYED_COPY_SIZE
        else:
            raise LogFormatError(f"unknown entry kind 0x{kind:02x}")
        if end - pos < size:
            raise LogFormatError(f"a {Kind(kind).name.lower()} entry cut short")
        lengths = pos + size - 6  # every header ends with prio and the three lengths
        prio = data[lengths - 1]
        key_at = pos + size + (data[lengths] << 8 | data[lengths + 1])
        payload_at = key_at + (data[lengths + 2] << 8 | data[lengths + 3])
        stop = payload_at + (data[lengths + 4] << 8 | data[lengths + 5])
        if stop > end:
            raise LogFormatError("a packet entry cut short")
        queue = data[pos + size : key_at]
        if kind in (_PUSH, _OPTIONS, _MOVED):
            seq += 1
            pushes.append((queue, data[key_at:payload_at], data[payload_at:stop], prio, seq))
            if kind == _PUSH:
                ttl_ms = data[pos + 1] << 8 | data[pos + 2]
                if ttl_ms:
                    entries.push_deadlines.append((seq, base_ms + ttl_ms))
            elif kind == _OPTIONS:
                _options(entries, seq, base_ms, _u32(data, pos + 1), _u32(data, pos + 5))
            else:
                deadline_ms = _u64(data, pos + 1)
                if deadline_ms:
                    entries.push_deadlines.append((seq, deadline_ms))
        else:
            copied = _u64(data, pos + 1)
            copies.append((queue, data[key_at:payload_at], data[payload_at:stop], prio, copied))
            delayed = kind == _DELAYED_COPY
            fields = pos + 17 if delayed else pos + 9  # deadline_ms, then pushed_ms
            entries.copy_dues.append(_u64(data, pos + 9) if delayed else 0)
            entries.copy_deadlines.append(_u64(data, fields))
            entries.copy_times.append(0 if old_copies else _u64(data, fields + 8))
        pos = stop
    return entries


def _options(entries: Entries, seq: int, base_ms: int, ttl_ms: int, delay_ms: int) -> None:
    """File a push-with-options entry's due time and deadline, both counted from ``base_ms``."""
    start = base_ms
    if delay_ms:
        start += delay_ms
        entries.push_dues.append((seq, start))
    if ttl_ms:
        entries.push_deadlines.append((seq, start + ttl_ms))


def _u32(data: bytes, at: int) -> int:
    """The big-endian u32 at ``at`` (the caller checked that its 4 bytes are there)."""
    return data[at] << 24 | data[at + 1] << 16 | data[at + 2] << 8 | data[at + 3]


def _u64(data: bytes, at: int) -> int:
    """The big-endian u64 at ``at`` (the caller checked that its 8 bytes are there)."""
    return int.from_bytes(data[at : at + 8], "big")
