"""The Python client for Trio.

This module owns only the client's Trio I/O: connecting, sending whole frames, reading replies,
timeouts and locks. Arguments, frames, reply matching and credits are ``_client_core``'s, shared
with the blocking client (``blocking.py``); nothing here knows a byte layout.

Theory of operation. One ``PinpriqClient`` is one TCP connection that any number of tasks may
use at once. Requests are *pipelined*: a call takes the send lock, files a slot for its reply
(pops and syncs have one), sends its frame and releases the lock, so frames never interleave and
the slots are in request order, which is the reply order (decision 8). A caller then takes the
receive lock and reads until its own slot is filled; every reply read on the way fills the
oldest slot, so a caller often finds its reply already there. No background task is needed, and
a cancelled or timed-out call just stops waiting: its reply still arrives, fills its slot, and
is dropped, so the connection stays in step. A frame cut short by a failed send cannot be
repaired (the server cannot tell where the next frame starts), so a failed send closes the
connection.

Subscriptions get a connection of their own (decision 8: a delivery looks like a pop reply).
``prefetch`` credits are granted up front and one more each time the caller comes back for the
next delivery, so at most ``prefetch`` deliveries are ever taken from the server and unfinished.
"""

from __future__ import annotations

import math
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager

import trio

from pinpriq import wire
from pinpriq._client_core import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_TIMEOUT,
    RECEIVE_SIZE,
    TLS_HANDSHAKE_FAILED,
    Credits,
    Data,
    Exchange,
    Expect,
    Queues,
    Slot,
    auth_frame,
    check_address,
    check_timeout,
    connect_error,
    format_address,
    pop_frame,
    push_frame,
    resolve_token,
    subscribe_frames,
    sync_frame,
)
from pinpriq.errors import PinpriqConnectionError, PinpriqTimeoutError
from pinpriq.tls import client_context, describe_tls_error
from pinpriq.wire import Packet

__all__ = ["PinpriqClient", "PinpriqConnectionError", "Subscription"]


#: A connection's stream: TCP, or TLS over TCP.
Stream = trio.SocketStream | trio.SSLStream[trio.SocketStream]


class _Link:
    """A stream to a server, the exchange of requests and replies on it, the timeout, and how
    to open another like it (TLS, token)."""

    def __init__(
        self,
        stream: Stream,
        exchange: Exchange,
        timeout: float | None,
        tls: ssl.SSLContext | None,
        token: bytes | None,
    ) -> None:
        self.stream = stream
        self.exchange = exchange
        self.timeout = timeout
        self.address = exchange.address
        self.tls = tls
        self.token = token

    @contextmanager
    def time_limit(self, what: str) -> Iterator[None]:
        """Turn the client's timeout into a ``TimeoutError`` naming the server."""
        try:
            with trio.fail_after(math.inf if self.timeout is None else self.timeout):
                yield
        except trio.TooSlowError:
            raise PinpriqTimeoutError(
                f"{what} {self.address}: no answer within {self.timeout:g} s"
            ) from None

    def error(self, message: str) -> PinpriqConnectionError:
        return self.exchange.error(message)

    async def receive(self) -> bytes:
        """Some bytes from the server; ``PinpriqConnectionError`` if it closed or broke."""
        try:
            data = await self.stream.receive_some(RECEIVE_SIZE)
        except trio.ClosedResourceError:
            raise self.error(f"connection to {self.address} is closed") from None
        except (trio.BrokenResourceError, OSError) as error:
            raise self.exchange.broken(time.monotonic(), error) from None
        if not data:
            raise self.exchange.broken(time.monotonic(), None)
        self.exchange.received_any = True
        return data if isinstance(data, bytes) else bytes(data)  # bytes, from either stream

    async def send(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except trio.ClosedResourceError:
            raise self.error(f"connection to {self.address} is closed") from None
        except (trio.BrokenResourceError, OSError) as error:
            raise self.exchange.broken(time.monotonic(), error) from None


async def _open_link(
    host: str,
    port: int,
    seconds: float | None,
    tls: ssl.SSLContext | None = None,
    token: bytes | None = None,
) -> _Link:
    """Connect within ``seconds`` (``None``: no limit), which then bounds each call; shake
    hands over TLS if ``tls``, and present ``token`` first if there is one."""
    address = format_address(host, port)
    try:
        with trio.fail_after(math.inf if seconds is None else seconds):
            tcp = await trio.open_tcp_stream(host, port)
            stream: Stream = tcp
            if tls is not None:
                stream = trio.SSLStream(tcp, tls, server_hostname=host)
                try:
                    await stream.do_handshake()
                except trio.BrokenResourceError as error:
                    await trio.aclose_forcefully(tcp)
                    raise PinpriqConnectionError(
                        f"cannot connect to {address}: {TLS_HANDSHAKE_FAILED}: "
                        f"{describe_tls_error(error)}",
                        host,
                        port,
                    ) from None
            link = _Link(stream, Exchange(host, port, time.monotonic()), seconds, tls, token)
            if token is not None:
                try:
                    slot = link.exchange.expect(Expect.AUTH)
                    await link.send(auth_frame(token))
                    while slot.reply is None:
                        link.exchange.feed(await link.receive())
                except BaseException:
                    await trio.aclose_forcefully(stream)
                    raise
    except trio.TooSlowError:
        raise PinpriqTimeoutError(
            f"cannot connect to {address}: no answer within {seconds:g} s"
        ) from None
    except PinpriqConnectionError:
        raise  # it already says what went wrong, and where
    except OSError as error:
        raise connect_error(host, port, error) from None
    return link


class PinpriqClient:
    """A connection to a pinpriq server, for Trio; safe to share between tasks.

    Open it with ``async with PinpriqClient.connect(host, port) as client:``. ``timeout`` (in
    seconds, ``None`` for no limit) bounds connecting and every call; a call that runs out of
    time raises ``TimeoutError``. A refused, broken or closed connection raises
    ``PinpriqConnectionError``. Arguments of the wrong type or out of range raise ``TypeError``
    or ``ValueError`` naming the argument, before anything is sent. Every error derives from
    ``pinpriq.PinpriqError`` too.

    ``token`` (``bytes`` or ``str``; by default the ``PINPRIQ_AUTH_TOKEN`` environment variable,
    if set) is presented first on every connection the client opens, and connecting fails if
    the server does not take it. ``tls=True`` speaks TLS, trusting the system's CAs and checking
    the host name; an ``ssl.SSLContext`` speaks TLS with that context (a private CA, a client
    certificate).
    """

    def __init__(self, link: _Link) -> None:
        self._link = link
        self._send_lock = trio.StrictFIFOLock()
        self._receive_lock = trio.Lock()
        self._closed: str | None = None  # why, once the connection is unusable

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        *,
        # A timeout option rather than only cancel scopes: it gives errors that name the server.
        timeout: float | None = DEFAULT_TIMEOUT,  # noqa: ASYNC109
        token: bytes | str | None = None,
        tls: bool | ssl.SSLContext = False,
    ) -> AsyncIterator[PinpriqClient]:
        """Connect to ``host:port``; the connection closes when the block exits."""
        host, port = check_address(host, port)
        link = await _open_link(
            host, port, check_timeout(timeout), client_context(tls), resolve_token(token)
        )
        client = cls(link)
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
        self,
        queue: Data,
        key: Data,
        payload: Data,
        *,
        ttl_ms: int = 0,
        prio: int = 1,
        confirm: bool = False,
    ) -> None:
        """Queue ``payload`` under ``key``.

        ``prio`` 1 is the highest, 255 the lowest; 0 is never popped on its own but leaves with
        the next popped packet of the same key. ``ttl_ms`` 0 means the packet never expires.
        The server does not answer a push: without ``confirm`` this returns once the frame is
        sent. With ``confirm=True`` a sync follows it, and this returns once the server has
        applied the push (and stored it, on a server that persists packets).
        """
        frame = push_frame(queue, key, payload, ttl_ms, prio, confirm=confirm)
        with self._link.time_limit("push to"):
            if confirm:
                await self._wait_for(await self._send(frame, Expect.NOTHING))
            else:
                await self._send(frame, None)

    async def pop(self, queue: Data) -> list[Packet]:
        """Take the best packet of ``queue`` and every other packet with its key.

        The selected packet comes first, the rest in push order; the list is empty when nothing
        in the queue can be selected. If the call is cancelled or times out after the request
        was sent, whatever the server popped for it is lost (delivery is at most once).
        """
        frame = pop_frame(queue)
        with self._link.time_limit("pop from"):
            return await self._wait_for(await self._send(frame, Expect.PACKETS))

    async def sync(self) -> None:
        """Return once the server has applied every frame this client sent before (and stored
        it, on a server that persists packets): the way to confirm earlier pushes. Needs a
        server speaking protocol 1.1; an older one closes the connection."""
        with self._link.time_limit("sync with"):
            await self._wait_for(await self._send(sync_frame(), Expect.NOTHING))

    def subscribe(
        self, queues: Queues, *, prefetch: int = 1, limit: int | None = None
    ) -> AbstractAsyncContextManager[Subscription]:
        """Receive packets from one queue, or a list of queues, as they arrive, on a connection
        of its own.

        Use as ``async with client.subscribe("jobs", prefetch=3) as deliveries: async for
        packets in deliveries: ...``. Each delivery is a ``list[Packet]``, like a pop's reply;
        across several queues the best packet comes first. At most ``prefetch`` deliveries are
        taken from the server and not yet finished; a delivery is finished when you ask for the
        next one. ``limit`` ends the iteration after that many deliveries, and no more are ever
        requested. Deliveries received but not yet handed to you when the block exits are lost,
        so a small ``prefetch`` loses least. Waiting for a delivery has no timeout: wrap it in
        ``trio.move_on_after`` if you need one.
        """
        opening, credits = subscribe_frames(queues, prefetch, limit)
        self._check_open()
        return self._subscription(opening, credits)

    @asynccontextmanager
    async def _subscription(self, opening: bytes, credits: Credits) -> AsyncIterator[Subscription]:
        exchange, own = self._link.exchange, self._link
        link = await _open_link(exchange.host, exchange.port, own.timeout, own.tls, own.token)
        try:
            with link.time_limit("subscribe at"):
                await link.send(opening)
            yield Subscription(link, credits)
        finally:
            await trio.aclose_forcefully(link.stream)

    async def _send(self, frame: bytes, expect: Expect | None) -> Slot | None:
        """Send one frame whole; the slot for its reply, if it has one, is filed in the same
        step."""
        async with self._send_lock:
            self._check_open()
            # Raise a pending cancellation here, where nothing has been sent yet, rather than
            # inside send_all, where part of the frame may already be on its way.
            await trio.lowlevel.checkpoint_if_cancelled()
            slot = None if expect is None else self._link.exchange.expect(expect)
            try:
                await self._link.send(frame)
            except BaseException:
                await self._close(f"connection to {self.address} was lost during a send")
                raise
            return slot

    async def _wait_for(self, slot: Slot | None) -> list[Packet]:
        assert slot is not None
        async with self._receive_lock:
            while slot.reply is None:
                self._check_open()
                try:
                    self._link.exchange.feed(await self._link.receive())
                except PinpriqConnectionError as error:
                    await self._close(str(error))
                    raise self._closed_error() from None  # the first reason, if there were two
        return slot.reply

    def _check_open(self) -> None:
        if self._closed is not None:
            raise self._closed_error()

    def _closed_error(self) -> PinpriqConnectionError:
        return self._link.error(self._closed or f"connection to {self.address} is closed")

    async def _close(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
            self._link.exchange.drop_waiting()
        await trio.aclose_forcefully(self._link.stream)


class Subscription:
    """The deliveries of one subscription: an async iterator of ``list[Packet]``.

    Made by ``PinpriqClient.subscribe``; one task at a time may iterate it.
    """

    def __init__(self, link: _Link, credits: Credits) -> None:
        self._link = link
        self._credits = credits
        self._decoder = wire.ReplyDecoder()

    @property
    def address(self) -> str:
        return self._link.address

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> list[Packet]:
        credits = self._credits
        if credits.done:
            raise StopAsyncIteration
        if credit := credits.to_return():
            with self._link.time_limit("subscription at"):
                await self._link.send(credit)
            credits.returned()
        while (reply := self._decoder.next_reply()) is None:
            self._decoder.feed(await self._link.receive())
        credits.delivered()
        return reply
