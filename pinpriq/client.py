"""The Python client for Trio, and what it shares with the blocking client (``blocking.py``).

This module owns the client side of a connection: turning arguments into frames, matching pop
replies to the calls that asked for them, and keeping a subscription's delivery credits. Every
byte goes through ``pinpriq.wire`` (``encode`` out, ``ReplyDecoder`` in); nothing here knows a
byte layout, and nothing here knows the server.

Theory of operation. One ``PinpriqClient`` is one TCP connection that any number of tasks may
use at once. Requests are *pipelined*: a call takes the send lock, appends a slot to the FIFO of
unanswered pops, sends its frame and releases the lock, so frames never interleave and the FIFO
is in request order, which is the reply order (decision 8). A caller then takes the receive lock
and reads until its own slot is filled; every reply read on the way fills the oldest slot, so a
caller often finds its reply already there. No background task is needed, and a cancelled or
timed-out pop just stops waiting: its reply still arrives, fills its slot, and is dropped, so
the connection stays in step. A frame cut short by a failed send cannot be repaired
(the server cannot tell where the next frame starts), so a failed send closes the connection.

Subscriptions get a connection of their own (decision 8: a delivery looks like a pop reply).
``prefetch`` credits are granted up front and one more each time the caller comes back for the
next delivery, so at most ``prefetch`` deliveries are ever taken from the server and unfinished.
"""

from __future__ import annotations

import math
import os
import socket
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager

import trio

from pinpriq import wire
from pinpriq.wire import Packet

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT",
    "PinpriqClient",
    "PinpriqConnectionError",
    "Subscription",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7000
#: Seconds to wait for a connection or an answer before ``TimeoutError``.
DEFAULT_TIMEOUT = 10.0
#: Bytes asked of the socket per read.
RECEIVE_SIZE = 65536
#: Most credits a subscription may keep outstanding; each is a byte on the wire.
MAX_PREFETCH = 0xFFFF

Data = bytes | bytearray | memoryview | str


class PinpriqConnectionError(ConnectionError):
    """The server could not be reached, or the connection to it broke or was closed.

    The message names the server as ``host:port``; ``host`` and ``port`` hold it too.
    """

    def __init__(self, message: str, host: str, port: int) -> None:
        super().__init__(message)
        self.host = host
        self.port = port


# -- shared by both clients: arguments to frames, addresses, errors ---------------------------


def as_bytes(field: str, value: Data) -> bytes:
    """A queue, key or payload as bytes; ``str`` is encoded as UTF-8."""
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{field} is not encodable as UTF-8") from None
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"{field} must be bytes or str, not {type(value).__name__}")


def push_frame(queue: Data, key: Data, payload: Data, ttl_ms: int, prio: int) -> bytes:
    """The bytes of a push; ``ValueError`` names a field out of range."""
    push = wire.Push(
        as_bytes("queue", queue), as_bytes("key", key), as_bytes("payload", payload), ttl_ms, prio
    )
    return wire.encode(push)


def pop_frame(queue: Data) -> bytes:
    return wire.encode(wire.Pop(as_bytes("queue", queue)))


def subscribe_frames(queues: Sequence[Data], prefetch: int, limit: int | None) -> tuple[bytes, int]:
    """The bytes that open a subscription, and how many credits they grant."""
    if not queues:
        raise ValueError("subscribe needs at least one queue")
    if not 1 <= prefetch <= MAX_PREFETCH:
        raise ValueError(f"prefetch must be in 1..{MAX_PREFETCH}, not {prefetch}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    frames = [wire.encode(wire.Subscribe(as_bytes("queue", queue))) for queue in queues]
    credits = prefetch if limit is None else min(prefetch, limit)
    return b"".join(frames) + wire.encode(wire.READY) * credits, credits


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connect_error(host: str, port: int, error: OSError) -> PinpriqConnectionError:
    """``cannot connect to host:port: reason``, from whatever the socket layer raised."""
    cause = error.__cause__
    # trio reports a failure to connect to every address as one OSError caused by a group.
    if isinstance(cause, ExceptionGroup) and isinstance(cause.exceptions[0], OSError):
        error = cause.exceptions[0]
    if isinstance(error, socket.gaierror) or not error.errno:
        reason = error.strerror or str(error)
    else:
        reason = os.strerror(error.errno)  # trio's strerror repeats the address
    address = format_address(host, port)
    return PinpriqConnectionError(f"cannot connect to {address}: {reason}", host, port)


def check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout}")


# -- the Trio client --------------------------------------------------------------------------


class _Slot:
    """Where one pop's reply lands. A caller that stops waiting just forgets its slot, which
    keeps its place in the FIFO until the reply fills it and nobody reads it."""

    __slots__ = ("reply",)

    def __init__(self) -> None:
        self.reply: list[Packet] | None = None


class _Link:
    """A stream to a server, with the address to name in errors and the timeout to apply."""

    def __init__(
        self, stream: trio.SocketStream, host: str, port: int, timeout: float | None
    ) -> None:
        self.stream = stream
        self.host = host
        self.port = port
        self.timeout = timeout
        self.address = format_address(host, port)

    @contextmanager
    def time_limit(self, what: str) -> Iterator[None]:
        """Turn the client's timeout into a builtin ``TimeoutError`` naming the server."""
        try:
            with trio.fail_after(math.inf if self.timeout is None else self.timeout):
                yield
        except trio.TooSlowError:
            raise TimeoutError(
                f"{what} {self.address}: no answer within {self.timeout} s"
            ) from None

    def error(self, message: str) -> PinpriqConnectionError:
        return PinpriqConnectionError(message, self.host, self.port)

    async def receive(self) -> bytes:
        """Some bytes from the server; ``PinpriqConnectionError`` if it closed or broke."""
        try:
            data = await self.stream.receive_some(RECEIVE_SIZE)
        except trio.ClosedResourceError:
            raise self.error(f"connection to {self.address} is closed") from None
        except (trio.BrokenResourceError, OSError) as error:
            raise self.error(f"connection to {self.address} broke: {error}") from None
        if not data:
            raise self.error(f"connection to {self.address} was closed by the server")
        return data

    async def send(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except trio.ClosedResourceError:
            raise self.error(f"connection to {self.address} is closed") from None
        except (trio.BrokenResourceError, OSError) as error:
            raise self.error(f"connection to {self.address} broke: {error}") from None


async def _open_link(host: str, port: int, seconds: float | None) -> _Link:
    """Connect within ``seconds`` (``None``: no limit), which then bounds each call."""
    try:
        with trio.fail_after(math.inf if seconds is None else seconds):
            stream = await trio.open_tcp_stream(host, port)
    except trio.TooSlowError:
        address = format_address(host, port)
        raise TimeoutError(f"cannot connect to {address}: no answer within {seconds} s") from None
    except OSError as error:
        raise connect_error(host, port, error) from None
    return _Link(stream, host, port, seconds)


class PinpriqClient:
    """A connection to a pinpriq server, for Trio; safe to share between tasks.

    Open it with ``async with PinpriqClient.connect(host, port) as client:``. ``timeout`` (in
    seconds, ``None`` for no limit) bounds connecting and every call; a call that runs out of
    time raises ``TimeoutError``. A refused, broken or closed connection raises
    ``PinpriqConnectionError``. Values out of range raise ``ValueError`` before anything is
    sent.
    """

    def __init__(self, link: _Link) -> None:
        self._link = link
        self._send_lock = trio.StrictFIFOLock()
        self._receive_lock = trio.Lock()
        self._decoder = wire.ReplyDecoder()
        self._unanswered: deque[_Slot] = deque()
        self._closed: str | None = None  # why, once the connection is unusable

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        *,
        # A timeout option rather than only cancel scopes: issue 3 asks for one, and it gives
        # errors that name the server.
        timeout: float | None = DEFAULT_TIMEOUT,  # noqa: ASYNC109
    ) -> AsyncIterator[PinpriqClient]:
        """Connect to ``host:port``; the connection closes when the block exits."""
        check_timeout(timeout)
        client = cls(await _open_link(host, port, timeout))
        try:
            yield client
        finally:
            await client.aclose()

    @property
    def address(self) -> str:
        """The server, as ``host:port``."""
        return self._link.address

    async def aclose(self) -> None:
        """Close the connection. Calls still waiting raise ``PinpriqConnectionError``."""
        await self._close(f"connection to {self.address} is closed")

    async def push(
        self, queue: Data, key: Data, payload: Data, *, ttl_ms: int = 0, prio: int = 1
    ) -> None:
        """Queue ``payload`` under ``key``. The server does not answer a push.

        ``prio`` 1 is the highest, 255 the lowest; 0 is never popped on its own but leaves with
        the next popped packet of the same key. ``ttl_ms`` 0 means the packet never expires.
        """
        frame = push_frame(queue, key, payload, ttl_ms, prio)
        with self._link.time_limit("push to"):
            await self._send(frame, None)

    async def pop(self, queue: Data) -> list[Packet]:
        """Take the best packet of ``queue`` and every other packet with its key.

        The selected packet comes first, the rest in push order; the list is empty when nothing
        in the queue can be selected. If the call is cancelled or times out after the request
        was sent, whatever the server popped for it is lost (delivery is at most once).
        """
        frame = pop_frame(queue)
        slot = _Slot()
        with self._link.time_limit("pop from"):
            await self._send(frame, slot)
            return await self._wait_for(slot)

    def subscribe(
        self, *queues: Data, prefetch: int = 1, limit: int | None = None
    ) -> AbstractAsyncContextManager[Subscription]:
        """Receive packets from ``queues`` as they arrive, on a connection of its own.

        Use as ``async with client.subscribe("jobs", prefetch=3) as deliveries: async for
        packets in deliveries: ...``. Each delivery is a ``list[Packet]``, like a pop's reply.
        At most ``prefetch`` deliveries are taken from the server and not yet finished; a
        delivery is finished when you ask for the next one. ``limit`` ends the iteration after
        that many deliveries, and no more are ever requested. Deliveries received but not yet
        handed to you when the block exits are lost, so a small ``prefetch`` loses least.
        Waiting for a delivery has no timeout: wrap it in ``trio.move_on_after`` if you need
        one.
        """
        opening, credits = subscribe_frames(queues, prefetch, limit)
        self._check_open()
        return self._subscription(opening, credits, limit)

    @asynccontextmanager
    async def _subscription(
        self, opening: bytes, credits: int, limit: int | None
    ) -> AsyncIterator[Subscription]:
        link = self._link
        link = await _open_link(link.host, link.port, link.timeout)
        try:
            with link.time_limit("subscribe at"):
                await link.send(opening)
            yield Subscription(link, credits, limit)
        finally:
            await trio.aclose_forcefully(link.stream)

    async def _send(self, frame: bytes, slot: _Slot | None) -> None:
        """Send one frame whole; a pop's ``slot`` joins the FIFO in the same step."""
        async with self._send_lock:
            self._check_open()
            # Raise a pending cancellation here, where nothing has been sent yet, rather than
            # inside send_all, where part of the frame may already be on its way.
            await trio.lowlevel.checkpoint_if_cancelled()
            if slot is not None:
                self._unanswered.append(slot)
            try:
                await self._link.send(frame)
            except BaseException:
                await self._close(f"connection to {self.address} was lost during a send")
                raise

    async def _wait_for(self, slot: _Slot) -> list[Packet]:
        async with self._receive_lock:
            while slot.reply is None:
                self._check_open()
                try:
                    data = await self._link.receive()
                except PinpriqConnectionError as error:
                    await self._close(str(error))
                    raise self._closed_error() from None  # the first reason, if there were two
                self._decoder.feed(data)
                for reply in self._decoder:
                    if not self._unanswered:
                        await self._close(f"{self.address} sent a reply nobody asked for")
                        raise self._closed_error()
                    self._unanswered.popleft().reply = reply
        return slot.reply

    def _check_open(self) -> None:
        if self._closed is not None:
            raise self._closed_error()

    def _closed_error(self) -> PinpriqConnectionError:
        return self._link.error(self._closed or f"connection to {self.address} is closed")

    async def _close(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
            self._unanswered.clear()
        await trio.aclose_forcefully(self._link.stream)


class Subscription:
    """The deliveries of one subscription: an async iterator of ``list[Packet]``.

    Made by ``PinpriqClient.subscribe``; one task at a time may iterate it.
    """

    def __init__(self, link: _Link, credits: int, limit: int | None) -> None:
        self._link = link
        self._decoder = wire.ReplyDecoder()
        self._granted = credits
        self._limit = limit
        self._received = 0
        self._unfinished = False  # a delivery was handed out and its credit not yet returned

    @property
    def address(self) -> str:
        return self._link.address

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> list[Packet]:
        if self._received == self._limit:
            raise StopAsyncIteration
        if self._unfinished:
            # The caller is back for more, so the last delivery is finished: return its credit.
            if self._limit is None or self._granted < self._limit:
                with self._link.time_limit("subscription at"):
                    await self._link.send(wire.encode(wire.READY))
                self._granted += 1
            self._unfinished = False
        while (reply := self._decoder.next_reply()) is None:
            self._decoder.feed(await self._link.receive())
        self._received += 1
        self._unfinished = True
        return reply
