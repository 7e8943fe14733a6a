"""The blocking client: the same calls as ``PinpriqClient``, over plain sockets, for code that
is not async (scripts, web apps, worker threads).

It shares everything but the I/O with ``client.py``: frames come from the same argument helpers
and ``wire.encode``, replies from ``wire.ReplyDecoder``. One ``BlockingPinpriqClient`` is one
connection; threads that share it take turns, one whole call at a time. A pop that times out or
is interrupted after its request went out leaves a reply owed on the connection, which the next
pop reads and drops first; a failed send closes the connection (a frame cut short cannot be
repaired).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType

from pinpriq import wire
from pinpriq.client import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_TIMEOUT,
    RECEIVE_SIZE,
    Data,
    PinpriqConnectionError,
    check_timeout,
    connect_error,
    format_address,
    pop_frame,
    push_frame,
    subscribe_frames,
)
from pinpriq.wire import Packet

__all__ = ["BlockingPinpriqClient", "BlockingSubscription"]


class _SocketLink:
    """A connected socket, the address to name in errors, and the timeout to apply."""

    def __init__(self, sock: socket.socket, host: str, port: int, timeout: float | None) -> None:
        self.sock = sock
        self.host = host
        self.port = port
        self.timeout = timeout
        self.address = format_address(host, port)
        self.closed = False

    @classmethod
    def open(cls, host: str, port: int, timeout: float | None) -> _SocketLink:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except TimeoutError:
            address = format_address(host, port)
            raise TimeoutError(
                f"cannot connect to {address}: no answer within {timeout} s"
            ) from None
        except OSError as error:
            raise connect_error(host, port, error) from None
        # Small request frames must not wait for the ACK of the previous one (Nagle).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock, host, port, timeout)

    def deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def error(self, message: str) -> PinpriqConnectionError:
        return PinpriqConnectionError(message, self.host, self.port)

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

    def _timeout(self, what: str) -> TimeoutError:
        return TimeoutError(f"{what} {self.address}: no answer within {self.timeout} s")

    def send(self, data: bytes, deadline: float | None, what: str) -> None:
        """Send all of ``data``; any failure closes the connection (the frame may be cut)."""
        self._arm(deadline, what)
        try:
            self.sock.sendall(data)
        except TimeoutError:
            self.close()
            raise self._timeout(what) from None
        except OSError as error:
            self.close()
            raise self.error(f"connection to {self.address} broke: {error}") from None
        except BaseException:
            self.close()  # KeyboardInterrupt mid-frame
            raise

    def receive(self, deadline: float | None, what: str) -> bytes:
        self._arm(deadline, what)
        try:
            data = self.sock.recv(RECEIVE_SIZE)
        except TimeoutError:
            raise self._timeout(what) from None
        except OSError as error:
            raise self._lost(f"broke: {error}") from None
        if not data:
            raise self._lost("was closed by the server")
        return data

    def _lost(self, how: str) -> PinpriqConnectionError:
        # Closed by another thread while this one waited: say so, not what recv saw.
        how = "is closed" if self.closed else how
        self.close()
        return self.error(f"connection to {self.address} {how}")

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
    connection raises ``PinpriqConnectionError``; values out of range raise ``ValueError``
    before anything is sent.
    """

    def __init__(self, link: _SocketLink) -> None:
        self._link = link
        self._lock = threading.Lock()
        self._decoder = wire.ReplyDecoder()
        self._owed = 0  # replies to pops whose callers stopped waiting; dropped when they come

    @classmethod
    def connect(
        cls,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> BlockingPinpriqClient:
        """Connect to ``host:port``."""
        check_timeout(timeout)
        return cls(_SocketLink.open(host, port, timeout))

    @property
    def address(self) -> str:
        """The server, as ``host:port``."""
        return self._link.address

    def close(self) -> None:
        """Close the connection. Safe from any thread: a call waiting for a reply in another
        thread raises ``PinpriqConnectionError``."""
        self._link.close()  # without the lock, which a waiting pop holds

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
        self, queue: Data, key: Data, payload: Data, *, ttl_ms: int = 0, prio: int = 1
    ) -> None:
        """Queue ``payload`` under ``key`` (see ``PinpriqClient.push``)."""
        frame = push_frame(queue, key, payload, ttl_ms, prio)
        with self._lock:
            self._link.send(frame, self._link.deadline(), "push to")

    def pop(self, queue: Data) -> list[Packet]:
        """Take the best packet of ``queue`` and the others with its key (see
        ``PinpriqClient.pop``); an empty list when nothing can be selected."""
        frame = pop_frame(queue)
        with self._lock:
            deadline = self._link.deadline()
            self._link.send(frame, deadline, "pop from")
            try:
                return self._next_reply(deadline)
            except BaseException:
                self._owed += 1  # our reply is still on its way: the next pop drops it
                raise

    def subscribe(
        self, *queues: Data, prefetch: int = 1, limit: int | None = None
    ) -> BlockingSubscription:
        """Receive packets from ``queues`` as they arrive, on a connection of its own.

        Use as ``with client.subscribe("jobs") as deliveries: for packets in deliveries: ...``.
        ``prefetch`` and ``limit`` mean what they mean for ``PinpriqClient.subscribe``; waiting
        for a delivery has no timeout.
        """
        opening, credits = subscribe_frames(queues, prefetch, limit)
        link = _SocketLink.open(self._link.host, self._link.port, self._link.timeout)
        try:
            link.send(opening, link.deadline(), "subscribe at")
        except BaseException:
            link.close()
            raise
        return BlockingSubscription(link, credits, limit)

    def _next_reply(self, deadline: float | None) -> list[Packet]:
        while True:
            reply = self._decoder.next_reply()
            if reply is None:
                self._decoder.feed(self._link.receive(deadline, "pop from"))
            elif self._owed:
                self._owed -= 1
            else:
                return reply


class BlockingSubscription:
    """The deliveries of one subscription: an iterator of ``list[Packet]`` that owns a
    connection. Use it in a ``with`` block, or call ``close()``; iteration ends once closed."""

    def __init__(self, link: _SocketLink, credits: int, limit: int | None) -> None:
        self._link = link
        self._decoder = wire.ReplyDecoder()
        self._granted = credits
        self._limit = limit
        self._received = 0
        self._unfinished = False  # a delivery was handed out and its credit not yet returned
        self._closed = False  # by close(), as opposed to by the server or a broken socket

    @property
    def address(self) -> str:
        return self._link.address

    def __iter__(self) -> BlockingSubscription:
        return self

    def __next__(self) -> list[Packet]:
        if self._received == self._limit or self._closed:
            raise StopIteration
        if self._unfinished:
            # The caller is back for more, so the last delivery is finished: return its credit.
            if self._limit is None or self._granted < self._limit:
                link = self._link
                link.send(wire.encode(wire.READY), link.deadline(), "subscription at")
                self._granted += 1
            self._unfinished = False
        while (reply := self._decoder.next_reply()) is None:
            try:
                data = self._link.receive(None, "subscription at")
            except PinpriqConnectionError:
                if self._closed:
                    raise StopIteration from None  # close() from another thread ends the loop
                raise
            self._decoder.feed(data)
        self._received += 1
        self._unfinished = True
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
