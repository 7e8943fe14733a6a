"""Two dialects: what a push, a pop and a barrier look like on the wire, and how replies are
counted. pinpriq frames come from ``pinpriq.wire.encode``; ``--redis`` sends the same workload
to a Redis server as ZADD / ZPOPMIN (a hand-written RESP encoder, as lean as the pinpriq side),
so both servers are driven by the same generator code.

Replies to throughput runs are *counted*, not decoded into packets: building a ``Packet`` per
reply costs the generator about 2 us, comparable to what the server spends per pop, and on a
small machine the generator shares cores with the server. ``count_pinpriq_replies`` walks the
reply layout (``u16 count``, then ``u16 key_len``, ``u16 payload_len``, bytes) without copying;
the tests check it against ``ReplyDecoder``.

Bytes in, counts out: this module knows nothing of sockets, processes or timing.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs

from pinpriq.bench.workload import BenchError, Workload
from pinpriq.wire import Packet, Pop, Push, encode, encode_reply

#: Queue popped as a barrier: always empty, so its reply is ``00 00``.
BARRIER_QUEUE = b"pinpriq-bench-barrier"

_U16 = struct.Struct(">H")
_U16_PAIR = struct.Struct(">HH")


class Dialect(Protocol):
    #: Sent after pushes when a reply must mark that the server applied them; None when every
    #: request is answered anyway.
    barrier: bytes | None

    def push(self, w: Workload, queue: bytes, index: int, prio: int) -> bytes: ...

    def pop(self, queue: bytes) -> bytes: ...

    def replies(self, w: Workload) -> Replies: ...


def count_pinpriq_replies(buf: bytearray, pos: int = 0) -> tuple[int, int, int, int]:
    """Walk the complete pop replies in ``buf`` from ``pos`` without building packets.

    Returns ``(end of the last complete reply, replies, packets, empty replies)``.
    """
    end = len(buf)
    replies = packets = empty = 0
    while pos + 2 <= end:
        (count,) = _U16.unpack_from(buf, pos)
        p = pos + 2
        for _ in range(count):
            if p + 4 > end:
                return pos, replies, packets, empty
            key_len, payload_len = _U16_PAIR.unpack_from(buf, p)
            p += 4 + key_len + payload_len
        if p > end:
            break
        pos = p
        replies += 1
        packets += count
        empty += not count
    return pos, replies, packets, empty


@attrs.frozen
class ReplyShape:
    """A run of replies the workload expects most of the time (a pop finding one packet of the
    workload's sizes; for Redis also a ZADD's ``:1``, or a ZADD and a ZPOPMIN in turn): its
    length, the replies and packets it holds, and the bytes every instance shares (lengths,
    framing) as ``(offset, value)`` pairs.

    ``count`` recognises a buffer of such runs with a few strided slices in C instead of a
    Python loop per reply: if the shared bytes sit at every multiple of the length, each run
    has that length, so the next one starts there. Anything else (empty or grouped pops,
    errors) goes to the general parser.
    """

    size: int
    fixed: tuple[tuple[int, int], ...]
    replies: int = 1
    packets: int = 1

    @classmethod
    def of(
        cls, template: bytes, variable: Iterable[range] = (), replies: int = 1, packets: int = 1
    ) -> ReplyShape:
        free = {i for span in variable for i in span}
        fixed = tuple((i, b) for i, b in enumerate(template) if i not in free)
        return cls(len(template), fixed, replies, packets)

    def count(self, buf: bytearray) -> int:
        """How many runs of this shape ``buf`` holds before its incomplete tail, if it holds
        nothing else; 0 otherwise."""
        size = self.size
        whole = len(buf) // size
        stop = whole * size
        for offset, value in self.fixed:
            if buf[offset:stop:size].count(value) != whole:
                return 0
        return whole


class Replies:
    """Counts the replies in a byte stream: ``feed`` returns (replies, packets, empty pops)."""

    def __init__(self, shapes: Sequence[ReplyShape] = ()) -> None:
        self._buf = bytearray()
        self._shapes = shapes

    def feed(self, data: bytes) -> tuple[int, int, int]:
        buf = self._buf
        buf += data
        replies = packets = 0
        for shape in self._shapes:
            runs = shape.count(buf)
            if runs:
                del buf[: runs * shape.size]
                replies, packets = runs * shape.replies, runs * shape.packets
                break
        used, more_replies, more_packets, empty = self.walk(buf)
        del buf[:used]
        return replies + more_replies, packets + more_packets, empty

    def walk(self, buf: bytearray) -> tuple[int, int, int, int]:
        """The general parser: (bytes used, replies, packets, empty pops)."""
        raise NotImplementedError


class PinpriqReplies(Replies):
    def walk(self, buf: bytearray) -> tuple[int, int, int, int]:
        return count_pinpriq_replies(buf)


class PinpriqDialect:
    barrier: bytes | None = encode(Pop(BARRIER_QUEUE))

    def push(self, w: Workload, queue: bytes, index: int, prio: int) -> bytes:
        return encode(Push(queue, w.key(index), w.payload(index), w.ttl_ms, prio))

    def pop(self, queue: bytes) -> bytes:
        return encode(Pop(queue))

    def replies(self, w: Workload) -> Replies:
        template = encode_reply([Packet(bytes(w.key_size), bytes(w.payload_size))])
        return PinpriqReplies([ReplyShape.of(template, [range(6, len(template))])])


def resp_command(*args: bytes) -> bytes:
    """One Redis command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


#: Added to every score so that all scores have 13 digits, and ZPOPMIN replies one length.
_SCORE_BASE = 2**40
_SCORE_DIGITS = 13


def redis_score(prio: int, index: int) -> bytes:
    """ZPOPMIN takes the lowest score: priority first, then the newest (highest index)."""
    return b"%d" % (_SCORE_BASE + prio * 2**32 - (index % 2**32))


class RedisReplies(Replies):
    """Counts RESP2 replies: integers and statuses (ZADD), arrays of bulk strings (ZPOPMIN,
    two elements per packet). An error reply raises ``BenchError``."""

    def walk(self, buf: bytearray) -> tuple[int, int, int, int]:
        pos = replies = packets = empty = 0
        while (step := self._one(buf, pos)) is not None:
            pos, elements = step
            replies += 1
            if elements >= 0:
                packets += elements // 2
                empty += not elements
        return pos, replies, packets, empty

    @staticmethod
    def _one(buf: bytearray, pos: int) -> tuple[int, int] | None:
        """The end of the reply at ``pos`` and its array length (-1 if not an array)."""
        line_end = buf.find(b"\r\n", pos)
        if line_end < 0:
            return None
        kind = buf[pos]
        if kind == 0x2A:  # '*' array
            count = int(buf[pos + 1 : line_end])
            p = line_end + 2
            for _ in range(max(count, 0)):
                end = _resp_item_end(buf, p)
                if end is None:
                    return None
                p = end
            return p, max(count, 0)
        end = _resp_item_end(buf, pos)
        return None if end is None else (end, -1)


def _resp_item_end(buf: bytearray, pos: int) -> int | None:
    """The end of one non-array RESP value at ``pos``, None if incomplete."""
    line_end = buf.find(b"\r\n", pos)
    if line_end < 0:
        return None
    kind = buf[pos]
    if kind == 0x24:  # '$' bulk string
        length = int(buf[pos + 1 : line_end])
        end = line_end + 2 + (length + 2 if length >= 0 else 0)
        return end if end <= len(buf) else None
    if kind in b":+":
        return line_end + 2
    text = bytes(buf[pos:line_end]).decode("utf-8", "replace")
    raise BenchError(f"redis replied {text}")


class RedisDialect:
    barrier: bytes | None = None

    def push(self, w: Workload, queue: bytes, index: int, prio: int) -> bytes:
        member = w.key(index) + w.payload(index)
        return resp_command(b"ZADD", queue, redis_score(prio, index), member)

    def pop(self, queue: bytes) -> bytes:
        return resp_command(b"ZPOPMIN", queue)

    def replies(self, w: Workload) -> Replies:
        member_size = w.key_size + w.payload_size
        popped = resp_command(bytes(member_size), b"0" * _SCORE_DIGITS)
        member_at = popped.index(b"\r\n", 4) + 2
        score_at = len(popped) - 2 - _SCORE_DIGITS
        variable = [range(member_at, member_at + member_size), range(score_at, len(popped) - 2)]
        added = b":1\r\n"  # members are unique: every ZADD adds one
        shifted = [range(r.start + len(added), r.stop + len(added)) for r in variable]
        shapes = [
            ReplyShape.of(popped, variable),
            ReplyShape.of(added, packets=0),
            ReplyShape.of(added + popped, shifted, replies=2),  # mix
        ]
        return RedisReplies(shapes)


def dialect_of(w: Workload) -> Dialect:
    return RedisDialect() if w.redis else PinpriqDialect()
