"""Frames built by hand and a client connection that speaks raw bytes, for server tests.

Built with ``struct`` from the protocol table rather than through ``pinpriq.wire``, so that a bug
in the codec cannot hide the same bug in the server.
"""

from __future__ import annotations

import struct

import pytest
import trio

Reply = list[tuple[bytes, bytes]]


def push(queue: bytes, key: bytes, payload: bytes, ttl_ms: int = 0, prio: int = 1) -> bytes:
    header = struct.pack(">BHHBHH", 0x70, len(queue), ttl_ms, prio, len(key), len(payload))
    return header + key + payload + queue


def push_options(
    queue: bytes, key: bytes, payload: bytes, *, ttl_ms: int = 0, delay_ms: int = 0, prio: int = 1
) -> bytes:
    """A push with options (``71``, decision 21): u32 TTL, u32 delay."""
    lengths = (len(queue), ttl_ms, delay_ms, prio, len(key), len(payload))
    return struct.pack(">BHIIBHH", 0x71, *lengths) + key + payload + queue


def pop(queue: bytes) -> bytes:
    return b"\x50" + struct.pack(">H", len(queue)) + queue


def subscribe(queue: bytes) -> bytes:
    return b"\x73" + struct.pack(">H", len(queue)) + queue


def unsubscribe(queue: bytes) -> bytes:
    return b"\x75" + struct.pack(">H", len(queue)) + queue


READY = b"\x41"
SYNC = b"\x21"


def auth(token: bytes) -> bytes:
    return b"\x61" + struct.pack(">H", len(token)) + token


def reply(*packets: tuple[bytes, bytes]) -> bytes:
    """What the server sends for a pop reply or delivery of these (key, payload) packets."""
    parts = [struct.pack(">H", len(packets))]
    for key, payload in packets:
        parts.append(struct.pack(">HH", len(key), len(payload)) + key + payload)
    return b"".join(parts)


class Peer:
    """A client connection speaking raw bytes, over TCP or TLS (``trio.SSLStream``)."""

    def __init__(self, stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]) -> None:
        self.stream = stream
        self.buffer = bytearray()

    @property
    def socket_stream(self) -> trio.SocketStream:
        """The TCP stream under the peer, TLS or not."""
        if isinstance(self.stream, trio.SSLStream):
            return self.stream.transport_stream
        return self.stream

    @property
    def local_port(self) -> int:
        port: int = self.socket_stream.socket.getsockname()[1]
        return port

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def receive_exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            data = await self.stream.receive_some(1 << 20)
            if not data:
                raise EOFError(f"connection closed with {len(self.buffer)} of {size} bytes read")
            self.buffer += data
        out = bytes(self.buffer[:size])
        del self.buffer[:size]
        return out

    async def reply(self) -> Reply:
        """Read one pop reply or delivery."""
        (count,) = struct.unpack(">H", await self.receive_exactly(2))
        packets = []
        for _ in range(count):
            key_len, payload_len = struct.unpack(">HH", await self.receive_exactly(4))
            packets.append(
                (await self.receive_exactly(key_len), await self.receive_exactly(payload_len))
            )
        return packets

    async def lease(self) -> tuple[int, int, Reply]:
        """Read one message with the 11-byte lease header: (lease id, attempt or status,
        packets)."""
        lease_id, attempt = struct.unpack(">QB", await self.receive_exactly(9))
        return lease_id, attempt, await self.reply()

    async def request(self, data: bytes) -> Reply:
        await self.send(data)
        return await self.reply()

    async def expect_silence(self, seconds: float = 0.05) -> None:
        """Nothing arrives within ``seconds``."""
        with trio.move_on_after(seconds):
            data = await self.stream.receive_some(1 << 16)
            pytest.fail(f"expected nothing, received {data!r}")
        assert not self.buffer, f"expected nothing, had {bytes(self.buffer)!r} buffered"

    async def expect_closed(self) -> None:
        """The server closes the connection (an end of stream, or a reset: a server that closes
        with bytes of ours unread resets); nothing (more) arrives before it does."""
        assert not self.buffer, f"expected the server to close, had {bytes(self.buffer)!r} unread"
        try:
            data = await self.stream.receive_some(1 << 16)
        except trio.BrokenResourceError:
            return
        assert data == b"", f"expected the server to close, received {data!r}"

    async def aclose(self) -> None:
        await self.stream.aclose()


# -- protocol 1.1: leases ---------------------------------------------------------------------


def reserve(queue: bytes, lease_ms: int = 0) -> bytes:
    return b"\x52" + struct.pack(">IH", lease_ms, len(queue)) + queue


def leased_subscribe(queue: bytes, lease_ms: int = 0) -> bytes:
    return b"\x53" + struct.pack(">IH", lease_ms, len(queue)) + queue


def ack(lease_id: int) -> bytes:
    return b"\x4b" + struct.pack(">Q", lease_id)


def release(lease_id: int, delay_ms: int = 0) -> bytes:
    return b"\x4e" + struct.pack(">QI", lease_id, delay_ms)


def touch(lease_id: int, lease_ms: int = 0) -> bytes:
    return b"\x54" + struct.pack(">QI", lease_id, lease_ms)


def lease_reply(lease_id: int, attempt: int, *packets: tuple[bytes, bytes]) -> bytes:
    """A reserve reply or leased delivery: the 11-byte header, then the packets."""
    return struct.pack(">QB", lease_id, attempt) + reply(*packets)


def status(lease_id: int, live: bool) -> bytes:
    """The answer to an ack, release or touch."""
    return struct.pack(">QBH", lease_id, live, 0)


LEASED_NOTHING = bytes(11)
