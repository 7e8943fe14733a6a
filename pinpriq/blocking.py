"""The blocking client: the same calls as ``PinpriqClient``, over plain sockets, for code that
is not async (scripts, web apps, worker threads). It does not import trio.

It owns only the socket I/O; arguments, frames, reply matching and credits are
``_client_core``'s, shared with the Trio client. One ``BlockingPinpriqClient`` is one
connection; threads that share it take turns, one whole call at a time. A call that times out
or is interrupted after its request went out leaves its reply owed on the connection, and the
next call reads and drops it first; a failed send closes the connection (a frame cut short
cannot be repaired).

Leases (protocol 1.1) work as in the Trio client: a ``BlockingLease`` acks, releases and
touches on the connection that holds it, and ``work`` is the worker loop, with a thread that
touches the lease while the handler runs. On a leased subscription's connection, whichever
thread needs something reads for everyone (``BlockingLeasedSubscription._until``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import overload

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

__all__ = [
    "BlockingLease",
    "BlockingLeasedSubscription",
    "BlockingPinpriqClient",
    "BlockingSubscription",
]

log = logging.getLogger("pinpriq.client")

#: Sends an ack, release or touch of one lease and says whether the lease was live.
Answer = Callable[[bytes, int], bool]
#: What ``work`` runs for each job.
Handler = Callable[["BlockingLease"], object]


class _Link:
    """A connected socket (TLS or not), the exchange of requests and replies on it, the
    timeout, and how to open another like it (TLS, token)."""

    def __init__(
        self,
        sock: socket.socket,
        exchange: Exchange,
        timeout: float | None,
        tls: ssl.SSLContext | None,
        token: bytes | None,
    ) -> None:
        self.sock = sock
        self.exchange = exchange
        self.timeout = timeout
        self.address = exchange.address
        self.tls = tls
        self.token = token
        self.closed = False

    @classmethod
    def open(
        cls,
        host: str,
        port: int,
        timeout: float | None,
        tls: ssl.SSLContext | None = None,
        token: bytes | None = None,
    ) -> _Link:
        """Connect within ``timeout``; shake hands over TLS if ``tls``, and present ``token``
        first if there is one."""
        address = format_address(host, port)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except TimeoutError:
            raise PinpriqTimeoutError(
                f"cannot connect to {address}: no answer within {timeout:g} s"
            ) from None
        except OSError as error:
            raise connect_error(host, port, error) from None
        # Small request frames must not wait for the ACK of the previous one (Nagle).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            try:
                sock = tls.wrap_socket(sock, server_hostname=host)  # shakes hands in timeout
            except TimeoutError:
                sock.close()
                raise PinpriqTimeoutError(
                    f"cannot connect to {address}: no TLS handshake within {timeout:g} s"
                ) from None
            except (ssl.SSLError, OSError) as error:
                sock.close()
                reason = describe_tls_error(error) if isinstance(error, ssl.SSLError) else error
                raise PinpriqConnectionError(
                    f"cannot connect to {address}: {TLS_HANDSHAKE_FAILED}: {reason}", host, port
                ) from None
        link = cls(
            sock, Exchange(host, port, time.monotonic(), tls=tls is not None), timeout, tls, token
        )
        if token is not None:
            try:
                slot = link.exchange.expect(Expect.AUTH)
                link.send(auth_frame(token), deadline, "cannot connect to")
                while slot.reply is None:
                    link.exchange.feed(link.receive(deadline, "cannot connect to"))
            except BaseException:
                link.close()
                raise
        return link

    def deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def error(self, message: str) -> PinpriqConnectionError:
        return self.exchange.error(message)

    def _arm(self, deadline: float | None, what: str) -> None:
        """Give the socket what is left of ``deadline``, or raise ``TimeoutError``."""
        if self.closed:
            raise self.error(f"connection to {self.address} is closed")
        if deadline is None:
            self.sock.settimeout(None)
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise self._timeout(what)
        self.sock.settimeout(remaining)

    def _timeout(self, what: str) -> PinpriqTimeoutError:
        return PinpriqTimeoutError(f"{what} {self.address}: no answer within {self.timeout:g} s")

    def send(self, data: bytes, deadline: float | None, what: str) -> None:
        """Send all of ``data``; any failure closes the connection (the frame may be cut)."""
        try:
            self._arm(deadline, what)
            self.sock.sendall(data)
        except PinpriqError:
            self.close()
            raise
        except TimeoutError:
            self.close()
            raise self._timeout(what) from None
        except OSError as error:
            raise self._lost(error) from None
        except BaseException:
            self.close()  # KeyboardInterrupt mid-frame
            raise

    def receive(self, deadline: float | None, what: str) -> bytes:
        # Arming inside the try: a close() from another thread may come between the check of
        # ``closed`` and settimeout, which then fails on the closed socket.
        try:
            self._arm(deadline, what)
            data = self.sock.recv(RECEIVE_SIZE)
        except PinpriqError:
            raise
        except TimeoutError:
            raise self._timeout(what) from None
        except OSError as error:
            raise self._lost(error) from None
        if not data:
            raise self._lost(None)
        self.exchange.received_any = True
        return data

    def _lost(self, error: OSError | None) -> PinpriqConnectionError:
        """The connection ended: closed by another thread, or by the server (``error`` None),
        or broken."""
        if self.closed:  # closed by another thread while this one used it: say so
            lost = self.error(f"connection to {self.address} is closed")
        else:
            lost = self.exchange.broken(time.monotonic(), error)
        self.close()
        return lost

    def close(self) -> None:
        """Close the socket; a thread blocked reading it wakes up (shutdown does that)."""
        self.closed = True
        with contextlib.suppress(OSError):  # not connected any more, or closed already
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class BlockingPinpriqClient:
    """A connection to a pinpriq server for code that is not async; safe to share between
    threads.

    ``BlockingPinpriqClient.connect(host, port)`` returns a connected client; use it in a
    ``with`` block or call ``close()``. ``timeout`` (seconds, ``None`` for no limit) bounds
    connecting and every call, and raises ``TimeoutError``; a refused, broken or closed
    connection raises ``PinpriqConnectionError``; arguments of the wrong type or out of range
    raise ``TypeError`` or ``ValueError`` naming the argument, before anything is sent. Every
    error derives from ``pinpriq.PinpriqError`` too. ``token`` and ``tls`` mean what they mean
    for ``PinpriqClient``.
    """

    def __init__(self, link: _Link) -> None:
        self._link = link
        self._lock = threading.Lock()

    @classmethod
    def connect(
        cls,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        token: bytes | str | None = None,
        tls: bool | ssl.SSLContext = False,
    ) -> BlockingPinpriqClient:
        """Connect to ``host:port``."""
        host, port = check_address(host, port)
        return cls(
            _Link.open(
                host, port, check_timeout(timeout), client_context(tls), resolve_token(token)
            )
        )

    @property
    def address(self) -> str:
        """The server, as ``host:port``."""
        return self._link.address

    def close(self) -> None:
        """Close the connection. Safe from any thread: a call waiting for a reply in another
        thread raises ``PinpriqConnectionError``."""
        self._link.close()  # without the lock, which a waiting call holds

    def __enter__(self) -> BlockingPinpriqClient:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def push(
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
        """Queue ``payload`` under ``key`` (see ``PinpriqClient.push``: a delay or a TTL above
        65,535 ms needs protocol 1.2); with ``confirm=True``, return once the server has
        applied it."""
        frame = push_frame(queue, key, payload, ttl_ms, prio, delay_ms=delay_ms, confirm=confirm)
        if confirm:
            self._request(frame, Expect.NOTHING, "push to")
        else:
            with self._lock:
                self._link.exchange.sending(frame)
                self._link.send(frame, self._link.deadline(), "push to")

    def pop(self, queue: Data) -> list[Packet]:
        """Take the best packet of ``queue`` and the others with its key (see
        ``PinpriqClient.pop``); an empty list when nothing can be selected."""
        reply = self._request(pop_frame(queue), Expect.PACKETS, "pop from")
        assert isinstance(reply, list)
        return reply

    def reserve(self, queue: Data, *, lease_ms: int = 0) -> BlockingLease:
        """Take what ``pop`` would, on a lease (see ``PinpriqClient.reserve``): a
        ``BlockingLease``, empty (false) if nothing could be taken. ``with
        client.reserve("jobs") as job:`` acks when the block ends and releases on an
        exception."""
        reply = self._request(reserve_frame(queue, lease_ms), Expect.LEASE, "reserve from")
        assert isinstance(reply, LeaseReply)
        return BlockingLease(reply, self._answer)

    def _answer(self, frame: bytes, lease_id: int) -> bool:
        reply = self._request(frame, Expect.STATUS, "lease at", lease_id)
        assert isinstance(reply, LeaseReply)
        return reply.live

    def sync(self) -> None:
        """Return once the server has applied every frame this client sent before (see
        ``PinpriqClient.sync``)."""
        self._request(sync_frame(), Expect.NOTHING, "sync with")

    @overload
    def subscribe(
        self, queues: Queues, *, prefetch: int = 1, limit: int | None = None, lease_ms: None = None
    ) -> BlockingSubscription: ...

    @overload
    def subscribe(
        self, queues: Queues, *, prefetch: int = 1, limit: int | None = None, lease_ms: int
    ) -> BlockingLeasedSubscription: ...

    def subscribe(
        self,
        queues: Queues,
        *,
        prefetch: int = 1,
        limit: int | None = None,
        lease_ms: int | None = None,
    ) -> BlockingSubscription | BlockingLeasedSubscription:
        """Receive packets from one queue, or a list of queues, as they arrive, on a connection
        of its own.

        Use as ``with client.subscribe("jobs") as deliveries: for packets in deliveries: ...``.
        ``prefetch``, ``limit`` and ``lease_ms`` mean what they mean for
        ``PinpriqClient.subscribe``; with ``lease_ms`` each delivery is a ``BlockingLease``.
        Waiting for a delivery has no timeout.
        """
        opening, credits = subscribe_frames(queues, prefetch, limit, lease_ms)
        exchange, own = self._link.exchange, self._link
        link = _Link.open(exchange.host, exchange.port, own.timeout, own.tls, own.token)
        try:
            link.send(opening, link.deadline(), "subscribe at")
        except BaseException:
            link.close()
            raise
        if lease_ms is not None:
            return BlockingLeasedSubscription(link, credits)
        return BlockingSubscription(link, credits)

    def work(
        self,
        queues: Queues,
        handler: Handler,
        *,
        lease_ms: int = DEFAULT_WORK_LEASE_MS,
        prefetch: int = 1,
        limit: int | None = None,
        retry_delay_ms: int = 0,
    ) -> None:
        """Run ``handler(job)`` for each job of ``queues``, taken on a lease, for ever or for
        ``limit`` jobs (see ``PinpriqClient.work``): a thread touches the lease every
        ``lease_ms / 2`` while the handler runs; on return, a sync on this client confirms its
        follow-up pushes and the job is acked; on an ``Exception`` it is logged and the job
        released, to come back after ``retry_delay_ms``."""
        check_int("lease_ms", lease_ms, 1)
        check_int("retry_delay_ms", retry_delay_ms, 0)
        with self.subscribe(queues, prefetch=prefetch, limit=limit, lease_ms=lease_ms) as jobs:
            for job in jobs:
                self._work_on(job, handler, lease_ms, retry_delay_ms)

    def _work_on(
        self, job: BlockingLease, handler: Handler, lease_ms: int, retry_delay_ms: int
    ) -> None:
        done = threading.Event()
        keeper = threading.Thread(
            target=_keep_alive, args=(job, lease_ms, done), name="pinpriq-touch", daemon=True
        )
        keeper.start()
        try:
            handler(job)
        except Exception as failure:
            if not job.settled:
                log.warning(
                    "%s: job %r (attempt %d) failed, released: %s",
                    self.address,
                    job.packets[0].key,
                    job.attempt,
                    failure,
                    exc_info=failure,
                )
                job.release(retry_delay_ms)
            return
        finally:
            done.set()
            keeper.join()
        if not job.settled:
            self.sync()
            job.ack()

    def _request(
        self, frame: bytes, expect: Expect, what: str, lease_id: int = 0
    ) -> list[Packet] | LeaseReply:
        """Send a frame with a reply and wait for it; replies owed to earlier calls that
        stopped waiting are read and dropped on the way."""
        link = self._link
        with self._lock:
            deadline = link.deadline()
            link.exchange.sending(frame)
            slot = link.exchange.expect(expect, lease_id)
            link.send(frame, deadline, what)
            while slot.reply is None:
                try:
                    link.exchange.feed(link.receive(deadline, what))
                except PinpriqConnectionError:
                    link.close()
                    raise
            return slot.reply


class BlockingSubscription:
    """The deliveries of one subscription: an iterator of ``list[Packet]`` that owns a
    connection. Use it in a ``with`` block, or call ``close()``; iteration ends once closed."""

    def __init__(self, link: _Link, credits: Credits) -> None:
        self._link = link
        self._credits = credits
        self._decoder = wire.ReplyDecoder()
        self._closed = False  # by close(), as opposed to by the server or a broken socket

    @property
    def address(self) -> str:
        return self._link.address

    def __iter__(self) -> BlockingSubscription:
        return self

    def __next__(self) -> list[Packet]:
        credits = self._credits
        if credits.done or self._closed:
            raise StopIteration
        with _EndedByClose(self):
            if credit := credits.to_return():
                link = self._link
                link.send(credit, link.deadline(), "subscription at")
                credits.returned()
            while (reply := self._decoder.next_reply()) is None:
                self._decoder.feed(self._link.receive(None, "subscription at"))
        credits.delivered()
        return reply

    def close(self) -> None:
        """Close the connection and end iteration, also when another thread is waiting in
        ``next()``; deliveries not yet handed out are lost."""
        self._closed = True
        self._link.close()

    def __enter__(self) -> BlockingSubscription:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _EndedByClose:
    """Turn the connection error of a ``close()`` from another thread into the end of the
    iteration: the close may land while a credit goes out as well as while a delivery is
    awaited."""

    def __init__(self, subscription: BlockingSubscription | BlockingLeasedSubscription) -> None:
        self.subscription = subscription

    def __enter__(self) -> None:
        pass

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(error, PinpriqConnectionError) and self.subscription._closed:
            raise StopIteration from None


def _keep_alive(job: BlockingLease, lease_ms: int, done: threading.Event) -> None:
    """Touch ``job`` every ``lease_ms / 2`` until ``done``; stop if the lease is gone."""
    while not done.wait(lease_ms / 2000):
        try:
            live = job.touch(lease_ms)
        except PinpriqError as error:
            log.warning("lease %d: touch failed, the job may run twice: %s", job.lease_id, error)
            return
        if not live:
            log.warning("lease %d ended before its touch: the job may run twice", job.lease_id)
            return


class BlockingLease(LeaseBase):
    """A group of packets on a lease (see ``pinpriq.Lease``), for the blocking client. As
    ``with lease:`` it acks when the block ends, and releases if the block raises."""

    __slots__ = ("_answer",)

    def __init__(self, reply: LeaseReply, answer: Answer) -> None:
        super().__init__(reply)
        self._answer = answer

    def ack(self) -> bool:
        """The job is done: its packets are gone for good. Whether the lease was live."""
        if not self:
            return False
        self.settled = True
        return self._answer(ack_frame(self.lease_id), self.lease_id)

    def release(self, delay_ms: int = 0) -> bool:
        """Give the job up: its packets go back after ``delay_ms`` (0: at once)."""
        if not self:
            return False
        frame = release_frame(self.lease_id, delay_ms)
        self.settled = True
        return self._answer(frame, self.lease_id)

    def touch(self, lease_ms: int = 0) -> bool:
        """The lease now ends ``lease_ms`` from now (0: the server's default)."""
        if not self:
            return False
        return self._answer(touch_frame(self.lease_id, lease_ms), self.lease_id)

    def __enter__(self) -> BlockingLease:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.settled or not self:
            return
        if error is None:
            self.ack()
            return
        try:
            self.release()
        except PinpriqError as failure:  # the connection is gone: the server put them back
            log.warning("could not release lease %d: %s", self.lease_id, failure)


class BlockingLeasedSubscription:
    """The deliveries of a leased subscription: an iterator of ``BlockingLease`` that owns a
    connection. Use it in a ``with`` block, or call ``close()``: leases not acked by then go
    back to their queues. Any thread may ack, release or touch its leases."""

    def __init__(self, link: _Link, credits: Credits) -> None:
        self._link = link
        self._credits = credits
        self._stream = LeasedStream(link.exchange)
        self._send_lock = threading.Lock()
        self._read = threading.Condition()
        self._reading = False
        self._closed = False

    @property
    def address(self) -> str:
        return self._link.address

    def __iter__(self) -> BlockingLeasedSubscription:
        return self

    def __next__(self) -> BlockingLease:
        credits = self._credits
        if credits.done or self._closed:
            raise StopIteration
        deliveries = self._stream.deliveries
        with _EndedByClose(self):
            if credit := credits.to_return():
                with self._send_lock:
                    self._link.send(credit, self._link.deadline(), "subscription at")
                credits.returned()
            self._until(lambda: bool(deliveries), None)
        credits.delivered()
        return BlockingLease(deliveries.popleft(), self._answer)

    def _answer(self, frame: bytes, lease_id: int) -> bool:
        link = self._link
        deadline = link.deadline()
        with self._send_lock:
            slot = self._stream.expect(lease_id)
            link.send(frame, deadline, "lease at")
        self._until(lambda: slot.reply is not None, deadline)
        assert isinstance(slot.reply, LeaseReply)
        return slot.reply.live

    def _until(self, done: Callable[[], bool], deadline: float | None) -> None:
        """Wait until ``done()``. One thread at a time reads the connection and sorts what
        comes into deliveries and answers; the others wait for it to say something arrived."""
        with self._read:
            while not done():
                if self._reading:
                    self._read.wait(None if deadline is None else deadline - time.monotonic())
                    if deadline is not None and time.monotonic() > deadline:
                        raise self._link._timeout("lease at")
                    continue
                self._reading = True
                self._read.release()
                try:
                    data = self._link.receive(deadline, "lease at")
                finally:
                    self._read.acquire()
                    self._reading = False
                    self._read.notify_all()
                self._stream.feed(data)

    def close(self) -> None:
        """Close the connection and end iteration; unacked leases go back to their queues."""
        self._closed = True
        self._link.close()

    def __enter__(self) -> BlockingLeasedSubscription:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
