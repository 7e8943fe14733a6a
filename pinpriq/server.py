"""The Trio server: sockets, tasks and timers around the I/O-free broker.

The broker (``broker.py``) decides what every frame does and what each client is owed; this
module moves bytes and keeps time, the way hypercorn's ``TCPServer`` drives an I/O-free protocol
object. It owns only what needs an event loop or a limit:

* one reader and one writer task per connection. The reader reads the socket, decodes every
  complete frame of the chunk, hands them to the connection's ``Session`` at once and writes the
  session's output with one write. It then writes the output of every session the batch gave
  deliveries to, before reading again, so a delivery reaches its subscriber's socket before the
  pusher's next frame is read. Whatever the kernel does not take at once is left to the
  connection's writer task, so a subscriber that stops reading blocks only its own writer, never
  the pusher or the server.
* one expiry task that sleeps until ``Broker.timer``, the earliest TTL deadline; a push with an
  earlier deadline moves the sleep's deadline forward instead of starting a timer of its own.
* waits the session asks for (a push while the memory cap is reached; output past its bound),
  during which that connection is not read: one connection waits, nothing is dropped.
* a frame timeout: a connection that has held an incomplete frame for ``frame_timeout`` seconds
  of reading is closed. The clock runs only while the server is reading that connection, so a
  client the server itself has paused (memory cap, output bound) is never timed out for it.
* a connection limit: connections beyond it are accepted and closed at once, with a log line.
* with a log-backed store (``--data-dir``), the log's ordering rule: after each batch the
  driver has the store seal and write what the batch logged (``LoggedStore.flush``), and no
  byte of output (a reply or a delivery) is written to a socket before the journal says it is
  ``released``, that is, until every record sealed before it is stored as the fsync policy
  promises; output that must wait goes to the connection's writer task, which waits for the
  journal's keeper (fsyncs run in a worker thread, so other connections are served meanwhile).
  Without a log none of this runs: ``journal`` is ``None``.

Memory held per connection is bounded: the decoder holds at most one frame plus one read, since
the reader decodes everything it has before reading again, and stops reading while it waits.
"""

from __future__ import annotations

import logging
import os
import time

import trio

from pinpriq.broker import DEFAULT_MAX_MEMORY, Blocked, Broker, Session
from pinpriq.persistence.journal import Journal
from pinpriq.persistence.keeper import Keeper
from pinpriq.persistence.store import LoggedStore
from pinpriq.store import QueueStore
from pinpriq.store_contract import Store
from pinpriq.wire import FrameDecoder

__all__ = [
    "DEFAULT_FRAME_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_MEMORY",
    "PinpriqServer",
    "serve",
]

log = logging.getLogger("pinpriq.server")

#: Bytes asked of the socket per read.
RECEIVE_SIZE = 65536
#: How long a closing connection may take to flush replies it was already owed.
CLOSE_FLUSH_SECONDS = 1.0
DEFAULT_MAX_CONNECTIONS = 4096
#: Seconds of reading a connection may spend holding an incomplete frame before it is closed.
DEFAULT_FRAME_TIMEOUT = 30.0


def _peer_name(stream: trio.SocketStream) -> str:
    try:
        host, port, *_ = stream.socket.getpeername()
    except OSError:
        return "unknown peer"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Connection:
    """One client's socket, decoder and tasks, around its ``Session``.

    Its own replies are sent by its reader, inline, after each batch: that costs no task switch,
    and a client that does not read its replies stops being read. Deliveries caused by another
    connection's push are written by that connection's reader at the end of its batch, straight
    to this socket if the kernel takes them; what it does not take is left to this connection's
    writer task, so a subscriber that does not read never holds the pusher up. Only one task
    sends on a connection at a time, and whoever sends sends everything pending.
    """

    def __init__(self, server: PinpriqServer, stream: trio.SocketStream, session: Session) -> None:
        self.server = server
        self.stream = stream
        self.session = session
        self.peer = _peer_name(stream)
        self.fileno = stream.socket.fileno()
        self.decoder = FrameDecoder()
        #: Seconds of reading left before an incomplete frame times out.
        self.frame_budget = server.frame_timeout
        self.sending = False
        self.closed = False  # its socket is closed: never write to its file descriptor again
        self.reading = trio.CancelScope()  # cancelled to stop reading, as at shutdown
        self._output_ready = trio.Event()
        self._output_drained = trio.Event()

    async def run(self) -> None:
        """Serve until the client closes, sends garbage, times out, the socket breaks, or the
        server stops reading; then flush what the client is owed, briefly, and return."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write_loop)
            try:
                with self.reading:
                    await self._read_loop()
            finally:
                # No deliveries to a connection that is going away (decision 7).
                self.session.close()
            with trio.move_on_after(CLOSE_FLUSH_SECONDS):
                await self._drain()
            nursery.cancel_scope.cancel()

    async def _read_loop(self) -> None:
        server, decoder, session = self.server, self.decoder, self.session
        while True:
            data = await self._receive()
            if data is None:
                log.warning(
                    "closing %s: an incomplete frame (%d bytes so far) for %g s of reading",
                    self.peer,
                    decoder.pending,
                    server.frame_timeout,
                )
                return
            if not data:
                return  # EOF; a frame cut short stays in the decoder and is dropped
            decoder.feed(data)
            frames = decoder.decode()
            if frames:
                self.frame_budget = server.frame_timeout  # any incomplete frame is a new one
            done = session.receive(frames)
            server.after_batch()  # before any await: no socket can close in between
            while done < len(frames):
                await self._wait(session.blocked)
                done = session.receive(frames, done)
                server.after_batch()
            if session.output and not self.sending:
                await self._send_output()
            if decoder.error is not None:
                log.warning("closing %s: %s", self.peer, decoder.error)
                return

    async def _receive(self) -> bytes | None:
        """The next chunk from the client; ``b""`` at the end of its stream or on a reset;
        ``None`` if an incomplete frame has used up its reading time.

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
        if not self.decoder.pending:  # between frames: a client may be idle for ever
            return await self._wait_and_read()
        started = trio.current_time()
        chunk: bytes | None = None
        with trio.move_on_after(self.frame_budget):
            chunk = await self._wait_and_read()
        self.frame_budget -= trio.current_time() - started
        return chunk if self.frame_budget > 0 else None

    async def _wait_and_read(self) -> bytes:
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
        session = self.session
        if self.closed or self.sending or not session.output:
            return
        journal = self.server.journal
        if journal is not None and not journal.released:
            self._output_ready.set()  # the writer task waits for the log, then writes
            return
        try:
            sent = self._send_now(session.output)
        except trio.BrokenResourceError:
            sent = 0  # the writer will meet the same error and close the connection
        del session.output[:sent]
        if session.output:
            self._output_ready.set()
        else:
            session.output_drained()

    async def _wait(self, blocked: Blocked | None) -> None:
        """Wait until the frame ``receive`` stopped at may go: a push until the broker has room,
        anything else until the output has drained. The replies so far go out meanwhile."""
        if blocked is Blocked.MEMORY:
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
        session = self.session
        journal = self.server.journal
        self.sending = True
        try:
            while session.output:
                if journal is None:
                    data, session.output = session.output, bytearray()
                else:
                    data = await self._released_output(journal)
                sent = self._send_now(data)
                if sent < len(data):
                    session.unsent = len(data) - sent
                    await self.stream.send_all(memoryview(data)[sent:])
                    session.unsent = 0
                session.output_drained()
        finally:
            self.sending = False
        self._output_drained.set()
        self._output_drained = trio.Event()

    async def _released_output(self, journal: Journal) -> bytearray:
        """Take the output the log lets out: what is pending now, once every record sealed
        before it is stored as the fsync policy promises (what arrives meanwhile waits for
        the next round)."""
        self.server.flush_log()  # a resumed subscriber's deliveries may have logged pops
        session = self.session
        if not journal.released:
            count = len(session.output)
            assert self.server.keeper is not None
            await self.server.keeper.wait_released()
            if count < len(session.output):
                data = session.output[:count]
                del session.output[:count]
                return data
        data, session.output = session.output, bytearray()
        return data

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
        while self.session.output or self.sending:
            await self._output_drained.wait()


class PinpriqServer:
    """A broker, the connections that use it, and the limits that need a clock or a socket."""

    def __init__(
        self,
        store: Store | None = None,
        *,
        max_memory: int = DEFAULT_MAX_MEMORY,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        frame_timeout: float = DEFAULT_FRAME_TIMEOUT,
        token: bytes | None = None,
    ) -> None:
        """``store`` defaults to an in-memory ``QueueStore`` on trio's clock. ``max_memory``
        caps ``store.bytes_held`` (0 for no cap); ``max_connections`` caps concurrent
        connections (further ones are accepted and closed at once); ``frame_timeout`` is how
        many seconds of reading a connection may hold an incomplete frame; ``token`` is the one
        token clients must present (``auth.load_token``), ``None`` for none."""
        self.broker = Broker(
            store if store is not None else QueueStore(trio.current_time), max_memory=max_memory
        )
        self.broker.on_room = self._room_freed
        store = self.broker.store
        #: The log of a server that keeps packets on disk, and what waits on it; ``None``
        #: for a memory-only server.
        self.journal: Journal | None = None
        self.keeper: Keeper | None = None
        self._logged: LoggedStore | None = None
        if isinstance(store, LoggedStore):
            self._logged = store
            self.journal = store.journal
            self.keeper = Keeper(store.journal)
            store.journal.on_disk_full = self.broker.set_disk_full
            store.journal.recovering = True  # until ``serve`` has recovered the log
        self.max_connections = max_connections
        self.frame_timeout = frame_timeout
        self.token = token
        self._memory_freed = trio.Event()
        self._connections: dict[Session, _Connection] = {}
        self._all_closed = trio.Event()  # set when the last connection closes after shutdown
        self._expiry_scope = trio.CancelScope()
        self._accepting = trio.CancelScope()

    @property
    def recovering(self) -> bool:
        """Whether the server is still reading its log back (``/readyz`` says not ready)."""
        return self.journal is not None and self.journal.recovering

    def flush_log(self) -> None:
        """Seal and write what the store logged since the last call; nothing without a log."""
        if self._logged is not None:
            self._logged.flush()

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._connections)

    def after_batch(self) -> None:
        """Called by a connection's reader right after ``Session.receive``, with no await in
        between: moves the expiry timer forward if a push needs it, and writes the deliveries
        the batch made to their connections' sockets, so a delivery reaches its subscriber
        before the pusher's next frame is read and no connection in the list can have closed
        meanwhile."""
        broker = self.broker
        logged = self._logged
        if logged is not None:
            logged.flush()
        if broker.timer < self._expiry_scope.deadline:
            self._expiry_scope.deadline = broker.timer
        while broker.dirty:
            for session in broker.take_dirty():
                # Writing may resume a paused subscriber, which may deliver again.
                self._connections[session].write_pending()
            if logged is not None:
                logged.flush()  # what those deliveries popped, before they are written

    def _room_freed(self) -> None:
        self._memory_freed.set()
        self._memory_freed = trio.Event()

    async def wait_for_memory(self) -> None:
        """Return once the broker has room for pushes again."""
        while self.broker.memory_full:
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
        try:
            if self._logged is not None:
                await self._recover()
            await self._serve(port, host, task_status)
        finally:
            if self._logged is not None:
                self._logged.close()

    async def _recover(self) -> None:
        """Read the log back before listening, in a worker thread, so that other tasks (an
        admin listener saying "recovering") keep running meanwhile."""
        assert self._logged is not None
        now, now_ms = trio.current_time(), time.time_ns() // 1_000_000
        await trio.to_thread.run_sync(self._logged.recover, now, now_ms)
        self.broker.expire()  # sets the expiry timer for the restored packets
        self.broker.check_memory()

    async def _serve(
        self, port: int, host: str, task_status: trio.TaskStatus[list[trio.SocketListener]]
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._expire_loop)
            if self.keeper is not None:
                nursery.start_soon(self.keeper.run)
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
        for conn in self._connections.values():
            conn.reading.cancel()

    async def _handle(self, stream: trio.SocketStream) -> None:
        if self.stopping or len(self._connections) >= self.max_connections:
            if self.stopping:
                reason = "shutting down"
            else:
                reason = f"at the connection limit, {len(self._connections)} open"
            log.warning("refusing a connection from %s: %s", _peer_name(stream), reason)
            await trio.aclose_forcefully(stream)
            return
        session = self.broker.open_session()
        conn = _Connection(self, stream, session)
        self._connections[session] = conn
        log.debug("connection from %s", conn.peer)
        try:
            await conn.run()
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            log.debug("connection from %s broke", conn.peer)
        except* Exception:
            # A bug in handling one connection must not take the others down.
            log.exception("error serving %s; closing its connection", conn.peer)
        finally:
            del self._connections[session]
            session.close()
            conn.closed = True
            await trio.aclose_forcefully(stream)
            if not self._connections and self.stopping:
                self._all_closed.set()

    async def _expire_loop(self) -> None:
        """Sweep expired packets at the earliest deadline, and only then (decision 1)."""
        while True:
            with trio.CancelScope(deadline=self.broker.timer) as self._expiry_scope:
                await trio.sleep_forever()
            self.broker.expire()
            self.flush_log()


async def serve(
    port: int,
    *,
    host: str = "127.0.0.1",
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a pinpriq server with a fresh in-memory store until cancelled."""
    await PinpriqServer().serve(port, host=host, task_status=task_status)
