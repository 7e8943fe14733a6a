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

Leases (protocol 1.1). A ``Lease`` acks, releases and touches on the connection that holds it:
the client's own for ``reserve``, the subscription's for a leased ``subscribe``. On the latter,
answers and deliveries share one stream, so whichever task needs something reads for everyone
(``LeasedSubscription._until``) and the others wait to be told something arrived. ``work`` is
the worker loop: a leased subscription, a lease kept alive while the handler runs, and the
handler's follow-up pushes confirmed on the client's own connection before the ack.
"""

from __future__ import annotations

import logging
import math
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from types import TracebackType
from typing import overload

import trio

from pinpriq import wire
from pinpriq._client_core import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_TIMEOUT,
    DEFAULT_WORK_LEASE_MS,
    RECEIVE_SIZE,
    TLS_HANDSHAKE_FAILED,
    Credits,
    Data,
    Exchange,
    Expect,
    LeaseBase,
    LeasedStream,
    Queues,
    Slot,
    ack_frame,
    auth_frame,
    check_address,
    check_int,
    check_timeout,
    connect_error,
    format_address,
    pop_frame,
    push_frame,
    release_frame,
    reserve_frame,
    resolve_token,
    subscribe_frames,
    sync_frame,
    touch_frame,
)
from pinpriq.errors import PinpriqConnectionError, PinpriqError, PinpriqTimeoutError
from pinpriq.tls import client_context, describe_tls_error
from pinpriq.wire import LeaseReply, Packet

__all__ = ["Lease", "LeasedSubscription", "PinpriqClient", "PinpriqConnectionError", "Subscription"]

log = logging.getLogger("pinpriq.client")

#: Sends an ack, release or touch of one lease and says whether the lease was live.
Answer = Callable[[bytes, int], Awaitable[bool]]
#: What ``work`` runs for each job.
Handler = Callable[["Lease"], Awaitable[object]]


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
            link = _Link(
                stream,
                Exchange(host, port, time.monotonic(), tls=tls is not None),
                seconds,
                tls,
                token,
            )
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
        delay_ms: int = 0,
        confirm: bool = False,
    ) -> None:
        """Queue ``payload`` under ``key``.

        ``prio`` 1 is the highest, 255 the lowest; 0 is never popped on its own but leaves with
        the next popped packet of the same key. ``ttl_ms`` 0 means the packet never expires;
        otherwise up to 4,294,967,295 (about 49.7 days). ``delay_ms`` (up to 2,592,000,000,
        30 days) holds the packet out of its queue until then; its TTL counts from when it is
        due. A TTL above 65,535 ms or a delay needs a server speaking protocol 1.2 (an older
        one closes the connection); any other push is the 1.0 frame every server takes.
        The server does not answer a push: without ``confirm`` this returns once the frame is
        sent. With ``confirm=True`` a sync follows it, and this returns once the server has
        applied the push (and stored it, on a server that persists packets).
        """
        frame = push_frame(queue, key, payload, ttl_ms, prio, delay_ms=delay_ms, confirm=confirm)
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
            reply = await self._wait_for(await self._send(frame, Expect.PACKETS))
        assert isinstance(reply, list)
        return reply

    async def reserve(self, queue: Data, *, lease_ms: int = 0) -> Lease:
        """Take what ``pop`` would, on a lease (protocol 1.1): the packets come back to their
        queue unless acked within ``lease_ms`` milliseconds (0: the server's default, 30 s
        unless it was started otherwise; at most 86,400,000).

        Returns a ``Lease``, empty (false) if nothing could be taken. Use it as ``async with
        await client.reserve("jobs") as job:``, which acks when the block ends and releases on
        an exception. The lease belongs to this connection: if it closes, the packets go back.
        If the call is cancelled or times out after the request went out, the lease it took
        ends at its deadline and its packets come back then.
        """
        frame = reserve_frame(queue, lease_ms)
        with self._link.time_limit("reserve from"):
            reply = await self._wait_for(await self._send(frame, Expect.LEASE))
        assert isinstance(reply, LeaseReply)
        return Lease(reply, self._answer)

    async def _answer(self, frame: bytes, lease_id: int) -> bool:
        with self._link.time_limit("lease at"):
            reply = await self._wait_for(await self._send(frame, Expect.STATUS, lease_id))
        assert isinstance(reply, LeaseReply)
        return reply.live

    async def sync(self) -> None:
        """Return once the server has applied every frame this client sent before (and stored
        it, on a server that persists packets): the way to confirm earlier pushes. Needs a
        server speaking protocol 1.1; an older one closes the connection."""
        with self._link.time_limit("sync with"):
            await self._wait_for(await self._send(sync_frame(), Expect.NOTHING))

    @overload
    def subscribe(
        self, queues: Queues, *, prefetch: int = 1, limit: int | None = None, lease_ms: None = None
    ) -> AbstractAsyncContextManager[Subscription]: ...

    @overload
    def subscribe(
        self, queues: Queues, *, prefetch: int = 1, limit: int | None = None, lease_ms: int
    ) -> AbstractAsyncContextManager[LeasedSubscription]: ...

    def subscribe(
        self,
        queues: Queues,
        *,
        prefetch: int = 1,
        limit: int | None = None,
        lease_ms: int | None = None,
    ) -> AbstractAsyncContextManager[Subscription | LeasedSubscription]:
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

        With ``lease_ms`` (protocol 1.1; 0 for the server's default lease time), every delivery
        is a ``Lease`` instead, on the subscription's connection: ack it when done, or use it
        as ``async with job:``. Nothing is lost then: leases not acked when the block exits
        (delivered or not yet handed to you) go back to their queues.
        """
        opening, credits = subscribe_frames(queues, prefetch, limit, lease_ms)
        self._check_open()
        return self._subscription(opening, credits, lease_ms is not None)

    @asynccontextmanager
    async def _subscription(
        self, opening: bytes, credits: Credits, leased: bool
    ) -> AsyncIterator[Subscription | LeasedSubscription]:
        exchange, own = self._link.exchange, self._link
        link = await _open_link(exchange.host, exchange.port, own.timeout, own.tls, own.token)
        try:
            with link.time_limit("subscribe at"):
                await link.send(opening)
            yield LeasedSubscription(link, credits) if leased else Subscription(link, credits)
        finally:
            await trio.aclose_forcefully(link.stream)

    async def work(
        self,
        queues: Queues,
        handler: Handler,
        *,
        lease_ms: int = DEFAULT_WORK_LEASE_MS,
        prefetch: int = 1,
        limit: int | None = None,
        retry_delay_ms: int = 0,
    ) -> None:
        """Run ``await handler(job)`` for each job of ``queues``, taken on a lease, for ever or
        for ``limit`` jobs: the worker loop of at-least-once delivery.

        Jobs come from a leased subscription (a connection of its own). While the handler runs,
        the lease is touched every ``lease_ms / 2`` milliseconds, so a handler slower than the
        lease does not see its job handed to another worker. When it returns, a sync on this
        client's connection confirms whatever it pushed with this client (follow-up jobs), and
        then the job is acked: a crash in between runs the job again, and never loses a
        follow-up. If it raises an ``Exception``, the error is logged (``pinpriq.client``) and
        the job released, to come back after ``retry_delay_ms``; after the server's
        ``--max-deliveries`` attempts it goes to the dead-letter queue. Push follow-ups with
        this client, never on the lease's connection: on a full server a push waits for room,
        and would hold up the acks and touches behind it.
        """
        check_int("lease_ms", lease_ms, 1)
        check_int("retry_delay_ms", retry_delay_ms, 0)
        async with self.subscribe(
            queues, prefetch=prefetch, limit=limit, lease_ms=lease_ms
        ) as jobs:
            async for job in jobs:
                await self._work_on(job, handler, lease_ms, retry_delay_ms)

    async def _work_on(
        self, job: Lease, handler: Handler, lease_ms: int, retry_delay_ms: int
    ) -> None:
        failure: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_keep_alive, job, lease_ms)
            try:
                await handler(job)
            except Exception as error:
                failure = error
            finally:
                nursery.cancel_scope.cancel()
        if job.settled:  # the handler acked or released it itself
            return
        if failure is None:
            await self.sync()
            await job.ack()
            return
        log.warning(
            "%s: job %r (attempt %d) failed, released: %s",
            self.address,
            job.packets[0].key,
            job.attempt,
            failure,
            exc_info=failure,
        )
        await job.release(retry_delay_ms)

    async def _send(self, frame: bytes, expect: Expect | None, lease_id: int = 0) -> Slot | None:
        """Send one frame whole; the slot for its reply, if it has one, is filed in the same
        step."""
        async with self._send_lock:
            self._check_open()
            # Raise a pending cancellation here, where nothing has been sent yet, rather than
            # inside send_all, where part of the frame may already be on its way.
            await trio.lowlevel.checkpoint_if_cancelled()
            self._link.exchange.sending(frame)
            slot = None if expect is None else self._link.exchange.expect(expect, lease_id)
            try:
                await self._link.send(frame)
            except BaseException:
                await self._close(f"connection to {self.address} was lost during a send")
                raise
            return slot

    async def _wait_for(self, slot: Slot | None) -> list[Packet] | LeaseReply:
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


async def _keep_alive(job: Lease, lease_ms: int) -> None:
    """Touch ``job`` every ``lease_ms / 2`` until cancelled; stop if the lease is gone."""
    while True:
        await trio.sleep(lease_ms / 2000)
        try:
            live = await job.touch(lease_ms)
        except PinpriqError as error:
            log.warning("lease %d: touch failed, the job may run twice: %s", job.lease_id, error)
            return
        if not live:
            log.warning("lease %d ended before its touch: the job may run twice", job.lease_id)
            return


class Lease(LeaseBase):
    """A group of packets on a lease, from ``PinpriqClient.reserve`` or a leased subscription.

    ``packets``, ``attempt`` and ``lease_id`` are ``LeaseBase``'s. Acks, releases and touches
    go on the connection that holds the lease, and return whether it was still live: False
    means its deadline had passed (or it was ended already), so its packets went back and may
    be, or have been, delivered again. As ``async with lease:`` it acks when the block ends,
    and releases if the block raises (even when the task is cancelled).
    """

    __slots__ = ("_answer",)

    def __init__(self, reply: LeaseReply, answer: Answer) -> None:
        super().__init__(reply)
        self._answer = answer

    async def ack(self) -> bool:
        """The job is done: its packets are gone for good (decision 14)."""
        if not self:
            return False
        self.settled = True
        return await self._answer(ack_frame(self.lease_id), self.lease_id)

    async def release(self, delay_ms: int = 0) -> bool:
        """Give the job up: its packets go back to their queue after ``delay_ms`` (0: at once;
        at most 86,400,000), with their priority and their place in push order."""
        if not self:
            return False
        frame = release_frame(self.lease_id, delay_ms)
        self.settled = True
        return await self._answer(frame, self.lease_id)

    async def touch(self, lease_ms: int = 0) -> bool:
        """The lease now ends ``lease_ms`` from now (0: the server's default)."""
        if not self:
            return False
        return await self._answer(touch_frame(self.lease_id, lease_ms), self.lease_id)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.settled or not self:
            return
        if error is None:
            await self.ack()
            return
        # Shielded, so that a cancelled task still releases (within the client's timeout);
        # if the connection is gone, the server has put the packets back already.
        with trio.CancelScope(shield=True):
            try:
                await self.release()
            except PinpriqError as failure:
                log.warning("could not release lease %d: %s", self.lease_id, failure)


class LeasedSubscription:
    """The deliveries of a leased subscription: an async iterator of ``Lease``, on a connection
    of its own. Made by ``PinpriqClient.subscribe(..., lease_ms=...)``; one task at a time may
    iterate it, and any task may ack, release or touch its leases."""

    def __init__(self, link: _Link, credits: Credits) -> None:
        self._link = link
        self._credits = credits
        self._stream = LeasedStream(link.exchange)
        self._send_lock = trio.StrictFIFOLock()
        self._reading = False
        self._arrived = trio.Event()

    @property
    def address(self) -> str:
        return self._link.address

    def __aiter__(self) -> LeasedSubscription:
        return self

    async def __anext__(self) -> Lease:
        credits = self._credits
        if credits.done:
            raise StopAsyncIteration
        if credit := credits.to_return():
            await self._send(credit, "subscription at")
            credits.returned()
        deliveries = self._stream.deliveries
        await self._until(lambda: bool(deliveries))
        credits.delivered()
        return Lease(deliveries.popleft(), self._answer)

    async def _answer(self, frame: bytes, lease_id: int) -> bool:
        with self._link.time_limit("lease at"):
            async with self._send_lock:
                # A pending cancellation is raised here, before the slot is filed.
                await trio.lowlevel.checkpoint_if_cancelled()
                slot = self._stream.expect(lease_id)
                await self._send_whole(frame)
            await self._until(lambda: slot.reply is not None)
        assert isinstance(slot.reply, LeaseReply)
        return slot.reply.live

    async def _send(self, data: bytes, what: str) -> None:
        with self._link.time_limit(what):
            async with self._send_lock:
                await self._send_whole(data)

    async def _send_whole(self, data: bytes) -> None:
        # Raise a pending cancellation where nothing has been sent yet, rather than inside
        # send_all, where part of the frame may be on its way.
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            await self._link.send(data)
        except BaseException:
            # A frame cut short cannot be repaired: close; the server puts the leases back.
            await trio.aclose_forcefully(self._link.stream)
            raise

    async def _until(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()``. One task at a time reads the connection and sorts what comes
        into deliveries and answers; the others wait for it to say something arrived."""
        while not done():
            if self._reading:
                await self._arrived.wait()
                continue
            self._reading = True
            try:
                self._stream.feed(await self._link.receive())
            finally:
                self._reading = False
                self._arrived.set()
                self._arrived = trio.Event()
