"""The Trio server: sockets in, frames applied to the store, replies out.

A thin layer over ``wire`` (bytes <-> frames), ``store`` (the queues) and ``subscriptions``
(who gets which packet). It owns only what needs an event loop:

* one reader and one writer task per connection. The reader decodes every complete frame of a
  received chunk, applies them in order, and appends their replies to the connection's output
  buffer; the writer sends whatever has accumulated with one ``send_all``. Deliveries caused by
  another connection's push are appended to the same buffer, so replies and deliveries never
  interleave inside a frame (decision 8), and a subscriber that stops reading blocks only its
  own writer, never the pusher or the server.
* one expiry task that sleeps until the store's earliest TTL deadline; a push with an earlier
  deadline moves the sleep's deadline forward instead of starting a timer of its own.
"""

from __future__ import annotations

import logging
import math

import trio

from pinpriq.store import QueuedPacket, QueueStore
from pinpriq.subscriptions import Subscriber, Subscriptions
from pinpriq.wire import (
    ClientFrame,
    FrameDecoder,
    Pop,
    ProtocolError,
    Push,
    Ready,
    Subscribe,
    Unsubscribe,
    encode_reply,
)

__all__ = ["PinpriqServer", "serve"]

log = logging.getLogger("pinpriq.server")

#: Bytes asked of the socket per read.
RECEIVE_SIZE = 65536
#: A connection whose unsent output passes this is not read from until the output drains
#: (a client pipelining pops without reading its replies must not grow the server's memory).
OUTPUT_HIGH_WATER = 4 * 1024 * 1024
#: How long a closing connection may take to flush replies it was already owed.
CLOSE_FLUSH_SECONDS = 2.0


def _peer_name(stream: trio.SocketStream) -> str:
    try:
        host, port, *_ = stream.socket.getpeername()
    except OSError:
        return "unknown peer"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Connection:
    """One client: its decoder, output buffer and subscriber handle."""

    def __init__(self, server: PinpriqServer, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.peer = _peer_name(stream)
        self.decoder = FrameDecoder()
        self.output = bytearray()
        self.unsent = 0  # bytes the writer has taken but not finished sending
        self.subscriber = Subscriber(self.deliver)
        self._output_ready = trio.Event()
        self._output_drained = trio.Event()

    def deliver(self, packets: list[QueuedPacket]) -> None:
        self.output += encode_reply(packets)
        self._output_ready.set()

    async def run(self) -> None:
        """Serve until the client closes, sends garbage, or the socket breaks."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write_loop)
            try:
                await self._read_loop()
            finally:
                # No deliveries to a connection that is going away (decision 7).
                self.server.subscriptions.remove(self.subscriber)
            with trio.move_on_after(CLOSE_FLUSH_SECONDS):
                await self._drain()
            nursery.cancel_scope.cancel()

    async def _read_loop(self) -> None:
        while True:
            while len(self.output) + self.unsent > OUTPUT_HIGH_WATER:
                await self._drain()
            data = await self.stream.receive_some(RECEIVE_SIZE)
            if not data:
                return  # EOF; a frame cut short stays in the decoder and is dropped
            self.decoder.feed(data)
            try:
                for frame in self.decoder:
                    self.server.apply(self, frame)
            except ProtocolError as error:
                log.warning("closing %s: %s", self.peer, error)
                return
            finally:
                if self.output:
                    self._output_ready.set()

    async def _write_loop(self) -> None:
        while True:
            await self._output_ready.wait()
            self._output_ready = trio.Event()
            if not self.output:
                continue
            data, self.output = self.output, bytearray()
            self.unsent = len(data)
            await self.stream.send_all(data)
            self.unsent = 0
            if not self.output:
                self._output_drained.set()
                self._output_drained = trio.Event()

    async def _drain(self) -> None:
        """Wait until everything owed to the client has been handed to the kernel."""
        while self.output or self.unsent:
            await self._output_drained.wait()


class PinpriqServer:
    """A store, its subscriptions and the connections that use them."""

    def __init__(self, store: QueueStore | None = None) -> None:
        self.store = store if store is not None else QueueStore(trio.current_time)
        self.subscriptions = Subscriptions(self.store)
        self.connections = 0
        self._expiry_scope = trio.CancelScope()

    def apply(self, conn: _Connection, frame: ClientFrame) -> None:
        """Carry out one frame for a connection; replies go to its output buffer."""
        match frame:
            case Push(queue, key, payload, ttl_ms, prio):
                deadline = self.store.push(queue, key, payload, ttl_ms, prio)
                if deadline < self._expiry_scope.deadline:
                    self._expiry_scope.deadline = deadline
                if prio:
                    self.subscriptions.offer(queue)
            case Pop(queue):
                conn.output += encode_reply(self.store.pop(queue))
            case Ready():
                self.subscriptions.ready(conn.subscriber)
            case Subscribe(queue):
                self.subscriptions.subscribe(conn.subscriber, queue)
            case Unsubscribe(queue):
                self.subscriptions.unsubscribe(conn.subscriber, queue)

    async def serve(
        self,
        port: int,
        *,
        host: str = "127.0.0.1",
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (port 0 picks a free one) and serve until cancelled.

        Reports the listeners through ``task_status``, so ``await nursery.start(server.serve,
        0)`` returns once connections are accepted.
        """
        listeners = await trio.open_tcp_listeners(port, host=host)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._expire_loop)
            for listener in listeners:
                address = listener.socket.getsockname()
                log.info("pinpriq listening on %s port %d", address[0], address[1])
            task_status.started(listeners)
            await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = _Connection(self, stream)
        self.connections += 1
        log.debug("connection from %s", conn.peer)
        try:
            await conn.run()
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            log.debug("connection from %s broke", conn.peer)
        except* Exception:
            # A bug in handling one connection must not take the others down.
            log.exception("error serving %s; closing its connection", conn.peer)
        finally:
            self.connections -= 1
            await trio.aclose_forcefully(stream)

    async def _expire_loop(self) -> None:
        """Sweep expired packets at the earliest deadline, and only then (decision 1)."""
        while True:
            next_deadline = self.store.next_deadline()
            with trio.CancelScope(
                deadline=math.inf if next_deadline is None else next_deadline
            ) as self._expiry_scope:
                await trio.sleep_forever()
            self.store.expire()


async def serve(
    port: int,
    *,
    host: str = "127.0.0.1",
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a pinpriq server with a fresh store until cancelled."""
    await PinpriqServer().serve(port, host=host, task_status=task_status)
