"""The pinpriq wire format: frames as values, bytes in and bytes out.

This module owns every byte layout of the protocol (docs/protocol.md) and nothing else. It does
no I/O and knows no clock, socket or event loop, so the server and every client share it, as h11
is shared by HTTP clients and servers. Integers are big-endian and unsigned.

Two decoders, because the two directions carry different streams:

* ``FrameDecoder`` reads what a client sends (push, pop, subscribe, unsubscribe, ready, sync,
  auth);
* ``ReplyDecoder`` reads what a server sends (pop replies and subscription deliveries, which
  look the same: ``u16 count`` then ``count`` packets).

Both accept bytes in any chunking and hold at most one incomplete frame plus the last chunk.
"""

from __future__ import annotations

import enum
import struct
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, TypeAlias, TypeVar

from pinpriq.errors import ArgumentError, PinpriqError

__all__ = [
    "DEFAULT_PORT",
    "FRAMES",
    "MAX_FIELD",
    "MAX_FRAME",
    "MAX_REPLY_PACKETS",
    "READY",
    "SYNC",
    "Auth",
    "ClientFrame",
    "FrameDecoder",
    "Opcode",
    "Packet",
    "Pop",
    "ProtocolError",
    "Push",
    "Ready",
    "ReplyDecoder",
    "Subscribe",
    "Sync",
    "Unsubscribe",
    "encode",
    "encode_reply",
]


class Opcode(enum.IntEnum):
    PUSH = 0x70
    POP = 0x50
    SUBSCRIBE = 0x73
    UNSUBSCRIBE = 0x75
    READY = 0x41
    SYNC = 0x21  # protocol 1.1
    AUTH = 0x61  # protocol 1.1


#: The TCP port a pinpriq server listens on, and a client connects to, unless told otherwise.
DEFAULT_PORT = 7000
#: Longest queue name, key or payload: the length fields are u16.
MAX_FIELD = 0xFFFF
#: Most packets in one reply: the count field is u16.
MAX_REPLY_PACKETS = 0xFFFF
#: Largest legal frame, a push with three maximal fields: 1+2+2+1+4+3*65535.
MAX_FRAME = 1 + 2 + 2 + 1 + 4 + 3 * MAX_FIELD
MAX_TTL_MS = 0xFFFF
MAX_PRIO = 0xFF

# Headers after the opcode byte.
_PUSH_HEADER = struct.Struct(">HHBHH")  # queue_len, ttl_ms, prio, key_len, payload_len
_NAME_HEADER = struct.Struct(">H")  # queue_len of pop, subscribe, unsubscribe; token_len of auth
_COUNT = struct.Struct(">H")  # a reply's packet count
_PACKET_HEADER = struct.Struct(">HH")  # key_len, payload_len
_PUSH_PREFIX = struct.Struct(">BHHBHH")  # opcode + push header, for encoding
_ONE_PACKET_HEADER = struct.Struct(">HHH")  # count 1, key_len, payload_len
_EMPTY_REPLY = b"\x00\x00"


class ProtocolError(PinpriqError, ValueError):
    """The byte stream is not pinpriq: an unknown opcode.

    ``offset`` counts bytes from the start of the stream; ``byte`` is the offending value.
    After this error the decoder is unusable: the stream has no way to resynchronise.
    """

    def __init__(self, offset: int, byte: int) -> None:
        super().__init__(f"unknown opcode 0x{byte:02x} at stream offset {offset}")
        self.offset = offset
        self.byte = byte


# Frames are named tuples: the decoder builds one per frame on the server's hot path, and
# ``tuple.__new__`` is the cheapest constructor a typed value has. Two frames of different kinds
# never compare equal, though their fields may (``Pop(b"q")`` and ``Subscribe(b"q")``).

_F = TypeVar("_F", bound=tuple[Any, ...])


def _distinct(cls: type[_F]) -> type[_F]:
    """Make frames of different classes unequal (plain tuple equality ignores the class)."""

    def __eq__(self: tuple[Any, ...], other: object) -> bool:
        return self.__class__ is other.__class__ and tuple.__eq__(self, other)

    def __ne__(self: tuple[Any, ...], other: object) -> bool:
        return not __eq__(self, other)

    cls.__eq__ = __eq__  # type: ignore[method-assign]
    cls.__ne__ = __ne__  # type: ignore[assignment,method-assign]
    cls.__hash__ = tuple.__hash__  # type: ignore[method-assign]
    return cls


class Packet(NamedTuple):
    """A key and a payload: what a pop reply or a delivery carries."""

    key: bytes
    payload: bytes


@_distinct
class Push(NamedTuple):
    queue: bytes
    key: bytes
    payload: bytes
    ttl_ms: int = 0
    prio: int = 1


@_distinct
class Pop(NamedTuple):
    queue: bytes


@_distinct
class Subscribe(NamedTuple):
    queue: bytes


@_distinct
class Unsubscribe(NamedTuple):
    queue: bytes


@_distinct
class Ready(NamedTuple):
    """One delivery credit for subscriptions: the single byte 0x41."""


@_distinct
class Sync(NamedTuple):
    """A barrier (protocol 1.1): answered ``00 00`` once every earlier frame is applied."""


@_distinct
class Auth(NamedTuple):
    """The connection's token (protocol 1.1, decision 12): first on a server that has one.

    Its ``repr`` hides the token, so that a log line or a traceback that shows the frame never
    shows the secret."""

    token: bytes

    def __repr__(self) -> str:
        return f"Auth(<{len(self.token)} bytes>)"


ClientFrame: TypeAlias = Push | Pop | Subscribe | Unsubscribe | Ready | Sync | Auth

#: Every client frame the protocol has, by opcode: the one table the decoder decodes by and the
#: broker dispatches by. A frame class missing here is neither decoded nor handled.
FRAMES: dict[int, type[ClientFrame]] = {
    Opcode.PUSH: Push,
    Opcode.POP: Pop,
    Opcode.SUBSCRIBE: Subscribe,
    Opcode.UNSUBSCRIBE: Unsubscribe,
    Opcode.READY: Ready,
    Opcode.SYNC: Sync,
    Opcode.AUTH: Auth,
}
_OPCODE_BYTE = {cls: bytes([op]) for op, cls in FRAMES.items()}

READY = Ready()
SYNC = Sync()

# The decoder's view of ``FRAMES``: for each possible first byte, the frame's layout, its class
# and, for one-byte frames, the frame itself (they carry nothing, so one instance serves every
# time). Tuples indexed by the byte: an index into a tuple is the cheapest lookup CPython has.
_UNKNOWN, _PUSH, _NAMED, _SINGLE = range(4)
#: The frames laid out as an opcode and one u16-length byte string have one of these fields.
_NAMED_FIELDS = (("queue",), ("token",))


def _layout(cls: type[ClientFrame] | None) -> int:
    """Not an opcode; the push; one u16-length byte string (a queue name, auth's token) after
    the opcode; the opcode alone."""
    if cls is None:
        return _UNKNOWN
    if cls is Push:
        return _PUSH
    if cls._fields in _NAMED_FIELDS:
        return _NAMED
    if not cls._fields:
        return _SINGLE
    raise AssertionError(f"no layout for {cls.__name__} frames")


_CLASSES: tuple[Any, ...] = tuple(FRAMES.get(byte) for byte in range(256))
_LAYOUTS = tuple(_layout(cls) for cls in _CLASSES)
_SINGLETONS: tuple[Any, ...] = tuple(
    cls() if layout == _SINGLE else None for cls, layout in zip(_CLASSES, _LAYOUTS, strict=True)
)


#: What a reply is encoded from: tuples whose first two items are a key and a payload, such as
#: ``Packet`` or the store's queued packets, read by index (the cheapest way to read a tuple).
KeyedPayload = tuple[Any, ...]


def _check_field(name: str, value: bytes) -> None:
    if len(value) > MAX_FIELD:
        raise ArgumentError(f"{name} is {len(value)} bytes; the most is {MAX_FIELD}")


def _check_int(name: str, value: int, most: int) -> None:
    if not 0 <= value <= most:
        raise ArgumentError(f"{name} must be in 0..{most}, not {value}")


def encode(frame: ClientFrame) -> bytes:
    """The bytes of one client frame. Raises ``ArgumentError`` (a ``ValueError``) naming a
    field that cannot fit."""
    if isinstance(frame, Push):
        _check_field("queue", frame.queue)
        _check_field("key", frame.key)
        _check_field("payload", frame.payload)
        _check_int("ttl_ms", frame.ttl_ms, MAX_TTL_MS)
        _check_int("prio", frame.prio, MAX_PRIO)
        header = _PUSH_PREFIX.pack(
            Opcode.PUSH,
            len(frame.queue),
            frame.ttl_ms,
            frame.prio,
            len(frame.key),
            len(frame.payload),
        )
        return b"".join((header, frame.key, frame.payload, frame.queue))
    opcode = _OPCODE_BYTE[frame.__class__]
    if not frame:  # a frame of one byte: ready, sync
        return opcode
    (field,) = frame
    _check_field(frame._fields[0], field)
    return b"".join((opcode, _NAME_HEADER.pack(len(field)), field))


def encode_reply(packets: Sequence[KeyedPayload]) -> bytes:
    """The bytes of a pop reply or a delivery: ``u16 count`` then each packet."""
    count = len(packets)
    if count == 1:  # the common reply: one packet of a unique key
        packet = packets[0]
        key: bytes = packet[0]
        payload: bytes = packet[1]
        return _ONE_PACKET_HEADER.pack(1, len(key), len(payload)) + key + payload
    if not count:
        return _EMPTY_REPLY
    if count > MAX_REPLY_PACKETS:
        raise ArgumentError(f"a reply holds at most {MAX_REPLY_PACKETS} packets, not {count}")
    parts = [_COUNT.pack(count)]
    for packet in packets:
        key, payload = packet[0], packet[1]
        parts.append(_PACKET_HEADER.pack(len(key), len(payload)))
        parts.append(key)
        parts.append(payload)
    return b"".join(parts)


class _Buffer:
    """Received bytes not yet decoded, with the stream offset of the first of them."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._pos = 0  # bytes of _data already decoded
        self._consumed = 0  # stream offset of _data[0]

    def feed(self, data: bytes) -> None:
        if self._pos:
            # Compact only when new bytes arrive, so a chunk holding many frames costs one copy.
            del self._data[: self._pos]
            self._consumed += self._pos
            self._pos = 0
        self._data += data

    @property
    def pending(self) -> int:
        """How many received bytes are not part of a decoded frame yet."""
        return len(self._data) - self._pos


_PUSH_HEAD = 1 + _PUSH_HEADER.size
_NAME_HEAD = 1 + _NAME_HEADER.size


class FrameDecoder:
    """Turns the bytes a client sends into frames.

    ``feed(data)`` stores bytes. ``decode()`` returns every complete frame received so far, in
    order (the server's way in: one call per received chunk); iterating, or ``next_frame()``,
    gives the same frames one at a time. An unknown opcode ends decoding: ``decode()`` returns
    the frames before it and sets ``error``; iteration raises that ``ProtocolError`` once it
    reaches it.

    Cost is linear in the bytes fed, whatever their chunking: bytes that cannot complete the next
    frame are only collected, and joined once enough have arrived, so the decoder holds at most
    one incomplete frame plus the chunks that will complete it.
    """

    def __init__(self) -> None:
        self._data = b""  # undecoded bytes, starting at a frame boundary
        self._parts: list[bytes] = []  # chunks received since, not yet joined to _data
        self._pending = 0  # len(_data) + the lengths of _parts
        self._need = 1  # bytes the next frame needs before decoding can progress
        self._offset = 0  # stream offset of _data[0]
        self._backlog: list[ClientFrame] = []  # decoded, not yet taken by next_frame()
        #: The unknown opcode that stopped decoding, once reached; the stream is unusable after.
        self.error: ProtocolError | None = None

    @property
    def pending(self) -> int:
        """How many received bytes are not part of a decoded frame yet."""
        return self._pending

    def feed(self, data: bytes) -> None:
        self._parts.append(data)
        self._pending += len(data)

    def discard(self) -> None:
        """Drop every byte not yet decoded, and decode nothing more: for a connection that is
        being closed, so that the memory of its incomplete frame is freed at once rather than
        when the decoder itself goes."""
        self._data = b""
        self._parts = []
        self._pending = 0
        self._need = sys.maxsize  # ``decode`` never has enough again

    def decode(self) -> list[ClientFrame]:
        """Every complete frame not yet returned; ``[]`` if none."""
        if self._pending < self._need or self.error is not None:
            return []
        parts = self._parts
        data = b"".join((self._data, *parts)) if self._data or len(parts) > 1 else parts[0]
        parts.clear()
        frames: list[ClientFrame] = []
        # Locals, looked up once per chunk rather than once per frame.
        append, unpack_push, new = frames.append, _PUSH_HEADER.unpack_from, tuple.__new__
        layouts, classes = _LAYOUTS, _CLASSES
        seen: dict[bytes, ClientFrame] = {}  # the named frames of this chunk, by their bytes
        pos, end, need = 0, len(data), 1
        while pos < end:
            opcode = data[pos]
            layout = layouts[opcode]
            if layout == _PUSH:
                if end - pos < _PUSH_HEAD:
                    need = _PUSH_HEAD
                    break
                queue_len, ttl_ms, prio, key_len, payload_len = unpack_push(data, pos + 1)
                key_at = pos + _PUSH_HEAD
                payload_at = key_at + key_len
                queue_at = payload_at + payload_len
                stop = queue_at + queue_len
                if stop > end:
                    need = stop - pos
                    break
                append(
                    new(
                        Push,
                        (
                            data[queue_at:stop],
                            data[key_at:payload_at],
                            data[payload_at:queue_at],
                            ttl_ms,
                            prio,
                        ),
                    )
                )
                pos = stop
            elif layout == _NAMED:
                if end - pos < _NAME_HEAD:
                    need = _NAME_HEAD
                    break
                stop = pos + _NAME_HEAD + ((data[pos + 1] << 8) | data[pos + 2])
                if stop > end:
                    need = stop - pos
                    break
                # A pipelining consumer sends the same pop many times in one chunk: one
                # frame object, immutable, serves them all (a named tuple is costly to build).
                raw = data[pos:stop]
                frame = seen.get(raw)
                if frame is None:
                    frame = seen[raw] = new(classes[opcode], (raw[_NAME_HEAD:],))
                append(frame)
                pos = stop
            elif layout == _SINGLE:
                append(_SINGLETONS[opcode])
                pos += 1
            else:
                self.error = ProtocolError(self._offset + pos, opcode)
                break
        self._offset += pos
        self._data = data[pos:] if pos else data
        self._pending = end - pos
        self._need = need
        return frames

    def next_frame(self) -> ClientFrame | None:
        """The next complete frame, or ``None`` if more bytes are needed.

        Raises ``ProtocolError`` on reaching an unknown opcode, after every frame before it.
        """
        if not self._backlog:
            self._backlog = self.decode()
            self._backlog.reverse()  # so that taking the next frame is a cheap pop()
            if not self._backlog:
                if self.error is not None:
                    raise self.error
                return None
        return self._backlog.pop()

    def __iter__(self) -> Iterator[ClientFrame]:
        while (frame := self.next_frame()) is not None:
            yield frame


class ReplyDecoder(_Buffer):
    """Turns the bytes a server sends into replies, each a list of packets.

    A pop reply and a subscription delivery share one format; which is which follows from the
    order of requests on the connection (decision 8), not from the bytes. Packets of a reply are
    decoded as they complete, so a long reply arriving in small chunks costs linear time and the
    buffer holds at most one incomplete packet.
    """

    def __init__(self) -> None:
        super().__init__()
        self._remaining = -1  # packets still to read in the current reply; -1 before its count
        self._count = 0  # packets in the current reply, once its count is read
        self._packets: list[Packet] = []

    @property
    def count_in_progress(self) -> int:
        """The packet count of a reply whose count has arrived but not all of its packets,
        after ``next_reply`` returned ``None``; 0 if no reply is under way."""
        return self._count if self._remaining > 0 else 0

    def __iter__(self) -> Iterator[list[Packet]]:
        while (reply := self.next_reply()) is not None:
            yield reply

    def next_reply(self) -> list[Packet] | None:
        """The next complete reply, or ``None`` if more bytes are needed."""
        data = self._data
        if self._remaining < 0:
            if len(data) - self._pos < _COUNT.size:
                return None
            (self._remaining,) = _COUNT.unpack_from(data, self._pos)
            self._count = self._remaining
            self._pos += _COUNT.size
        while self._remaining:
            pos = self._pos
            if len(data) - pos < _PACKET_HEADER.size:
                return None
            key_len, payload_len = _PACKET_HEADER.unpack_from(data, pos)
            start = pos + _PACKET_HEADER.size
            key_end = start + key_len
            end = key_end + payload_len
            if end > len(data):
                return None
            self._packets.append(
                tuple.__new__(Packet, (bytes(data[start:key_end]), bytes(data[key_end:end])))
            )
            self._pos = end
            self._remaining -= 1
        reply, self._packets, self._remaining = self._packets, [], -1
        return reply
