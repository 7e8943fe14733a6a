"""Direct connections to one standalone Redis: every script call of the store (the batches of
client connections, a subscriber's delivery) and the pub/sub messages that start deliveries.

Why: coredis hands every request to a writer task and every reply to a reader task, and a pub/sub
message passes two more tasks before it reaches us; on this 2-core machine each request round
trip through it cost 0.65 ms median and over 3 ms at p90, against 0.17 and 0.25 ms for a plain
Trio socket (``docs/redis.md``, "Waking a subscriber"). Here the script calls of every task
share one socket, written once and read once per event-loop turn for all of them
(``DirectConnection``), and a message is handed on by the task that read it. The bytes are
coredis's own: its sans-I/O packer writes the commands, its parser reads the replies (and turns
Redis's errors into the same exceptions as coredis raises, so ``RedisStore.call_all`` treats
them alike).

Standalone Redis only (``redis://``, ``rediss://``): on a Cluster, coredis routes each call to
its slot's node and these are not used. Every script call of the store goes this way there
(``RedisStore._pipeline``); coredis keeps the rest (the checks at start, scans, the figures).
"""

from __future__ import annotations

import os
import ssl
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import trio
from coredis._packer import Packer
from coredis.exceptions import ConnectionError as RedisConnectionError
from coredis.parser import NotEnoughData, Parser

__all__ = ["DirectConnection", "DirectSubscriber", "Pending"]

_ENCODING = "utf-8"
_CHUNK = 65536


class _Link:
    """One socket to Redis with coredis's packer and parser: connect (AUTH, SELECT), send
    commands, read replies. Any failure closes it and raises coredis's ``ConnectionError``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        tls: bool,
        db: int,
        username: str | None,
        password: str | None,
        connect_timeout: float,
    ) -> None:
        self.host, self.port, self.tls, self.db = host, port, tls, db
        self.username, self.password = username, password
        self.connect_timeout = connect_timeout
        self.stream: trio.abc.Stream | None = None
        #: The socket's file descriptor on plain TCP, read and written without trio's stream
        #: (no failed read before each wait, no coroutine per write); ``None`` over TLS.
        self.fileno: int | None = None
        self.parser = Parser()
        self.packer = Packer(_ENCODING)

    async def open(self) -> None:
        if self.stream is not None:
            return
        self.parser = Parser()  # nothing half-read from a former socket
        try:
            with trio.fail_after(self.connect_timeout):
                socket_stream = await trio.open_tcp_stream(self.host, self.port)
                stream: trio.abc.Stream = socket_stream
                if self.tls:
                    stream = trio.SSLStream(
                        stream, ssl.create_default_context(), server_hostname=self.host
                    )
                self.stream = stream
                self.fileno = None if self.tls else socket_stream.socket.fileno()
                hello: list[tuple[Any, ...]] = []
                if self.password is not None:
                    user = [self.username] if self.username else []
                    hello.append((b"AUTH", *user, self.password))
                if self.db:
                    hello.append((b"SELECT", self.db))
                for reply in await self.exchange(hello):
                    if isinstance(reply, Exception):
                        raise reply
        except (OSError, trio.TooSlowError, trio.BrokenResourceError) as error:
            self.close()
            raise RedisConnectionError(f"cannot reach Redis directly: {error}") from error

    def close(self) -> None:
        """Close the socket now (synchronously: a dead Redis must not hold us; a TLS close
        notification is not owed to a peer we stop talking to)."""
        stream, self.stream, self.fileno = self.stream, None, None
        if isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        if isinstance(stream, trio.SocketStream):
            stream.socket.close()

    def _open_stream(self) -> trio.abc.Stream:
        """The stream; coredis's ``ConnectionError`` if the link was closed meanwhile (by the
        other of the two tasks that use it, which met an error first)."""
        if self.stream is None:
            raise RedisConnectionError("the direct connection is closed")
        return self.stream

    def pack(self, commands: Sequence[tuple[Any, ...]]) -> bytes:
        return b"".join(self.packer.pack_commands(list(commands)))

    async def send(self, commands: Sequence[tuple[Any, ...]]) -> None:
        await self.write(self.pack(commands))

    async def write(self, data: bytes) -> None:
        """Write ``data`` (on plain TCP, what the kernel takes at once in this task)."""
        stream = self._open_stream()
        sent = self.write_now(data)
        if sent < len(data):
            try:
                await stream.send_all(memoryview(data)[sent:])
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as error:
                self.close()
                raise RedisConnectionError(f"lost the direct connection: {error}") from error

    def write_now(self, data: bytes) -> int:
        """Write what the kernel takes of ``data`` now, without waiting (nothing over TLS);
        returns how many bytes."""
        fileno = self.fileno
        if fileno is None:
            self._open_stream()  # over TLS: nothing now; closed: raises
            return 0
        try:
            return os.write(fileno, data)
        except BlockingIOError:
            return 0
        except OSError as error:
            self.close()
            raise RedisConnectionError(f"lost the direct connection: {error}") from error

    async def receive(self) -> Any:
        """The next reply (an exception instance for an error reply)."""
        while True:
            parsed = self.parser.parse(decode=False, encoding=_ENCODING)
            if not isinstance(parsed, NotEnoughData):
                return parsed[1]
            try:
                data = await self._read()
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as error:
                self.close()
                raise RedisConnectionError(f"lost the direct connection: {error}") from error
            if not data:
                self.close()
                raise RedisConnectionError("Redis closed the direct connection")
            self.parser.feed(data if isinstance(data, bytes) else bytes(data))  # TLS: bytearray

    async def _read(self) -> bytes | bytearray:
        """The next bytes from Redis, once some have come. On plain TCP: wait, then read (a
        reply is never there before its request was written, so a read first would fail)."""
        fileno = self.fileno
        if fileno is None:
            return await self._open_stream().receive_some(_CHUNK)
        while True:
            await trio.lowlevel.wait_readable(fileno)
            try:
                return os.read(fileno, _CHUNK)
            except BlockingIOError:
                continue

    async def exchange(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        await self.send(commands)
        return [await self.receive() for _ in commands]


class Pending:
    """One caller's pipeline: its commands, then their replies, or why it failed."""

    __slots__ = ("commands", "done", "error", "replies")

    def __init__(self, commands: Sequence[tuple[Any, ...]]) -> None:
        self.commands = commands
        self.replies: list[Any] = []
        self.error: RedisConnectionError | None = None
        self.done = trio.Event()


class DirectConnection:
    """Every task's requests to Redis on one socket, one write and one read per event-loop
    turn for all of them: a caller queues its pipeline and waits (``pipeline``); the sender
    task, woken by the first caller of a turn, runs once every task ready in that turn has had
    its go, and writes all that is queued in one system call; the reader task reads whatever
    replies have come and hands each caller its own, in order (Redis answers a connection's
    commands in the order it read them). Where each connection's task wrote and read a socket
    of its own, a turn that served n connections cost n writes, n reads and n wake-ups on
    Redis's sockets; now one of each. ``run`` (a background task) connects on the first
    request, and again after the socket fails (each caller in flight then gets coredis's
    ``ConnectionError``, as ``RedisStore.call_all`` expects)."""

    def __init__(self, host: str, port: int, **options: Any) -> None:
        self._link = _Link(host, port, **options)
        self._queued: list[Pending] = []  # not written yet
        self._in_flight: deque[Pending] = deque()  # written, replies owed, in order
        self._work = trio.Event()  # something is queued: the sender's wake-up
        self._writing = False  # the sender is in a write: nobody else writes meanwhile
        self._unsent = b""  # the rest of a ``send_now`` the kernel did not take at once

    async def pipeline(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` and return their replies, in order; an error reply is returned as
        its exception. Raises coredis's ``ConnectionError`` if Redis cannot be reached (the
        next call connects again)."""
        # Never written here, even with nothing on its way: the tasks ready in this turn after
        # this one then share the sender's write (measured: writing at once when idle cost
        # the front end 1.3-1.4x the CPU per packet at P64, in more writes and wake-ups).
        return await self.replies(self._enqueue(commands))

    def _enqueue(self, commands: Sequence[tuple[Any, ...]]) -> Pending:
        pending = Pending(commands)
        self._queued.append(pending)
        self._work.set()
        return pending

    def send_now(self, commands: Sequence[tuple[Any, ...]]) -> Pending:
        """Write ``commands`` at once, in this task (queued for the sender as ``pipeline``'s
        when it is writing, or the socket is not open or speaks TLS); ``replies`` awaits
        their replies. For a caller that has nobody to wait for: a pub/sub message's
        delivery, whose pop then skips the sender's turn."""
        link = self._link
        if self._queued or self._writing or self._unsent or link.fileno is None:
            return self._enqueue(commands)
        pending = Pending(commands)
        data = link.pack(commands)
        try:
            sent = link.write_now(data)
        except RedisConnectionError as error:  # the socket is closed: the reader fails the rest
            pending.error = error
            pending.done.set()
            return pending
        self._in_flight.append(pending)
        if sent < len(data):
            self._unsent = data[sent:]  # the sender writes the rest before anything else
            self._work.set()
        return pending

    @staticmethod
    async def replies(pending: Pending) -> list[Any]:
        """The replies of a pipeline sent (``send_now``); raises as ``pipeline``."""
        await pending.done.wait()
        if pending.error is not None:
            raise pending.error
        return pending.replies

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect when there is something to send, then write and read for every caller until
        the socket fails; again, until cancelled."""
        task_status.started()
        try:
            while True:
                await self._work.wait()
                try:
                    await self._link.open()
                except RedisConnectionError as error:
                    self._fail(error)
                    continue
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._send_loop)
                        await self._read_loop()
                except* RedisConnectionError as errors:  # the socket failed: one of the two
                    self._fail(cast(RedisConnectionError, errors.exceptions[0]))
        finally:
            self._fail(RedisConnectionError("the front end is closing"))

    def _fail(self, error: RedisConnectionError) -> None:
        """The socket failed (or never opened): every caller waiting gets ``error`` (a request
        sent may have run, its reply lost: the caller knows which to send again, and how)."""
        self._link.close()
        failed = [*self._in_flight, *self._queued]
        self._in_flight.clear()
        self._queued.clear()
        self._unsent = b""
        self._work = trio.Event()
        for pending in failed:
            pending.error = error
            pending.done.set()

    async def _send_loop(self) -> None:
        link = self._link
        while True:
            await self._work.wait()  # set in an earlier turn: this runs after its callers
            self._work = trio.Event()
            batch, self._queued = self._queued, []
            self._in_flight.extend(batch)  # before the write: replies may come at once
            commands = [command for pending in batch for command in pending.commands]
            data, self._unsent = self._unsent + link.pack(commands), b""
            self._writing = True
            try:
                await link.write(data)
            finally:
                self._writing = False

    async def _read_loop(self) -> None:
        """Hand each reply to its caller; returns never, raises when the socket fails."""
        link, in_flight = self._link, self._in_flight
        while True:
            reply = await link.receive()
            if not in_flight:
                raise RedisConnectionError("Redis sent a reply nobody asked for")
            pending = in_flight[0]
            pending.replies.append(reply)
            if len(pending.replies) == len(pending.commands):
                in_flight.popleft()
                pending.done.set()

    def close(self) -> None:
        self._link.close()


class DirectSubscriber:
    """A pub/sub connection whose messages are handed to ``on_message(channel, data)`` by the
    task that reads them (``run``)."""

    def __init__(self, host: str, port: int, **options: Any) -> None:
        self._link = _Link(host, port, **options)
        self._write = trio.Lock()
        self._acked: dict[bytes, trio.Event] = {}

    async def run(
        self,
        channels: Callable[[], Sequence[bytes]],
        on_message: Callable[[bytes, bytes], None],
        on_subscribed: Callable[[], None],
    ) -> None:
        """Connect, subscribe to ``channels()`` (never empty), call ``on_subscribed`` once Redis
        confirmed them, and hand every message on, until the connection fails (coredis's
        ``ConnectionError``) or the task is cancelled. Call it again to reconnect."""
        link = self._link
        try:
            await link.open()
            initial = list(channels())
            pending = len(initial)
            async with self._write:
                await link.send([(b"SUBSCRIBE", *initial)])
            while True:
                reply = await link.receive()
                if not isinstance(reply, list) or len(reply) < 3:
                    continue
                kind = reply[0]
                if kind == b"message":
                    on_message(reply[1], reply[2])
                elif kind == b"subscribe":
                    event = self._acked.pop(reply[1], None)
                    if event is not None:
                        event.set()
                    if pending:
                        pending -= 1
                        if not pending:
                            on_subscribed()
        finally:
            link.close()
            for event in self._acked.values():  # a subscribe waiting: it fails, not hangs
                event.set()
            self._acked.clear()

    async def subscribe(self, *channels: bytes) -> None:
        """Subscribe to ``channels`` and wait until Redis confirms each (so a message
        published after this returns reaches ``on_message``)."""
        if self._link.stream is None:
            raise RedisConnectionError("the direct subscription is not connected")
        if not channels:
            return
        events = [self._acked.setdefault(channel, trio.Event()) for channel in channels]
        async with self._write:
            await self._link.send([(b"SUBSCRIBE", *channels)])
        for event in events:
            await event.wait()
        if self._link.stream is None:
            raise RedisConnectionError("lost the direct subscription")

    async def unsubscribe(self, *channels: bytes) -> None:
        if self._link.stream is None:
            return
        async with self._write:
            await self._link.send([(b"UNSUBSCRIBE", *channels)])
