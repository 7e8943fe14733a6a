"""The pinpriq wire format: frames as values, bytes in and bytes out.

This module owns every byte layout of the protocol (docs/protocol.md) and nothing else. It does
no I/O and knows no clock, socket or event loop, so the server and every client share it, as h11
is shared by HTTP clients and servers. Integers are big-endian and unsigned.

Two decoders, because the two directions carry different streams:

* ``FrameDecoder`` reads what a client sends (push, pop, subscribe, unsubscribe, ready);
* ``ReplyDecoder`` reads what a server sends (pop replies and subscription deliveries, which
  look the same: ``u16 count`` then ``count`` packets).

Both accept bytes in any chunking and hold at most one incomplete frame plus the last chunk.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator, Sequence
from typing import Protocol, TypeAlias

import attrs

__all__ = [
    "MAX_FIELD",
    "MAX_FRAME",
    "MAX_REPLY_PACKETS",
    "READY",
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
_NAME_HEADER = struct.Struct(">H")  # queue_len of pop, subscribe, unsubscribe
_COUNT = struct.Struct(">H")  # a reply's packet count
_PACKET_HEADER = struct.Struct(">HH")  # key_len, payload_len
_PUSH_PREFIX = struct.Struct(">BHHBHH")  # opcode + push header, for encoding


class ProtocolError(ValueError):
    """The byte stream is not pinpriq: an unknown opcode.

    ``offset`` counts bytes from the start of the stream; ``byte`` is the offending value.
    After this error the decoder is unusable: the stream has no way to resynchronise.
    """

    def __init__(self, offset: int, byte: int) -> None:
        super().__init__(f"unknown opcode 0x{byte:02x} at stream offset {offset}")
        self.offset = offset
        self.byte = byte


@attrs.frozen
class Packet:
    """A key and a payload: what a pop reply or a delivery carries."""

    key: bytes
    payload: bytes


@attrs.frozen
class Push:
    queue: bytes
    key: bytes
    payload: bytes
    ttl_ms: int = 0
    prio: int = 1


@attrs.frozen
class Pop:
    queue: bytes


@attrs.frozen
class Subscribe:
    queue: bytes


@attrs.frozen
class Unsubscribe:
    queue: bytes


@attrs.frozen
class Ready:
    """One delivery credit for subscriptions: the single byte 0x41."""


READY = Ready()

ClientFrame: TypeAlias = Push | Pop | Subscribe | Unsubscribe | Ready

_NAMED_FRAMES: dict[int, type[Pop] | type[Subscribe] | type[Unsubscribe]] = {
    Opcode.POP: Pop,
    Opcode.SUBSCRIBE: Subscribe,
    Opcode.UNSUBSCRIBE: Unsubscribe,
}
_NAMED_OPCODES = {cls: bytes([op]) for op, cls in _NAMED_FRAMES.items()}
_READY_BYTE = bytes([Opcode.READY])


class KeyedPayload(Protocol):
    """Anything with a key and a payload: wire packets and the store's queued packets."""

    @property
    def key(self) -> bytes: ...

    @property
    def payload(self) -> bytes: ...


def _check_field(name: str, value: bytes) -> None:
    if len(value) > MAX_FIELD:
        raise ValueError(f"{name} is {len(value)} bytes; the most is {MAX_FIELD}")


def _check_int(name: str, value: int, most: int) -> None:
    if not 0 <= value <= most:
        raise ValueError(f"{name} must be in 0..{most}, not {value}")


def encode(frame: ClientFrame) -> bytes:
    """The bytes of one client frame. Raises ``ValueError`` naming a field that cannot fit."""
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
    if isinstance(frame, Ready):
        return _READY_BYTE
    _check_field("queue", frame.queue)
    return b"".join((_NAMED_OPCODES[type(frame)], _NAME_HEADER.pack(len(frame.queue)), frame.queue))


def encode_reply(packets: Sequence[KeyedPayload]) -> bytes:
    """The bytes of a pop reply or a delivery: ``u16 count`` then each packet."""
    if len(packets) > MAX_REPLY_PACKETS:
        raise ValueError(f"a reply holds at most {MAX_REPLY_PACKETS} packets, not {len(packets)}")
    parts = [_COUNT.pack(len(packets))]
    for packet in packets:
        parts.append(_PACKET_HEADER.pack(len(packet.key), len(packet.payload)))
        parts.append(packet.key)
        parts.append(packet.payload)
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


class FrameDecoder(_Buffer):
    """Turns the bytes a client sends into frames.

    ``feed(data)`` stores bytes; iterating yields every complete frame, in order, and stops
    when the next frame is incomplete. An unknown opcode raises ``ProtocolError`` when it is
    reached, after every frame before it has been yielded.
    """

    def __iter__(self) -> Iterator[ClientFrame]:
        while (frame := self.next_frame()) is not None:
            yield frame

    def next_frame(self) -> ClientFrame | None:
        """The next complete frame, or ``None`` if more bytes are needed."""
        data, pos = self._data, self._pos
        available = len(data) - pos
        if not available:
            return None
        opcode = data[pos]
        if opcode == Opcode.PUSH:
            if available < 1 + _PUSH_HEADER.size:
                return None
            queue_len, ttl_ms, prio, key_len, payload_len = _PUSH_HEADER.unpack_from(data, pos + 1)
            start = pos + 1 + _PUSH_HEADER.size
            key_end = start + key_len
            payload_end = key_end + payload_len
            end = payload_end + queue_len
            if end > len(data):
                return None
            self._pos = end
            return Push(
                bytes(data[payload_end:end]),
                bytes(data[start:key_end]),
                bytes(data[key_end:payload_end]),
                ttl_ms,
                prio,
            )
        if opcode == Opcode.READY:
            self._pos = pos + 1
            return READY
        frame_type = _NAMED_FRAMES.get(opcode)
        if frame_type is None:
            raise ProtocolError(self._consumed + pos, opcode)
        if available < 1 + _NAME_HEADER.size:
            return None
        (queue_len,) = _NAME_HEADER.unpack_from(data, pos + 1)
        start = pos + 1 + _NAME_HEADER.size
        end = start + queue_len
        if end > len(data):
            return None
        self._pos = end
        return frame_type(bytes(data[start:end]))


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
        self._packets: list[Packet] = []

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
            self._packets.append(Packet(bytes(data[start:key_end]), bytes(data[key_end:end])))
            self._pos = end
            self._remaining -= 1
        reply, self._packets, self._remaining = self._packets, [], -1
        return reply
