"""The Trio server: sockets in, frames applied to the store, replies out.

A thin layer over ``wire`` (bytes <-> frames), ``store`` (the queues) and ``subscriptions``
(who gets which packet). It owns only what needs an event loop or a limit:

* one reader and one writer task per connection. The reader reads the socket, decodes every
  complete frame of the chunk, applies them in order, appends their replies to the connection's
  output buffer and writes the buffer with one write. Deliveries caused by another connection's
  push are appended to the same buffer, so replies and deliveries never interleave inside a frame
  (decision 8), and the pusher's reader writes them at the end of its batch. Whatever the kernel
  does not take at once is left to the connection's writer task, so a subscriber that stops
  reading blocks only its own writer, never the pusher or the server.
* one expiry task that sleeps until the store's earliest TTL deadline; a push with an earlier
  deadline moves the sleep's deadline forward instead of starting a timer of its own.
* limits, each of which makes one connection wait rather than dropping anything: a memory cap
  (a connection whose next frame is a push waits while the store is full), an output bound (a
  connection that does not read its replies is not read from), and a connection limit.

Memory held per connection is bounded: the decoder holds at most one frame plus one read, since
the reader decodes everything it has before reading again, and stops reading while it waits.
"""

from __future__ import annotations

import logging
import math
import os

import trio

from pinpriq.store import QueuedPacket, QueueStore
from pinpriq.subscriptions import Subscriber, Subscriptions
from pinpriq.wire import (
    POP,
    PUSH,
    READY_OPCODE,
    SUBSCRIBE,
    SYNC_OPCODE,
    FrameDecoder,
    RawFrame,
    encode_reply,
)

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_MEMORY",
    "PinpriqServer",
    "serve",
]

log = logging.getLogger("pinpriq.server")

#: Bytes asked of the socket per read.
RECEIVE_SIZE = 65536
#: A connection whose unsent output passes this is not read from until the output drains
#: (a client pipelining pops without reading its replies must not grow the server's memory).
OUTPUT_HIGH_WATER = 4 * 1024 * 1024
#: How long a closing connection may take to flush replies it was already owed.
CLOSE_FLUSH_SECONDS = 1.0
#: Default cap on ``QueueStore.bytes_held``.
DEFAULT_MAX_MEMORY = 1024**3
#: Pushes resume once usage falls below this fraction of the cap, so a full server does not
#: flap between full and not full on every pop.
LOW_WATER_FRACTION = 0.9
DEFAULT_MAX_CONNECTIONS = 4096


def _deliver_nowhere(packets: list[QueuedPacket]) -> None:
    """A closed connection's subscriber callback; never called, as it is subscribed to nothing."""


def _peer_name(stream: trio.SocketStream) -> str:
    try:
        host, port, *_ = stream.socket.getpeername()
    except OSError:
        return "unknown peer"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Connection:
    """One client: its decoder, output buffer and subscriber handle.

    Its own replies are sent by its reader, inline, after each batch: that costs no task switch,
    and a client that does not read its replies stops being read. Deliveries caused by another
    connection's push are written by that connection's reader at the end of its batch, straight
    to this socket if the kernel takes them; what it does not take is left to this connection's
    writer task, so a subscriber that does not read never holds the pusher up. Only one task
    sends on a connection at a time, and whoever sends sends everything pending.
    """

    def __init__(self, server: PinpriqServer, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.peer = _peer_name(stream)
        self.fileno = stream.socket.fileno()
        self.decoder = FrameDecoder()
        self.output = bytearray()
        self.unsent = 0  # bytes being sent now
        self.sending = False
        self.closed = False  # its socket is closed: never write to its file descriptor again
        self.flush_scheduled = False  # in the server's list of connections with deliveries
        self.subscriber = Subscriber(self.deliver)
        self.reading = trio.CancelScope()  # cancelled to stop reading, as at shutdown
        self._output_ready = trio.Event()
        self._output_drained = trio.Event()

    def deliver(self, packets: list[QueuedPacket]) -> None:
        self.output += encode_reply(packets)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.server.to_flush.append(self)
        if len(self.output) + self.unsent > OUTPUT_HIGH_WATER:
            # A subscriber that does not read gets nothing more until it does: further packets
            # stay queued, for others to take and for the memory cap to count.
            self.subscriber.paused = True

    async def run(self) -> None:
        """Serve until the client closes, sends garbage, the socket breaks, or the server
        stops reading; then flush what the client is owed, briefly, and return."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write_loop)
            try:
                with self.reading:
                    await self._read_loop()
            finally:
                # No deliveries to a connection that is going away (decision 7).
                self.server.subscriptions.remove(self.subscriber)
            with trio.move_on_after(CLOSE_FLUSH_SECONDS):
                await self._drain()
            nursery.cancel_scope.cancel()

    async def _read_loop(self) -> None:
        server, decoder = self.server, self.decoder
        while True:
            data = await self._receive()
            if not data:
                return  # EOF; a frame cut short stays in the decoder and is dropped
            decoder.feed(data)
            frames = decoder.decode()
            done = server.apply(self, frames)
            server.flush_deliveries()  # before any await: no socket can close in between
            while done < len(frames):
                await self._wait_before(frames[done][0])
                done = server.apply(self, frames, done)
                server.flush_deliveries()
            if self.output and not self.sending:
                await self._send_output()
            if decoder.error is not None:
                log.warning("closing %s: %s", self.peer, decoder.error)
                return

    async def _receive(self) -> bytes:
        """The next chunk from the client; ``b""`` at the end of its stream or on a reset.

        Reads the socket directly and waits on trio only when nothing has arrived: a client
        waiting for each reply (the common case at low load) costs one wait per request rather
        than trio's wait plus a checkpoint. When data was already there, it checkpoints, so a
        client that never stops sending cannot starve the others.
        """
        try:
            data = os.read(self.fileno, RECEIVE_SIZE)
        except BlockingIOError:
            pass
        except OSError:
            return b""  # reset by the peer: the same as its end of stream, here
        else:
            await trio.lowlevel.checkpoint()
            return data
        while True:
            await trio.lowlevel.wait_readable(self.fileno)
            try:
                return os.read(self.fileno, RECEIVE_SIZE)
            except BlockingIOError:
                continue
            except OSError:
                return b""

    def write_pending(self) -> None:
        """Write what is pending straight to the socket, if nobody is sending; leave what the
        kernel does not take to the writer task."""
        self.flush_scheduled = False
        if self.closed or self.sending or not self.output:
            return
        try:
            sent = self._send_now(self.output)
        except trio.BrokenResourceError:
            sent = 0  # the writer will meet the same error and close the connection
        del self.output[:sent]
        if self.output:
            self._output_ready.set()
        elif self.subscriber.paused:
            self.server.subscriptions.resume(self.subscriber)

    async def _wait_before(self, opcode: int) -> None:
        """Wait until the frame ``apply`` stopped at may go: a push until the store has room,
        anything else until the output has drained. The replies so far go out meanwhile."""
        if opcode == PUSH and self.server.memory_full:
            self._output_ready.set()
            await self.server.wait_for_memory()
        else:
            await self._drain()

    async def _write_loop(self) -> None:
        while True:
            await self._output_ready.wait()
            self._output_ready = trio.Event()
            if not self.sending:
                await self._send_output()

    async def _send_output(self) -> None:
        """Send everything pending, including what is added while sending."""
        self.sending = True
        try:
            while self.output:
                data, self.output = self.output, bytearray()
                sent = self._send_now(data)
                if sent < len(data):
                    self.unsent = len(data) - sent
                    await self.stream.send_all(memoryview(data)[sent:])
                    self.unsent = 0
                if self.subscriber.paused and len(self.output) <= OUTPUT_HIGH_WATER:
                    self.server.subscriptions.resume(self.subscriber)
        finally:
            self.sending = False
        self._output_drained.set()
        self._output_drained = trio.Event()

    def _send_now(self, data: bytearray) -> int:
        """Write what the kernel takes at once, without a trip through the event loop (the
        common case: a batch's replies fit the socket buffer); returns how many bytes."""
        try:
            return os.write(self.fileno, data)
        except BlockingIOError:
            return 0
        except OSError as error:
            raise trio.BrokenResourceError(f"sending to {self.peer} failed: {error}") from error

    async def _drain(self) -> None:
        """Wait until everything owed to the client has been handed to the kernel."""
        self._output_ready.set()
        while self.output or self.sending:
            await self._output_drained.wait()


class PinpriqServer:
    """A store, its subscriptions, the connections that use them, and their limits."""

    def __init__(
        self,
        store: QueueStore | None = None,
        *,
        max_memory: int = DEFAULT_MAX_MEMORY,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        """``max_memory`` caps ``store.bytes_held`` (0 for no cap); ``max_connections`` caps
        concurrent connections (further ones are accepted and closed at once)."""
        self.store = store if store is not None else QueueStore(trio.current_time)
        self.subscriptions = Subscriptions(self.store)
        self.max_memory = max_memory or math.inf
        self.max_connections = max_connections
        self.memory_full = False
        self._low_water = self.max_memory * LOW_WATER_FRACTION
        self._memory_freed = trio.Event()
        self._connections: set[_Connection] = set()
        #: Connections given deliveries since the last flush (see ``flush_deliveries``).
        self.to_flush: list[_Connection] = []
        self._all_closed = trio.Event()  # set when the last connection closes after shutdown
        self._expiry_scope = trio.CancelScope()
        self._accepting = trio.CancelScope()

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._connections)

    def apply(self, conn: _Connection, frames: list[RawFrame], start: int = 0) -> int:
        """Carry out a connection's frames in order from ``start``; replies go to its output.

        Returns how many of ``frames`` are done: all of them, or fewer if the next must wait,
        because it is a push and the store is full, or because the output passed its bound.
        """
        store, subscriptions, output = self.store, self.subscriptions, conn.output
        waiting_queues = subscriptions.waiting_queues
        for index in range(start, len(frames)):
            frame = frames[index]
            opcode = frame[0]
            if opcode == PUSH:
                if self.memory_full:
                    return index
                _, queue, key, payload, ttl_ms, prio = frame
                deadline = store.push(queue, key, payload, ttl_ms, prio)
                if ttl_ms and deadline < self._expiry_scope.deadline:
                    self._expiry_scope.deadline = deadline
                if prio and queue in waiting_queues:
                    subscriptions.offer(queue)
                if store.bytes_held >= self.max_memory:
                    self.check_memory()
                continue
            if opcode == POP:
                output += encode_reply(store.pop(frame[1]))
            elif opcode == READY_OPCODE:
                subscriptions.ready(conn.subscriber)
            elif opcode == SUBSCRIBE:
                subscriptions.subscribe(conn.subscriber, frame[1])
            elif opcode == SYNC_OPCODE:
                output += b"\x00\x00"  # every earlier frame is applied (decision 11)
            else:  # UNSUBSCRIBE: the decoder yields no other opcode
                subscriptions.unsubscribe(conn.subscriber, frame[1])
            if len(output) + conn.unsent > OUTPUT_HIGH_WATER:
                self._after_batch()
                return index + 1
        self._after_batch()
        return len(frames)

    def flush_deliveries(self) -> None:
        """Write the deliveries made since the last call to their connections' sockets.

        Called by a connection's reader right after ``apply``, with no await in between, so a
        delivery reaches its subscriber's socket before the pusher's next frame is read and no
        connection in the list can have closed meanwhile.
        """
        while self.to_flush:
            pending, self.to_flush = self.to_flush, []
            for conn in pending:
                conn.write_pending()  # may resume a paused subscriber, delivering again

    def _after_batch(self) -> None:
        if self.memory_full:
            self.check_memory()  # pops and deliveries may have made room

    def check_memory(self) -> None:
        """Enter or leave the full state after usage changed; logs each change once."""
        held = self.store.bytes_held
        if not self.memory_full and held >= self.max_memory:
            self.memory_full = True
            log.warning(
                "memory cap reached: %d bytes held, cap %d; pushes wait until usage falls below %d",
                held,
                self.max_memory,
                self._low_water,
            )
        elif self.memory_full and held < self._low_water:
            self.memory_full = False
            log.warning("memory below the low-water mark (%d bytes held); pushes resume", held)
            self._memory_freed.set()
            self._memory_freed = trio.Event()

    async def wait_for_memory(self) -> None:
        """Return once the store is below its low-water mark."""
        while self.memory_full:
            await self._memory_freed.wait()

    async def serve(
        self,
        port: int,
        *,
        host: str = "127.0.0.1",
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (port 0 picks a free one) and serve until cancelled or
        until ``shutdown()`` has closed every connection.

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
            with self._accepting:
                # serve_listeners closes the listeners when cancelled, and outlives a lack of
                # file descriptors by pausing accepts rather than failing.
                await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)
            if self._connections:
                await self._all_closed.wait()
            nursery.cancel_scope.cancel()

    @property
    def stopping(self) -> bool:
        """Whether ``shutdown()`` has been called."""
        return self._accepting.cancel_called

    def shutdown(self) -> None:
        """Stop gracefully: close the listeners, stop reading every connection, let each flush
        the replies it is owed (at most ``CLOSE_FLUSH_SECONDS``), close it; then ``serve``
        returns."""
        log.info("shutting down: %d connections to flush", len(self._connections))
        self._accepting.cancel()
        for conn in self._connections:
            conn.reading.cancel()

    async def _handle(self, stream: trio.SocketStream) -> None:
        if self.stopping or len(self._connections) >= self.max_connections:
            reason = "shutting down" if self.stopping else f"{len(self._connections)} open"
            log.warning("refusing a connection from %s: %s", _peer_name(stream), reason)
            await trio.aclose_forcefully(stream)
            return
        conn = _Connection(self, stream)
        self._connections.add(conn)
        log.debug("connection from %s", conn.peer)
        try:
            await conn.run()
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            log.debug("connection from %s broke", conn.peer)
        except* Exception:
            # A bug in handling one connection must not take the others down.
            log.exception("error serving %s; closing its connection", conn.peer)
        finally:
            self._connections.discard(conn)
            self.subscriptions.remove(conn.subscriber)
            # The subscriber's callback is a method of the connection: a reference cycle that
            # would keep the connection's buffers and sockets for the cyclic collector.
            conn.subscriber.deliver = _deliver_nowhere
            conn.closed = True
            await trio.aclose_forcefully(stream)
            if not self._connections and self.stopping:
                self._all_closed.set()

    async def _expire_loop(self) -> None:
        """Sweep expired packets at the earliest deadline, and only then (decision 1)."""
        while True:
            next_deadline = self.store.next_deadline()
            with trio.CancelScope(
                deadline=math.inf if next_deadline is None else next_deadline
            ) as self._expiry_scope:
                await trio.sleep_forever()
            self.store.expire()
            self.check_memory()


async def serve(
    port: int,
    *,
    host: str = "127.0.0.1",
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a pinpriq server with a fresh store until cancelled."""
    await PinpriqServer().serve(port, host=host, task_status=task_status)
