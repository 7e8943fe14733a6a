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
from typing import Any, Final, NamedTuple

__all__ = [
    "BLOCK_HEADER",
    "BLOCK_MAGIC",
    "BODY_HEADER",
    "COPY_HEADER",
    "COPY_HEADER_1",
    "PUSH_HEADER",
    "REMOVE",
    "Block",
    "Entry",
    "Kind",
    "LogFormatError",
    "decode_entries",
    "encode_block",
    "encode_copy",
    "encode_push",
    "encode_remove",
    "read_block",
    "zeros_from",
]


class Kind(enum.IntEnum):
    PUSH = 0x70  # "p"
    COPY = 0x63  # "c"
    REMOVE = 0x72  # "r"


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
_LENGTH = struct.Struct(">I")
_PUSH_SIZE: Final = PUSH_HEADER.size
_COPY_SIZE: Final = COPY_HEADER.size
_COPY_1_SIZE: Final = COPY_HEADER_1.size
_REMOVE_SIZE: Final = REMOVE.size


class LogFormatError(ValueError):
    """Bytes that are not a valid block or entry: the one error the codec raises."""


class Block(NamedTuple):
    """A block read back: where its entries are in the data it was read from."""

    start: int  # offset of its first entry
    end: int  # offset just past the block
    seq_base: int
    base_ms: int


#: A decoded entry, one plain tuple per kind (the replay loop reads millions of them):
#: ``(PUSH or COPY, seq, deadline_ms, prio, queue, key, payload, pushed_ms)`` or
#: ``(REMOVE, seq)``. A push's deadline is already made absolute (0 means never), and its
#: ``pushed_ms`` is its block's ``base_ms``; a copy's is its own (0: unknown).
Entry = tuple[Any, ...]

# The kinds as plain ints, for the loops that compare every entry's first byte.
_PUSH, _COPY, _REMOVE = int(Kind.PUSH), int(Kind.COPY), int(Kind.REMOVE)


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
) -> bytes:
    header = COPY_HEADER.pack(
        Kind.COPY, seq, deadline_ms, pushed_ms, prio, len(queue), len(key), len(payload)
    )
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
    """Whether every byte from ``offset`` on is zero, compared a megabyte at a time (the
    fastest way CPython has: a segment is megabytes of zeros until written)."""
    step = len(_ZEROS)
    for start in range(offset, len(data), step):
        chunk = data[start : start + step]
        if chunk != _ZEROS[: len(chunk)]:
            return False
    return True


def decode_entries(data: bytes, block: Block, *, old_copies: bool = False) -> list[Entry]:
    """The entries of a block of ``data``, in order, each as an ``Entry`` tuple (copies laid
    out as log format 1 wrote them with ``old_copies``). Raises ``LogFormatError`` at an entry
    that is cut short or of an unknown kind (only a writer bug or a newer format makes one: the
    block's checksum was right).

    One tight loop over the bytes, since recovery decodes every entry of the log. The fields
    are read byte by byte rather than with ``struct``: this module is compiled (mypyc), where
    indexing ``bytes`` and native integer arithmetic are C, while a ``struct`` call and the
    tuple it returns cost more than the rest of the entry (recovery of a million packets spent
    half its time here)."""
    entries: list[Entry] = []
    append = entries.append
    pos: int = block.start
    end: int = block.end
    seq: int = block.seq_base
    base_ms: int = block.base_ms
    while pos < end:
        kind = data[pos]
        if kind == _PUSH:
            if end - pos < _PUSH_SIZE:
                raise LogFormatError("a push entry cut short")
            ttl_ms = data[pos + 1] << 8 | data[pos + 2]
            prio = data[pos + 3]
            queue_len = data[pos + 4] << 8 | data[pos + 5]
            key_len = data[pos + 6] << 8 | data[pos + 7]
            payload_len = data[pos + 8] << 8 | data[pos + 9]
            pos += _PUSH_SIZE
            seq += 1
            number = seq
            deadline_ms = base_ms + ttl_ms if ttl_ms else 0
            pushed_ms = base_ms
        elif kind == _COPY:
            size = _COPY_1_SIZE if old_copies else _COPY_SIZE
            if end - pos < size:
                raise LogFormatError("a copy entry cut short")
            number = _u64(data, pos + 1)
            deadline_ms = _u64(data, pos + 9)
            lengths = pos + size - 6  # prio before them, pushed_ms before it (format 2)
            pushed_ms = 0 if old_copies else _u64(data, pos + 17)
            prio = data[lengths - 1]
            queue_len = data[lengths] << 8 | data[lengths + 1]
            key_len = data[lengths + 2] << 8 | data[lengths + 3]
            payload_len = data[lengths + 4] << 8 | data[lengths + 5]
            pos += size
        elif kind == _REMOVE:
            if end - pos < _REMOVE_SIZE:
                raise LogFormatError("a remove entry cut short")
            append((_REMOVE, _u64(data, pos + 1)))
            pos += _REMOVE_SIZE
            continue
        else:
            raise LogFormatError(f"unknown entry kind 0x{kind:02x}")
        key_at = pos + queue_len
        payload_at = key_at + key_len
        stop = payload_at + payload_len
        if stop > end:
            raise LogFormatError("a packet entry cut short")
        append(
            (
                kind,
                number,
                deadline_ms,
                prio,
                data[pos:key_at],
                data[key_at:payload_at],
                data[payload_at:stop],
                pushed_ms,
            )
        )
        pos = stop
    return entries


def _u64(data: bytes, at: int) -> int:
    """The big-endian u64 at ``at`` (the caller checked that its 8 bytes are there)."""
    return int.from_bytes(data[at : at + 8], "big")
