"""A direct connection to one standalone Redis for the wake-up path: a subscriber's delivery
(its pop script) and the pub/sub messages that start it.

Why: coredis hands every request to a writer task and every reply to a reader task, and a pub/sub
message passes two more tasks before it reaches us; on this 2-core machine each request round
trip through it cost 0.65 ms median and over 3 ms at p90, against 0.17 and 0.25 ms for a plain
Trio socket (``docs/redis.md``, "Waking a subscriber"). Here a request is written and its reply
read in the calling task, and a message is handed on by the task that read it. The bytes are
coredis's own: its sans-I/O packer writes the commands, its parser reads the replies (and turns
Redis's errors into the same exceptions as coredis raises, so ``RedisStore.call_all`` treats
them alike).

Standalone Redis only (``redis://``, ``rediss://``): on a Cluster, coredis routes each call to
its slot's node and these are not used. Every script call of the store goes this way there
(``RedisStore._pipeline``); coredis keeps the rest (the checks at start, scans, the figures).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from typing import Any

import trio
from coredis._packer import Packer
from coredis.exceptions import ConnectionError as RedisConnectionError
from coredis.parser import NotEnoughData, Parser

__all__ = ["DirectConnection", "DirectSubscriber"]

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
        self.parser = Parser()
        self.packer = Packer(_ENCODING)

    async def open(self) -> None:
        if self.stream is not None:
            return
        self.parser = Parser()  # nothing half-read from a former socket
        try:
            with trio.fail_after(self.connect_timeout):
                stream: trio.abc.Stream = await trio.open_tcp_stream(self.host, self.port)
                if self.tls:
                    stream = trio.SSLStream(
                        stream, ssl.create_default_context(), server_hostname=self.host
                    )
                self.stream = stream
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
        stream, self.stream = self.stream, None
        if isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        if isinstance(stream, trio.SocketStream):
            stream.socket.close()

    async def send(self, commands: Sequence[tuple[Any, ...]]) -> None:
        assert self.stream is not None
        data = b"".join(self.packer.pack_commands(list(commands)))
        try:
            await self.stream.send_all(data)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as error:
            self.close()
            raise RedisConnectionError(f"lost the direct connection: {error}") from error

    async def receive(self) -> Any:
        """The next reply (an exception instance for an error reply)."""
        while True:
            parsed = self.parser.parse(decode=False, encoding=_ENCODING)
            if not isinstance(parsed, NotEnoughData):
                return parsed[1]
            assert self.stream is not None
            try:
                data = await self.stream.receive_some(_CHUNK)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as error:
                self.close()
                raise RedisConnectionError(f"lost the direct connection: {error}") from error
            if not data:
                self.close()
                raise RedisConnectionError("Redis closed the direct connection")
            self.parser.feed(data if isinstance(data, bytes) else bytes(data))  # TLS: bytearray

    async def exchange(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        await self.send(commands)
        return [await self.receive() for _ in commands]


class DirectConnection:
    """Requests to Redis answered in the calling task: each pipeline takes a socket of its
    own from a pool (at most ``size`` open; more callers wait for one), so the tasks of many
    client connections still reach Redis side by side."""

    def __init__(self, host: str, port: int, *, size: int = 64, **options: Any) -> None:
        self._address = (host, port)
        self._options = options
        self._idle: list[_Link] = []
        self._slots = trio.Semaphore(size)

    async def pipeline(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` and return their replies, in order; an error reply is returned as
        its exception. Raises coredis's ``ConnectionError`` if Redis cannot be reached (the
        next call connects again)."""
        async with self._slots:
            link = self._idle.pop() if self._idle else _Link(*self._address, **self._options)
            try:
                await link.open()
                replies = await link.exchange(commands)
            except BaseException:
                link.close()  # cancelled mid-reply: the next reply would be this one's
                raise
            self._idle.append(link)
            return replies

    def close(self) -> None:
        for link in self._idle:
            link.close()
        self._idle.clear()


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
