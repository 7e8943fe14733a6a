"""The pinpriq wire format: frames as values, bytes in and bytes out.

This module owns every byte layout of the protocol (docs/protocol.md) and nothing else. It does
no I/O and knows no clock, socket or event loop, so the server and every client share it, as h11
is shared by HTTP clients and servers. Integers are big-endian and unsigned.

Two decoders, because the two directions carry different streams:

* ``FrameDecoder`` reads what a client sends (push, pop, subscribe, unsubscribe, ready, sync,
  auth, the lease frames: reserve, ack, release, touch, leased subscribe; and 1.2's push with
  options);
* ``ReplyDecoder`` reads what a server sends (pop replies and subscription deliveries, which
  look the same: ``u16 count`` then ``count`` packets; and, through ``next_lease_reply``, the
  11-byte-header messages of leases: ``u64 lease id``, ``u8 attempt or status``, ``u16 count``).

Both accept bytes in any chunking and hold at most one incomplete frame plus the last chunk.
"""

from __future__ import annotations

import enum
import struct
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Final, NamedTuple, TypeAlias, TypeVar

from pinpriq import _build
from pinpriq.errors import ArgumentError, PinpriqError

__all__ = [
    "DEFAULT_PORT",
    "FRAMES",
    "LEASED_EMPTY",
    "MAX_ATTEMPT",
    "MAX_DELAY_MS",
    "MAX_FIELD",
    "MAX_FRAME",
    "MAX_LEASE_ID",
    "MAX_LEASE_MS",
    "MAX_REPLY_PACKETS",
    "MAX_TTL_MS",
    "MAX_TTL_MS_1_0",
    "READY",
    "SYNC",
    "Ack",
    "Auth",
    "ClientFrame",
    "DelayedPush",
    "FrameDecoder",
    "LeaseReply",
    "LeasedSubscribe",
    "MalformedFrame",
    "Opcode",
    "Packet",
    "Pop",
    "ProtocolError",
    "Push",
    "Ready",
    "Release",
    "ReplyDecoder",
    "Reserve",
    "Subscribe",
    "Sync",
    "Touch",
    "Unsubscribe",
    "append_reply",
    "encode",
    "encode_lease_reply",
    "encode_lease_status",
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
    RESERVE = 0x52  # protocol 1.1, the lease frames (decisions 13-18)
    ACK = 0x4B
    RELEASE = 0x4E
    TOUCH = 0x54
    LEASED_SUBSCRIBE = 0x53
    PUSH_OPTIONS = 0x71  # protocol 1.2: push with a u32 TTL and a delay (decision 21)


#: The TCP port a pinpriq server listens on, and a client connects to, unless told otherwise.
DEFAULT_PORT: Final = 7000
#: Longest queue name, key or payload: the length fields are u16.
MAX_FIELD: Final = 0xFFFF
#: Most packets in one reply: the count field is u16.
MAX_REPLY_PACKETS: Final = 0xFFFF
#: Largest legal frame, a push with options (1.2) with three maximal fields: 16 + 3*65535. A
#: 1.0 push is at most 1+2+2+1+4+3*65535.
MAX_FRAME: Final = 1 + 2 + 4 + 4 + 1 + 4 + 3 * MAX_FIELD
#: Longest TTL, in milliseconds: a push with options (``71``) carries a u32.
MAX_TTL_MS: Final = 0xFFFF_FFFF
#: Longest TTL a plain push (``70``) carries: a u16. ``encode`` writes a ``71`` above it.
MAX_TTL_MS_1_0: Final = 0xFFFF
#: Longest delay of a push with options (30 days); a frame with more is malformed.
MAX_DELAY_MS: Final = 2_592_000_000
MAX_PRIO: Final = 0xFF
#: Longest lease time or release delay, in milliseconds (24 h); a frame with more is malformed.
MAX_LEASE_MS: Final = 86_400_000
#: Lease ids are u64; a server numbers a connection's leases from 1, and 0 means "no lease".
MAX_LEASE_ID: Final = 0xFFFF_FFFF_FFFF_FFFF
#: The attempt byte of a lease reply saturates here; the count it stands for does not.
MAX_ATTEMPT: Final = 0xFF

# Headers after the opcode byte.
_PUSH_HEADER = struct.Struct(">HHBHH")  # queue_len, ttl_ms, prio, key_len, payload_len
_NAME_HEADER = struct.Struct(">H")  # queue_len of pop, subscribe, unsubscribe; token_len of auth
_COUNT = struct.Struct(">H")  # a reply's packet count
_PACKET_HEADER = struct.Struct(">HH")  # key_len, payload_len
_PUSH_PREFIX = struct.Struct(">BHHBHH")  # opcode + push header, for encoding
#: After the opcode of a push with options: queue_len, ttl_ms, delay_ms, prio, key_len,
#: payload_len.
_OPTIONS_HEADER = struct.Struct(">HIIBHH")
_OPTIONS_PREFIX = struct.Struct(">BHIIBHH")  # opcode + that header, for encoding
_EMPTY_REPLY: Final = b"\x00\x00"
_TIMED_NAME_HEADER = struct.Struct(">IH")  # lease_ms, queue_len of reserve, leased subscribe
#: What the server sends on a lease: lease id, attempt (or status), count; then the packets.
_LEASE_HEADER = struct.Struct(">QBH")
_ONE_LEASE_HEADER = struct.Struct(">QBHHH")  # the lease header of one packet, and its lengths
#: A reserve that found nothing, or a sync answered on a leased connection: eleven zero bytes.
LEASED_EMPTY = bytes(_LEASE_HEADER.size)


class ProtocolError(PinpriqError, ValueError):
    """The byte stream is not pinpriq: an unknown opcode, or a malformed frame
    (``MalformedFrame``).

    ``offset`` counts bytes from the start of the stream; ``byte`` is the offending value (the
    opcode of a malformed frame). After this error the decoder is unusable: the stream has no
    way to resynchronise.
    """

    def __init__(self, offset: int, byte: int, message: str | None = None) -> None:
        super().__init__(message or f"unknown opcode 0x{byte:02x} at stream offset {offset}")
        self.offset = offset
        self.byte = byte


def _frame_name(cls: type) -> str:
    """``LeasedSubscribe`` as ``leased subscribe``."""
    return "".join(
        f" {c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(cls.__name__)
    )


class MalformedFrame(ProtocolError):
    """A frame whose opcode is known but whose field is out of range: a lease time or release
    delay above ``MAX_LEASE_MS``. ``offset`` is where the frame starts, ``byte`` its opcode."""

    def __init__(self, offset: int, byte: int, reason: str) -> None:
        name = _frame_name(_CLASSES[byte])
        message = f"malformed {name} frame (0x{byte:02x}) at stream offset {offset}: {reason}"
        super().__init__(offset, byte, message)
        self.reason = reason


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
class DelayedPush(NamedTuple):
    """A push with options (``71``, decision 21) whose packet waits ``delay_ms`` (1 up to
    ``MAX_DELAY_MS``) before it enters its queue. A ``71`` with no delay decodes to a ``Push``,
    which it is in every respect (a ``Push``'s ``ttl_ms`` goes up to ``MAX_TTL_MS``)."""

    queue: bytes
    key: bytes
    payload: bytes
    ttl_ms: int
    prio: int
    delay_ms: int


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


# The lease frames of protocol 1.1 (decisions 13-18). A lease time of 0 means the server's
# default; lease times and delays are at most MAX_LEASE_MS.


@_distinct
class Reserve(NamedTuple):
    """Lease the group a pop would take (decision 13). On the wire the time comes first."""

    queue: bytes
    lease_ms: int = 0


@_distinct
class Ack(NamedTuple):
    """The lease's packets are done with, for good (decision 14)."""

    lease_id: int


@_distinct
class Release(NamedTuple):
    """End the lease now; its packets go back after ``delay_ms`` (decision 14)."""

    lease_id: int
    delay_ms: int = 0


@_distinct
class Touch(NamedTuple):
    """The lease now ends ``lease_ms`` from now (decision 14)."""

    lease_id: int
    lease_ms: int = 0


@_distinct
class LeasedSubscribe(NamedTuple):
    """Subscribe with every delivery a lease (decision 17). On the wire the time comes first."""

    queue: bytes
    lease_ms: int = 0


ClientFrame: TypeAlias = (
    Push
    | Pop
    | Subscribe
    | Unsubscribe
    | Ready
    | Sync
    | Auth
    # protocol 1.1: leases
    | Reserve
    | Ack
    | Release
    | Touch
    | LeasedSubscribe
    # protocol 1.2
    | DelayedPush
)

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
    Opcode.RESERVE: Reserve,
    Opcode.ACK: Ack,
    Opcode.RELEASE: Release,
    Opcode.TOUCH: Touch,
    Opcode.LEASED_SUBSCRIBE: LeasedSubscribe,
    Opcode.PUSH_OPTIONS: DelayedPush,
}
_OPCODE_BYTE = {cls: bytes([op]) for op, cls in FRAMES.items()}

READY = Ready()
SYNC = Sync()

# The decoder's view of ``FRAMES``: for each possible first byte, the frame's layout, its class
# and, for one-byte frames, the frame itself (they carry nothing, so one instance serves every
# time). Tuples indexed by the byte: an index into a tuple is the cheapest lookup CPython has.
# Every table is ``Final``: mypyc then keeps it in a C global (or inlines the constant) instead
# of looking it up in the module's dict on every frame.
_UNKNOWN: Final = 0
_PUSH: Final = 1
_NAMED: Final = 2
_SINGLE: Final = 3
_TIMED_NAME: Final = 4
_FIXED: Final = 5
_PUSH_OPTIONS: Final = 6
#: The frames laid out as an opcode and one u16-length byte string have one of these fields.
_NAMED_FIELDS = (("queue",), ("token",))

#: The integer fields of lease frames: their struct format and their largest value. A field
#: whose name ends in ``_ms`` is a time; above MAX_LEASE_MS it makes the frame malformed.
_INT_FIELDS = {"lease_id": ("Q", MAX_LEASE_ID), "lease_ms": ("I", MAX_LEASE_MS)}
_INT_FIELDS["delay_ms"] = _INT_FIELDS["lease_ms"]


def _layout(cls: type[ClientFrame] | None) -> int:
    """Not an opcode; the push; one u16-length byte string (a queue name, auth's token) after
    the opcode; the opcode alone; a queue name after a u32 time; integers only, of the sizes
    ``_INT_FIELDS`` gives."""
    if cls is None:
        return _UNKNOWN
    if cls is Push:
        return _PUSH
    if cls is DelayedPush:
        return _PUSH_OPTIONS
    if cls._fields in _NAMED_FIELDS:
        return _NAMED
    if not cls._fields:
        return _SINGLE
    if cls._fields == ("queue", "lease_ms"):
        return _TIMED_NAME
    if all(name in _INT_FIELDS for name in cls._fields):
        return _FIXED
    raise AssertionError(f"no layout for {cls.__name__} frames")


def _fixed_struct(cls: type[ClientFrame]) -> struct.Struct:
    return struct.Struct(">" + "".join(_INT_FIELDS[name][0] for name in cls._fields))


_CLASSES: Final[tuple[Any, ...]] = tuple(FRAMES.get(byte) for byte in range(256))
_LAYOUTS: Final[tuple[int, ...]] = tuple(_layout(cls) for cls in _CLASSES)
_SINGLETONS: Final[tuple[Any, ...]] = tuple(
    cls() if layout == _SINGLE else None for cls, layout in zip(_CLASSES, _LAYOUTS, strict=True)
)
#: The fields after the opcode of each integers-only frame, by opcode (None for the others).
_STRUCTS: Final[tuple[struct.Struct | None, ...]] = tuple(
    _fixed_struct(cls) if layout == _FIXED else None
    for cls, layout in zip(_CLASSES, _LAYOUTS, strict=True)
)
#: Whether an integers-only frame ends with a time (release, touch; not ack), by opcode.
_ENDS_TIMED: Final[tuple[bool, ...]] = tuple(
    layout == _FIXED and cls._fields[-1].endswith("_ms")
    for cls, layout in zip(_CLASSES, _LAYOUTS, strict=True)
)
_FIXED_BY_CLASS = {_CLASSES[op]: s for op, s in enumerate(_STRUCTS) if s is not None}


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
    if isinstance(frame, Push | DelayedPush):
        return _encode_push(frame)
    opcode = _OPCODE_BYTE[frame.__class__]
    if not frame:  # a frame of one byte: ready, sync
        return opcode
    if isinstance(frame, Ack | Release | Touch):
        for name, value in zip(frame._fields, frame, strict=True):
            _check_int(name, value, _INT_FIELDS[name][1])
        return opcode + _FIXED_BY_CLASS[frame.__class__].pack(*frame)
    if isinstance(frame, Reserve | LeasedSubscribe):  # the time, then a named frame's fields
        _check_field("queue", frame.queue)
        _check_int("lease_ms", frame.lease_ms, MAX_LEASE_MS)
        header = _TIMED_NAME_HEADER.pack(frame.lease_ms, len(frame.queue))
        return b"".join((opcode, header, frame.queue))
    (field,) = frame
    _check_field(frame._fields[0], field)
    return b"".join((opcode, _NAME_HEADER.pack(len(field)), field))


def _encode_push(frame: Push | DelayedPush) -> bytes:
    """A push as ``70`` when it fits (no delay, a TTL of a u16), else as ``71`` (decision 21:
    a ``70`` is exactly a ``71`` with delay 0), so a 1.0 server takes every push it can."""
    _check_field("queue", frame.queue)
    _check_field("key", frame.key)
    _check_field("payload", frame.payload)
    _check_int("ttl_ms", frame.ttl_ms, MAX_TTL_MS)
    _check_int("prio", frame.prio, MAX_PRIO)
    delay_ms = frame.delay_ms if isinstance(frame, DelayedPush) else 0
    _check_int("delay_ms", delay_ms, MAX_DELAY_MS)
    lengths = (len(frame.key), len(frame.payload))
    if delay_ms or frame.ttl_ms > MAX_TTL_MS_1_0:
        header = _OPTIONS_PREFIX.pack(
            Opcode.PUSH_OPTIONS, len(frame.queue), frame.ttl_ms, delay_ms, frame.prio, *lengths
        )
    else:
        header = _PUSH_PREFIX.pack(
            Opcode.PUSH, len(frame.queue), frame.ttl_ms, frame.prio, *lengths
        )
    return b"".join((header, frame.key, frame.payload, frame.queue))


def append_reply(output: bytearray, packets: Sequence[KeyedPayload]) -> None:
    """Append a pop reply or a delivery (``encode_reply``'s bytes) to ``output``: the server
    writes a batch's replies into one buffer, with no bytes object per reply. Headers are
    ``int.to_bytes``, which mypyc compiles to one call, where ``struct`` is a method call."""
    count = len(packets)
    if count == 1:  # the common reply: one packet of a unique key
        packet = packets[0]
        key: bytes = packet[0]
        payload: bytes = packet[1]
        if len(key) > MAX_FIELD or len(payload) > MAX_FIELD:  # would overflow into the next field
            _check_packet(key, payload)
        output += ((1 << 32) | (len(key) << 16) | len(payload)).to_bytes(6, "big")
        output += key
        output += payload
        return
    if not count:
        output += _EMPTY_REPLY
        return
    _check_count(count)
    output += count.to_bytes(2, "big")
    for packet in packets:  # a key group: one pass, straight into the buffer
        key, payload = packet[0], packet[1]
        if len(key) > MAX_FIELD or len(payload) > MAX_FIELD:
            _check_packet(key, payload)
        output += ((len(key) << 16) | len(payload)).to_bytes(4, "big")
        output += key
        output += payload


def encode_reply(packets: Sequence[KeyedPayload]) -> bytes:
    """The bytes of a pop reply or a delivery: ``u16 count`` then each packet."""
    output = bytearray()
    append_reply(output, packets)
    return bytes(output)


def _check_packet(key: bytes, payload: bytes) -> None:
    _check_field("key", key)
    _check_field("payload", payload)


def _check_count(count: int) -> None:
    if count > MAX_REPLY_PACKETS:
        raise ArgumentError(f"a reply holds at most {MAX_REPLY_PACKETS} packets, not {count}")


def _join_packets(header: bytes, packets: Sequence[KeyedPayload]) -> bytes:
    """``header`` then each packet's lengths, key and payload."""
    parts = [header]
    for packet in packets:
        key, payload = packet[0], packet[1]
        parts.append(_PACKET_HEADER.pack(len(key), len(payload)))
        parts.append(key)
        parts.append(payload)
    return b"".join(parts)


def encode_lease_reply(lease_id: int, attempt: int, packets: Sequence[KeyedPayload]) -> bytes:
    """The bytes of a reserve reply or a leased delivery (decisions 13, 17): ``u64 lease id``,
    ``u8 attempt`` (saturating at 255), ``u16 count``, then each packet. A reserve that found
    nothing is ``LEASED_EMPTY``."""
    count = len(packets)
    if count == 1:  # the common one: a packet of a unique key
        key: bytes = packets[0][0]
        payload: bytes = packets[0][1]
        header = _ONE_LEASE_HEADER.pack(
            lease_id, min(attempt, MAX_ATTEMPT), 1, len(key), len(payload)
        )
        return b"".join((header, key, payload))  # not ``+``: see encode_reply
    _check_count(count)
    header = _LEASE_HEADER.pack(lease_id, min(attempt, MAX_ATTEMPT), count)
    return _join_packets(header, packets)


def encode_lease_status(lease_id: int, live: bool) -> bytes:
    """The reply to an ack, release or touch (decision 14): the lease id, status 1 if the lease
    was live (0 if not), count 0."""
    return _LEASE_HEADER.pack(lease_id, live, 0)


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


# Frame header sizes, opcode included, and the two hot opcodes, as literals mypyc inlines.
_PUSH_HEAD: Final = 10  # opcode, queue_len u16, ttl_ms u16, prio u8, key_len u16, payload_len u16
_NAME_HEAD: Final = 3  # opcode, u16 length
_TIMED_NAME_HEAD: Final = 7  # opcode, lease_ms u32, queue_len u16
_OPTIONS_HEAD: Final = (
    16  # opcode, queue_len u16, ttl_ms u32, delay_ms u32, prio, key and payload lens
)
_OP_PUSH: Final = 0x70
_OP_POP: Final = 0x50
_OP_OPTIONS: Final = 0x71
#: Whether this module runs compiled (mypyc): the push header is then read byte by byte, which
#: compiles to native reads, where the interpreter does better with one ``struct`` call (the
#: byte reads made the interpreted decode of a push 3,100 instructions dearer).
_COMPILED: Final = not __file__.endswith(".py")
#: Longest queue name a decoder keeps between frames to share among them (see FrameDecoder).
_SHARED_NAME_MAX: Final = 256
assert _PUSH_HEADER.size + 1 == _PUSH_HEAD
assert _NAME_HEADER.size + 1 == _NAME_HEAD
assert _TIMED_NAME_HEADER.size + 1 == _TIMED_NAME_HEAD
assert _OPTIONS_HEADER.size + 1 == _OPTIONS_HEAD
assert Opcode.PUSH.value == _OP_PUSH
assert Opcode.POP.value == _OP_POP
assert Opcode.PUSH_OPTIONS.value == _OP_OPTIONS


#: The C decoder of push and pop frames (``pinpriq/_codec.c``), or ``None`` where it is not
#: built (no compiler) or not wanted (``PINPRIQ_PURE_PYTHON``).
_codec: Final[Any] = _build.optional_extension(_build.CODEC)


def _delay_too_long(offset: int, delay_ms: int) -> MalformedFrame:
    reason = f"delay {delay_ms:,} ms is above the most, {MAX_DELAY_MS:,} ms (30 days)"
    return MalformedFrame(offset, Opcode.PUSH_OPTIONS, reason)


def _too_long(offset: int, opcode: int, ms: int) -> MalformedFrame:
    what = "release delay" if _CLASSES[opcode] is Release else "lease time"
    reason = f"{what} {ms:,} ms is above the most, {MAX_LEASE_MS:,} ms (24 h)"
    return MalformedFrame(offset, opcode, reason)


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

    def __init__(self, *, native: bool = True) -> None:
        """``native=False``: decode in Python even where the C decoder of push and pop
        (``pinpriq/_codec.c``) is built; tests compare the two."""
        self._data = b""  # undecoded bytes, starting at a frame boundary
        self._parts: list[bytes] = []  # chunks received since, not yet joined to _data
        self._pending = 0  # len(_data) + the lengths of _parts
        self._need = 1  # bytes the next frame needs before decoding can progress
        self._offset = 0  # stream offset of _data[0]
        self._backlog: list[ClientFrame] = []  # decoded, not yet taken by next_frame()
        # The queue name of the last push, and the last pop frame: a connection mostly names
        # one queue, so its frames share one name object, whose hash the store's dict lookups
        # compute once, and a pipelined pop one frame. Kept apart, so that a connection pushing
        # to one queue and popping another (a worker; a pop or sync after each push) shares
        # both. Only names up to _SHARED_NAME_MAX bytes, so an idle connection holds little.
        self._queue = b""
        self._pop: Pop | None = None
        #: The C decoder of push, push with options and pop frames, where it is built: it then
        #: holds the shared name and pop frame instead of ``_queue`` and ``_pop``.
        self._native: Any = (
            _codec.Decoder(Push, DelayedPush, Pop) if native and _codec is not None else None
        )
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
        pos, end, need = 0, len(data), 1
        native = self._native
        if native is not None and data[0] in (_OP_PUSH, _OP_POP, _OP_OPTIONS):
            # A chunk the C decoder takes whole (at pipeline 1, most chunks: one push or pop)
            # returns before the set-up below, which cost a request ~1,500 instructions.
            pos = native.decode(data, 0, frames)
            if native.need or pos >= end:
                return self._decoded(frames, data, pos, native.need or 1)
        # Locals, looked up once per chunk rather than once per frame (classes are not Final).
        append, new, push_type, pop_type = frames.append, tuple.__new__, Push, Pop
        unpack_push = _PUSH_HEADER.unpack_from
        last_queue, last_pop = self._queue, self._pop
        seen: dict[bytes, ClientFrame] = {}  # the other named frames of this chunk, by bytes
        while pos < end:
            opcode = data[pos]
            if native is not None and opcode in (_OP_PUSH, _OP_POP, _OP_OPTIONS):
                # The run of push and pop frames from here, decoded in C; it stops at the end,
                # at an incomplete frame (``need``) or at a frame it leaves to the code below.
                pos = native.decode(data, pos, frames)
                if native.need:
                    need = native.need
                    break
                if pos >= end:
                    break
                opcode = data[pos]
            # Push and pop first, with no table on their way. Compiled, the push header is read
            # byte by byte (mypyc turns each ``data[i]`` into a native read), each field is one
            # slice (one copy); interpreted, ``struct`` reads the header (see _COMPILED).
            if opcode == _OP_PUSH:
                if end - pos < _PUSH_HEAD:
                    need = _PUSH_HEAD
                    break
                if _COMPILED:  # a native read per byte: no call, no tuple, no boxed ints
                    queue_len = (data[pos + 1] << 8) | data[pos + 2]
                    ttl_ms = (data[pos + 3] << 8) | data[pos + 4]
                    prio = data[pos + 5]
                    key_len = (data[pos + 6] << 8) | data[pos + 7]
                    payload_len = (data[pos + 8] << 8) | data[pos + 9]
                else:  # interpreted, one struct call costs less than a dozen bytecodes
                    queue_len, ttl_ms, prio, key_len, payload_len = unpack_push(data, pos + 1)
                key_at = pos + _PUSH_HEAD
                payload_at = key_at + key_len
                queue_at = payload_at + payload_len
                stop = queue_at + queue_len
                if stop > end:
                    need = stop - pos
                    break
                queue = data[queue_at:stop]
                if queue == last_queue:
                    queue = last_queue
                elif stop - queue_at <= _SHARED_NAME_MAX:
                    last_queue = queue
                fields = (queue, data[key_at:payload_at], data[payload_at:queue_at], ttl_ms, prio)
                append(new(push_type, fields))
                pos = stop
                continue
            if opcode == _OP_POP:
                if end - pos < _NAME_HEAD:
                    need = _NAME_HEAD
                    break
                stop = pos + _NAME_HEAD + ((data[pos + 1] << 8) | data[pos + 2])
                if stop > end:
                    need = stop - pos
                    break
                queue = data[pos + _NAME_HEAD : stop]
                if last_pop is not None and queue == last_pop[0]:
                    # A pipelining consumer sends the same pop many times: one frame object,
                    # immutable, serves them all (a named tuple is costly to build).
                    append(last_pop)
                else:
                    fresh: Pop = new(pop_type, (last_queue if queue == last_queue else queue,))
                    if stop - pos - _NAME_HEAD <= _SHARED_NAME_MAX:
                        last_pop = fresh
                    append(fresh)
                pos = stop
                continue
            layout = _LAYOUTS[opcode]
            if layout == _NAMED:
                if end - pos < _NAME_HEAD:
                    need = _NAME_HEAD
                    break
                stop = pos + _NAME_HEAD + ((data[pos + 1] << 8) | data[pos + 2])
                if stop > end:
                    need = stop - pos
                    break
                raw = data[pos:stop]
                frame = seen.get(raw)
                if frame is None:
                    frame = seen[raw] = new(_CLASSES[opcode], (raw[_NAME_HEAD:],))
                append(frame)
                pos = stop
            elif layout == _SINGLE:
                append(_SINGLETONS[opcode])
                pos += 1
            elif layout == _FIXED:  # ack, release, touch
                fixed = _STRUCTS[opcode]
                assert fixed is not None
                stop = pos + 1 + fixed.size
                if stop > end:
                    need = stop - pos
                    break
                values = fixed.unpack_from(data, pos + 1)
                if _ENDS_TIMED[opcode] and values[-1] > MAX_LEASE_MS:
                    self.error = _too_long(self._offset + pos, opcode, values[-1])
                    break
                append(new(_CLASSES[opcode], values))
                pos = stop
            elif layout == _TIMED_NAME:  # reserve, leased subscribe
                if end - pos < _TIMED_NAME_HEAD:
                    need = _TIMED_NAME_HEAD
                    break
                lease_ms, queue_len = _TIMED_NAME_HEADER.unpack_from(data, pos + 1)
                if lease_ms > MAX_LEASE_MS:  # known from the header: no need to wait for more
                    self.error = _too_long(self._offset + pos, opcode, lease_ms)
                    break
                stop = pos + _TIMED_NAME_HEAD + queue_len
                if stop > end:
                    need = stop - pos
                    break
                raw = data[pos:stop]  # a worker pipelining reserves: one frame serves them all
                frame = seen.get(raw)
                if frame is None:
                    frame = new(_CLASSES[opcode], (raw[_TIMED_NAME_HEAD:], lease_ms))
                    seen[raw] = frame
                append(frame)
                pos = stop
            elif layout == _PUSH_OPTIONS:
                # A 71 is a push with a long TTL or a delay: read as the push is (native reads
                # compiled, the queue name shared), so that it costs about what a 70 costs.
                if end - pos < _OPTIONS_HEAD:
                    need = _OPTIONS_HEAD
                    break
                if _COMPILED:
                    queue_len = (data[pos + 1] << 8) | data[pos + 2]
                    ttl_ms = (data[pos + 3] << 24) | (data[pos + 4] << 16)
                    ttl_ms |= (data[pos + 5] << 8) | data[pos + 6]
                    delay_ms = (data[pos + 7] << 24) | (data[pos + 8] << 16)
                    delay_ms |= (data[pos + 9] << 8) | data[pos + 10]
                    prio = data[pos + 11]
                    key_len = (data[pos + 12] << 8) | data[pos + 13]
                    payload_len = (data[pos + 14] << 8) | data[pos + 15]
                else:
                    queue_len, ttl_ms, delay_ms, prio, key_len, payload_len = (
                        _OPTIONS_HEADER.unpack_from(data, pos + 1)
                    )
                if delay_ms > MAX_DELAY_MS:  # known from the header: no need to wait for more
                    self.error = _delay_too_long(self._offset + pos, delay_ms)
                    break
                key_at = pos + _OPTIONS_HEAD
                payload_at = key_at + key_len
                queue_at = payload_at + payload_len
                stop = queue_at + queue_len
                if stop > end:
                    need = stop - pos
                    break
                key, payload = data[key_at:payload_at], data[payload_at:queue_at]
                queue = data[queue_at:stop]
                if queue == last_queue:
                    queue = last_queue
                elif stop - queue_at <= _SHARED_NAME_MAX:
                    last_queue = queue
                if delay_ms:
                    delayed = (queue, key, payload, ttl_ms, prio, delay_ms)
                    append(new(DelayedPush, delayed))
                else:  # decision 21: a ``71`` with no delay is a push
                    append(new(push_type, (queue, key, payload, ttl_ms, prio)))
                pos = stop
            else:
                self.error = ProtocolError(self._offset + pos, opcode)
                break
        self._queue, self._pop = last_queue, last_pop
        return self._decoded(frames, data, pos, need)

    def _decoded(
        self, frames: list[ClientFrame], data: bytes, pos: int, need: int
    ) -> list[ClientFrame]:
        """``decode``'s end: ``data[:pos]`` became ``frames``; the rest waits for ``need``
        bytes in all."""
        self._offset += pos
        self._data = data[pos:] if pos else data
        self._pending = len(data) - pos
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


class LeaseReply(NamedTuple):
    """One message with the 11-byte lease header (decisions 13, 14, 17 and 18).

    A reserve reply or a leased delivery: the lease's id, its ``attempt`` (1 the first time,
    saturating at 255) and its packets; nothing to take is all zero. The answer to an ack,
    release or touch: the lease id it named, ``attempt`` holding the status (1 if the lease was
    live; see ``live``) and no packets. A sync on a leased connection: all zero.
    """

    lease_id: int
    attempt: int
    packets: list[Packet]

    @property
    def live(self) -> bool:
        """For the answer to an ack, release or touch: whether the lease was live."""
        return self.attempt == 1


class ReplyDecoder(_Buffer):
    """Turns the bytes a server sends into replies, each a list of packets.

    A pop reply and a subscription delivery share one format; which is which follows from the
    order of requests on the connection (decision 8), not from the bytes. Packets of a reply are
    decoded as they complete, so a long reply arriving in small chunks costs linear time and the
    buffer holds at most one incomplete packet.

    Messages about leases have an 11-byte header instead of the 2-byte count: read those with
    ``next_lease_reply``. The caller knows from its requests which comes next (on a leased
    connection, every message), and must not switch methods in the middle of a message.
    """

    def __init__(self) -> None:
        super().__init__()
        self._remaining = -1  # packets still to read in the current reply; -1 before its count
        self._count = 0  # packets in the current reply, once its count is read
        self._packets: list[Packet] = []
        self._lease = (0, 0)  # lease id and attempt of the current lease message

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
        if self._remaining < 0:
            if len(self._data) - self._pos < _COUNT.size:
                return None
            (self._remaining,) = _COUNT.unpack_from(self._data, self._pos)
            self._count = self._remaining
            self._pos += _COUNT.size
        return self._read_packets()

    def next_lease_reply(self) -> LeaseReply | None:
        """The next complete message with the 11-byte lease header, or ``None`` if more bytes
        are needed."""
        if self._remaining < 0:
            if len(self._data) - self._pos < _LEASE_HEADER.size:
                return None
            lease_id, attempt, self._remaining = _LEASE_HEADER.unpack_from(self._data, self._pos)
            self._lease = (lease_id, attempt)
            self._count = self._remaining
            self._pos += _LEASE_HEADER.size
        packets = self._read_packets()
        return None if packets is None else LeaseReply(*self._lease, packets)

    def _read_packets(self) -> list[Packet] | None:
        """The current reply's packets once all have arrived, else ``None``."""
        data = self._data
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
