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
* the reactor (``reactor.py``): a plain-TCP connection on the built-in store that waits for its
  next request waits in the server's one epoll, whose task serves each ready connection's chunk
  inline, the same way its reader would (``_serve_now``), without a task switch per request.
  The connection goes back to its reader for every other wait (a blocked session, output the
  kernel did not take, an incomplete frame and its timeout, auth, a close); TLS connections and
  a store in another process keep the reader for everything.
* one expiry task that sleeps until ``Broker.timer``, the earliest TTL deadline, lease deadline,
  end of a release delay or delayed packet's due time; a push or a lease with an earlier one
  moves the sleep's deadline forward instead of starting a timer of its own.
* waits the session asks for (a push while the memory cap is reached; output past its bound),
  during which that connection is not read: one connection waits, nothing is dropped.
* a frame timeout: a connection that has held an incomplete frame for ``frame_timeout`` seconds
  of reading is closed. The clock runs only while the server is reading that connection, so a
  client the server itself has paused (memory cap, output bound) is never timed out for it.
* a connection limit: connections beyond it are accepted and closed at once, with a log line.
* who may come in (decision 12): on a server with a token, a connection is read only as far as
  its first frame until it has authenticated; the broker's verdict ``Blocked.REJECTED`` (or no
  auth within the frame timeout, counted from the accept) closes it after ``REJECT_DELAY``
  seconds, with the reason logged. A server without a token is in protected mode unless told
  otherwise: it accepts and closes connections from any address but loopback.
* TLS: with an ``ssl.SSLContext`` every connection is a ``trio.SSLStream`` over the socket and
  goes through trio's stream API (``_TlsConnection``). Plain TCP keeps reading and writing the
  socket's file descriptor directly, which is the fast path; it pays nothing for TLS.
* the client memory budget (``client_memory.ClientMemory``): the incomplete frames and unsent
  output of all connections, counted where they linger, never per frame.
* with a log-backed store (``--data-dir``), the log's ordering rule: no byte of output (a
  reply or a delivery) is written to a socket before the journal says it is ``released``,
  that is, until every record sealed before it is stored as the fsync policy promises. The
  connections the reactor serves in one turn log into one open block and write nothing
  (``in_turn``); at the end of the turn (``end_turn``) the block is sealed and written with one
  ``pwrite`` (under ``always`` with fsyncs inline, fsynced too: ``Keeper.commit``), and then
  the turn's output is written. A connection served by its own task has the store seal and
  write what its batch logged right after the batch (``after_batch``). Output that must wait
  goes to the connection's writer task, which waits for the journal's keeper (fsyncs in a
  worker thread, so other connections are served meanwhile). Without a log none of this runs:
  ``journal`` is ``None``.

Memory held per connection is bounded: the decoder holds at most one frame plus one read, since
the reader decodes everything it has before reading again, and stops reading while it waits.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Container
from typing import cast

import trio

from pinpriq.auth import TOKEN_VARIABLE, is_loopback
from pinpriq.broker import DEFAULT_MAX_MEMORY, REJECT_DELAY, Blocked, Broker, Session
from pinpriq.client_memory import ClientMemory, default_budget
from pinpriq.leases import DEFAULT_LEASE_MS, DEFAULT_MAX_DELIVERIES
from pinpriq.packed import default_store
from pinpriq.persistence.journal import Journal
from pinpriq.persistence.keeper import Keeper
from pinpriq.persistence.packed_store import LogBacked, is_logged
from pinpriq.reactor import Reactor
from pinpriq.store_contract import BatchedStore, Deliveries, Store
from pinpriq.tls import describe_tls_error
from pinpriq.wire import (
    Ack,
    ClientFrame,
    DelayedPush,
    FrameDecoder,
    KeyedPayload,
    LeasedSubscribe,
    Pop,
    Push,
    Ready,
    Release,
    Reserve,
    Sync,
    Touch,
)

__all__ = [
    "DEFAULT_FRAME_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_MEMORY",
    "PinpriqServer",
    "peer_name",
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
#: ``_Connection._rest`` when ``_serve_now`` left no frames (never appended to).
_NO_FRAMES: list[ClientFrame] = []


#: Said when a server without a token refuses a connection from another host, and at start.
PROTECTED_MODE_FIX = (
    f"set a token for clients to present (--auth-token-file FILE, or the {TOKEN_VARIABLE} "
    f"environment variable: docker run -e {TOKEN_VARIABLE}=...), or start the server with "
    "--no-protected-mode to let clients from other hosts in without one"
)
#: The first byte of a TLS handshake: a TLS client on a port that speaks plain TCP.
_TLS_HANDSHAKE = 0x16
_TLS_HINT = (
    " (a TLS handshake? This port speaks plain TCP: connect without TLS, or start the server "
    "with --tls-cert and --tls-key)"
)


def _peer_address(stream: trio.SocketStream) -> tuple[str, int] | None:
    try:
        host, port, *_ = stream.socket.getpeername()
    except OSError:
        return None
    return host, port


def peer_name(stream: trio.SocketStream) -> str:
    """HOST:PORT of a client, as log lines name it (the admin listener's too)."""
    address = _peer_address(stream)
    if address is None:
        return "unknown peer"
    host, port = address
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
        #: What the connection reads and writes through when it waits: the socket's stream,
        #: or a TLS stream over it.
        self.stream: trio.abc.Stream = stream
        self.session = session
        self.peer = peer_name(stream)
        self.fileno = stream.socket.fileno()
        self.decoder = FrameDecoder()
        #: Seconds of reading left before an incomplete frame times out.
        self.frame_budget = server.frame_timeout
        #: Bytes of an incomplete frame and of unsent output, as last reported to the client
        #: memory budget (``PinpriqServer.hold_input``, ``hold_output``).
        self.held_input = 0
        self.held_output = 0
        #: The last read did not wait: the reader yields to the others once it has handled it.
        self.checkpoint_owed = False
        self.sending = False
        self.closed = False  # its socket is closed: never write to its file descriptor again
        #: The client has ended its stream (or reset it): the connection closes.
        self.at_end = False
        #: What ``_serve_now`` left of its chunk for ``_serve_rest``: the batch, and how many of
        #: its frames are applied.
        self._rest: list[ClientFrame] = _NO_FRAMES
        self._done = 0
        #: Frames handled so far, counted per batch; and why the connection ended (debug log).
        self.frames = 0
        self.close_reason = "closed by the client"
        self.reading = trio.CancelScope()  # cancelled to stop reading, as at shutdown
        # How a batch of frames reaches the store, the same two calls whatever the store:
        # ``_apply_now`` applies what it can without a wait and says how many frames it did,
        # ``_apply_rest`` awaits the rest. The built-in store applies a whole batch at once, in
        # this task (``Session.receive`` itself: the hot path pays no extra call); a store in
        # another process (``BatchedStore``) applies nothing before its answers.
        self._apply_now: Callable[[list[ClientFrame]], int] = (
            session.receive if server.batched is None else _nothing_at_once
        )
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
                if self.reading.cancelled_caught and self.server.stopping:
                    self.close_reason = "the server is shutting down"
            finally:
                # No deliveries to a connection that is going away (decision 7); its leases go
                # back, and may be delivered to other connections at once (decision 15).
                self.session.close()
                self.server.after_batch()
            with trio.move_on_after(CLOSE_FLUSH_SECONDS):
                await self._drain()
            nursery.cancel_scope.cancel()

    async def _read_loop(self) -> None:
        server, decoder, session = self.server, self.decoder, self.session
        while True:
            reactor = server.reactor
            if (
                reactor is not None
                and session.authenticated
                and not (decoder.pending or self.sending)
            ):
                # Nothing to do but wait for the next request: the reactor serves requests
                # until one needs this task (``serve_ready``), then hands the connection back.
                await reactor.park(self)
            else:
                data = await self._receive()
                if data is None:
                    await self._time_out()
                    return
                self._serve_now(data)
                # The decoder has the chunk now: no second reference across the next wait, so
                # that discarding the decoder (``evict``) frees it at once.
                del data
            if not await self._serve_rest():
                return
            if self.checkpoint_owed:
                self.checkpoint_owed = False
                await trio.lowlevel.checkpoint()

    async def _time_out(self) -> None:
        """Close the connection: its incomplete frame, or its auth, took too long."""
        timeout = self.server.frame_timeout
        if not self.session.authenticated:
            await self._reject(f"no auth within {timeout:g} s")
            return
        log.warning(
            "closing %s: an incomplete frame (%d bytes so far) for %g s of reading",
            self.peer,
            self.decoder.pending,
            timeout,
        )
        self.close_reason = "frame timeout"

    def serve_ready(self) -> bool:
        """The reactor's call, the socket being readable: read a chunk and serve it as far as it
        goes without a wait; whether the connection waits for its next request again."""
        try:
            data = os.read(self.fileno, RECEIVE_SIZE)
        except BlockingIOError:
            return True  # woken for nothing after all: still waiting
        except OSError:
            data = b""  # reset by the peer: the same as its end of stream, here
        server = self.server
        if server.keeper is not None:
            server.in_turn = True  # what this logs is sealed, and its output written, at the
            # end of the reactor's turn (``PinpriqServer.end_turn``)
        return self._serve_now(data)

    def _serve_now(self, data: bytes) -> bool:
        """Serve a chunk as far as it goes without a wait: decode its frames, apply them, write
        the output. ``True`` if that was all, and the connection waits for its next request;
        ``False`` if its task has more to do (``_serve_rest``): the frames a blocked session or
        a store in another process left, output the kernel did not take, a close, or the rest
        of an incomplete frame to read within the frame timeout. The one way a chunk is
        served, by the reactor or by the connection's own task."""
        server, decoder, session = self.server, self.decoder, self.session
        self._rest, self._done = _NO_FRAMES, 0
        if not data:
            self.at_end = True  # a frame cut short stays in the decoder and is dropped
            return False
        # Before auth, the next frame must be auth: judged at its first byte.
        if not (session.authenticated or decoder.pending or session.opens_with(data[0])):
            return False  # rejected, nothing applied: ``_serve_rest`` closes it
        decoder.feed(data)
        frames = decoder.decode()
        # Read once (nothing below feeds the decoder): from interpreted code each read of a
        # compiled object's attribute is a generic ``getattr``, ~150 instructions a request.
        pending = decoder.pending
        if frames:
            self.frame_budget = server.frame_timeout  # any incomplete frame is a new one
        if pending != self.held_input:
            server.hold_input(self, pending)
        done = self._apply_now(frames)
        # ``after_batch`` only if it has something to do (what it checks, read cheaply): a
        # delivery to write, the expiry timer to bring forward, a log block to write outside
        # a reactor turn. Before any await: no socket can close in between.
        if (
            server.dirty
            or server.broker.timer < server.expiry_at
            or (server.journal is not None and not server.in_turn)
        ):
            server.after_batch()
        self.frames += len(frames)
        # A frame ``receive`` refused or rejected is one it did not apply (``done`` says so),
        # and an unknown opcode stays in the decoder (``pending``): either way, and for any
        # wait, ``_serve_rest`` has the rest.
        if done < len(frames) or self.sending or pending:
            self._rest, self._done = frames, done
            return False
        return not session.output or self._wrote_all()

    async def _serve_rest(self) -> bool:
        """Do what ``_serve_now`` left of the last chunk (nothing, if it served it all);
        ``False`` if the connection is closing."""
        session = self.session
        frames, done = self._rest, self._done
        self._rest = _NO_FRAMES
        if self.at_end:
            return False
        if session.rejected is not None:
            await self._reject(session.rejected)
            return False
        waits = done < len(frames) and session.error is None
        if waits and not await self._apply_rest(frames, done):
            return False
        if self.sending:
            await self._backed_up()
        elif session.output and not self._wrote_all():
            await self._send_output()
        if session.error is not None:  # a frame broke decision 18
            log.warning("closing %s: %s", self.peer, session.error)
            self.close_reason = session.error
            return False
        error = self.decoder.error
        if error is not None:
            log.warning("closing %s: %s%s", self.peer, error, self._not_tls_hint())
            self.close_reason = f"protocol error: {error}"
            return False
        return True

    async def _apply_rest(self, frames: list[ClientFrame], done: int) -> bool:
        """Apply the part of a batch ``_apply_now`` left, from ``frames[done]``: on the built-in
        store, where a wait stopped it (``_apply_waiting``); on a store in another process, all
        of it (``_apply_batched``). ``False`` if the connection is closing."""
        if self.server.batched is None:
            return await self._apply_waiting(frames, done)
        return await self._apply_batched(frames, done)

    async def _apply_waiting(
        self,
        frames: list[ClientFrame],
        done: int,
        popped: deque[list[KeyedPayload]] | None = None,
    ) -> bool:
        """Apply ``frames[done:]``, the part of a batch ``receive`` stopped before, waiting for
        what the session is blocked on before each go (with ``popped``, what the frames' pops
        found, as ``receive`` takes it); ``False`` if the session was rejected (the connection
        is closing)."""
        session = self.session
        while done < len(frames) and session.error is None:
            if session.blocked is Blocked.REJECTED:
                await self._reject(session.rejected or "")
                return False
            await self._wait(session.blocked)
            done = session.receive(frames, done, popped)
            self.server.after_batch()
        return True

    async def _apply_batched(self, frames: list[ClientFrame], done: int) -> bool:
        """Apply a batch on a store that runs operations elsewhere (``BatchedStore``), of which
        nothing is ``done`` yet: in segments, each ending where a frame may cause a delivery
        here (a subscribe, a credit, a push to a queue someone here waits on) or needs the
        frames before it judged first (auth). Each segment's pushes and pops run in the store
        as one pipeline, then ``receive`` applies the segment with their results, then this
        front end's deliveries are made: so replies and deliveries keep the order the built-in
        store gives them."""
        store = self.server.batched
        assert store is not None
        subscriptions = self.server.deliveries
        session = self.session
        start = done
        while start < len(frames) and session.error is None:
            if frames[start].__class__ in _LEASE_FRAMES:
                if store.leases_unsupported:
                    # Closed like a frame that breaks decision 18: what came before is applied
                    # and answered, then the connection closes with a warning saying why.
                    session.error = store.leases_unsupported
                    break
                # Lease frames are segments of their own: their scripts run as one pipeline,
                # then ``receive`` answers from what they found.
                end = _lease_segment_end(frames, start, session)
                segment = frames[start:end]
                await store.run_leases(segment, session)  # answers in the lease table
                popped = None
            else:
                end = _segment_end(frames, start, session, subscriptions.waiting_queues)
                segment = frames[start:end]
                popped = await store.run(segment)
            done = session.receive(segment, 0, popped)
            self.server.after_batch()
            if not await self._apply_waiting(segment, done, popped):
                return False
            if subscriptions.due:
                await subscriptions.serve()
            start = end
        return True

    def _not_tls_hint(self) -> str:
        error = self.decoder.error
        if error is not None and error.offset == 0 and error.byte == _TLS_HANDSHAKE:
            return _TLS_HINT
        return ""

    def evict(self) -> None:
        """Close the connection for the client memory budget: drop its incomplete frame now,
        and stop reading it (what it is owed still goes out, as at any close)."""
        self.decoder.discard()
        self.held_input = 0
        self.close_reason = "closed for the client memory budget"
        self.reading.cancel()

    async def _reject(self, reason: str) -> None:
        """Close the connection after ``REJECT_DELAY`` seconds, reading nothing more; what it
        is owed already (replies before a wrong second auth) goes out meanwhile."""
        hint = _TLS_HINT if reason.startswith(f"byte 0x{_TLS_HANDSHAKE:02x}") else ""
        log.warning("closing %s in %g s: %s%s", self.peer, REJECT_DELAY, reason, hint)
        self.close_reason = f"rejected: {reason}"
        self._output_ready.set()
        await trio.sleep(REJECT_DELAY)

    async def _backed_up(self) -> None:
        """The writer could not hand everything to the kernel: count what this connection
        holds against the client budget, and while the budget is exceeded stop reading the
        connection (rather than close it: its output carries packets) until it drains."""
        self.server.hold_output(self, len(self.session.output) + self.session.unsent)
        if self.server.client_memory.over:
            await self._drain()

    async def _receive(self) -> bytes | None:
        """The next chunk from the client; ``b""`` at the end of its stream or on a reset;
        ``None`` if an incomplete frame (or, before auth, the connection) has used up its
        reading time.

        Reads the socket directly and waits on trio only when nothing has arrived: a client
        waiting for each reply (the common case at low load) costs one wait per request rather
        than trio's wait plus a checkpoint. When data was already there, it owes a checkpoint,
        which the read loop takes once it has handled the chunk, so a client that never stops
        sending cannot starve the others, and no chunk waits there uncounted by the client
        memory budget (a thousand of them would be 64 MiB).
        """
        fileno = self.fileno
        try:
            data = os.read(fileno, RECEIVE_SIZE)
        except BlockingIOError:
            pass
        except OSError:
            return b""  # reset by the peer: the same as its end of stream, here
        else:
            self.checkpoint_owed = True
            return data
        if self.decoder.pending or not self.session.authenticated:
            return await self._receive_waiting()
        # Between frames: a client may be idle for ever, once it has authenticated. The wait is
        # inline (not ``_wait_and_read``): at pipeline 1 this runs once a request, and each
        # coroutine frame on the way to trio's wait costs as much as a store operation.
        while True:
            await trio.lowlevel.wait_readable(fileno)
            try:
                return os.read(fileno, RECEIVE_SIZE)
            except BlockingIOError:
                continue
            except OSError:
                return b""

    async def _receive_waiting(self) -> bytes | None:
        """``_receive`` once nothing is there to read at once: wait, within the time left."""
        if not self.decoder.pending and self.session.authenticated:
            # Between frames: a client may be idle for ever, once it has authenticated.
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

    def _wrote_all(self) -> bool:
        """Hand a batch's output to the kernel directly, with no coroutine or event, when the
        log holds nothing back (no log, or ``released``: ``after_batch`` has sealed and written
        the batch's records, and under ``always`` they are synced too, which is the only case
        that waits); whether it took everything, or, in a reactor turn, left it to the turn's
        end (``PinpriqServer.end_turn``). If not, the read loop awaits the rest
        (``_send_output``), which is what stops it reading from a client that does not read
        its replies."""
        server = self.server
        journal = server.journal
        if journal is not None:
            if server.in_turn:
                server.owed.append(self)
                return True
            if not journal.released:
                return False
        session = self.session
        output = session.output
        try:
            sent = os.write(self.fileno, output)  # ``_send_now``, inline: once a request at -P 1
        except OSError:
            return False  # _send_output meets the same error (or waits) and says it
        del output[:sent]
        if output:
            return False
        session.output_drained()
        return True

    def write_pending(self) -> None:
        """Write what is pending straight to the socket, if nobody is sending; leave what the
        kernel does not take to the writer task."""
        session = self.session
        if self.closed or not session.output:
            return
        if self.sending:  # deliveries pile up behind a slow write: they count, and may pause
            self.server.hold_output(self, len(session.output) + session.unsent)
            return
        server = self.server
        journal = server.journal
        if journal is not None:
            if server.in_turn:
                server.owed.append(self)  # written at the turn's end, after its log block
                return
            if not journal.released:
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
                    self.server.hold_output(self, session.unsent)
                    await self.stream.send_all(memoryview(data)[sent:])
                    session.unsent = 0
                session.output_drained()
        finally:
            self.sending = False
            if self.held_output:
                self.server.hold_output(self, 0)
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


_LEASE_FRAMES = frozenset({Reserve, Ack, Release, Touch, LeasedSubscribe})


def _nothing_at_once(frames: list[ClientFrame]) -> int:
    """``_apply_now`` on a store in another process: no frame applies before its answers."""
    return 0


#: Most lease frames one pipeline of lease scripts carries.
_LEASE_PIPELINE = 256


def _lease_segment_end(frames: list[ClientFrame], start: int, session: Session) -> int:
    """Where the run of lease frames starting at ``start`` ends (see ``_apply_batched``): lease
    frames only; an ack or touch after one reserve shares its pipeline (the id it names is a
    lease made before, the one that reserve makes, for which the store sends the reserve's
    handle, or none), but not after two (which lease an id names then depends on what they
    find); a release ends it (the group it sends back is offered to this front end's waiters
    before the next frame, as on the built-in store); a reserve on a leased connection
    (refused, decision 18) and a leased subscribe stand alone."""
    if not session.authenticated or frames[start].__class__ is LeasedSubscribe:
        return start + 1
    reserves = 0
    stop = min(len(frames), start + _LEASE_PIPELINE)
    for index in range(start, stop):
        kind = frames[index].__class__
        if kind is Reserve:
            if session.leased:
                return max(index, start + 1)
            reserves += 1
        elif kind is Ack or kind is Touch:
            if reserves > 1:
                return index
        elif kind is Release:
            return index if reserves else index + 1
        else:
            return index
    return stop


def _segment_end(
    frames: list[ClientFrame], start: int, session: Session, waited: Container[bytes]
) -> int:
    """Where the segment of ``frames`` starting at ``start`` ends (see ``_apply_batched``)."""
    if not session.authenticated:
        return start + 1  # nothing runs before auth is judged
    for index in range(start, len(frames)):
        frame = frames[index]
        kind = frame.__class__
        if kind is Push:
            push = cast(Push, frame)
            if push.prio and push.queue in waited:
                return index + 1
        elif kind in _LEASE_FRAMES:
            return index  # judged at the start of the next segment
        elif kind is Ready:
            # Credits in a row deliver what they would one by one: one segment, one serve.
            if index + 1 == len(frames) or frames[index + 1].__class__ is not Ready:
                return index + 1
        elif kind is not Pop and kind is not Sync and kind is not DelayedPush:
            return index + 1  # a delayed packet delivers nothing now: it is not a cut
    return len(frames)


class _TlsConnection(_Connection):
    """A connection over TLS: trio's ``SSLStream`` over the socket, read and written through
    the stream API only (the file descriptor carries ciphertext). Its replies and deliveries
    all go through the writer task, since encrypting and sending is a wait; everything else,
    limits and accounting included, is ``_Connection``'s."""

    def __init__(
        self,
        server: PinpriqServer,
        stream: trio.SocketStream,
        session: Session,
        context: ssl.SSLContext,
    ) -> None:
        super().__init__(server, stream, session)
        self.socket = stream.socket
        self.tls = trio.SSLStream(stream, context, server_side=True)
        self.stream = self.tls

    async def run(self) -> None:
        """Shake hands within the frame timeout (counted against auth's time, which starts at
        the accept), log one line if that fails, then serve."""
        started = trio.current_time()
        failure = None
        with trio.move_on_after(self.frame_budget) as waited:
            failure = await self._not_tls()
            if failure is None:
                try:
                    await self.tls.do_handshake()
                except trio.BrokenResourceError as error:
                    failure = f"TLS handshake failed: {describe_tls_error(error)}"
        if waited.cancelled_caught:
            failure = f"no TLS handshake within {self.server.frame_timeout:g} s"
        if failure is not None:
            log.warning("closing %s: %s", self.peer, failure)
            self.session.close()
            return
        if not self.session.authenticated:
            self.frame_budget -= trio.current_time() - started
        await super().run()

    async def _not_tls(self) -> str | None:
        """Why the client is not starting a TLS handshake, judged by its first byte (peeked,
        not read), or ``None``. A plain pinpriq frame can be shorter than the five bytes of a
        TLS record header, and OpenSSL would wait for the rest until the timeout."""
        try:
            first = await self.socket.recv(1, socket.MSG_PEEK)
        except OSError:
            return None  # the handshake meets the same error and says it
        if not first or first[0] == _TLS_HANDSHAKE:
            return None
        return (
            f"the client does not speak TLS (its first byte is 0x{first[0]:02x}, not a TLS "
            "handshake); this port speaks TLS only"
        )

    async def _receive(self) -> bytes | None:
        return await self._receive_waiting()

    async def _wait_and_read(self) -> bytes:
        try:
            data = await self.tls.receive_some(RECEIVE_SIZE)
            return data if isinstance(data, bytes) else bytes(data)  # it is bytes: ssl reads
        except trio.BrokenResourceError:
            return b""  # a reset, or an end without TLS's close_notify: an end all the same

    def _send_now(self, data: bytearray) -> int:
        return 0  # nothing can be written without a wait: the writer task sends it all

    def _wrote_all(self) -> bool:
        return False  # likewise: ``_send_output`` encrypts and sends it


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
        protected_mode: bool = True,
        tls: ssl.SSLContext | None = None,
        max_client_memory: int | None = None,
        lease_default_ms: int = DEFAULT_LEASE_MS,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        deliveries: Deliveries | None = None,
    ) -> None:
        """``store`` defaults to the in-memory store on trio's clock (``packed.default_store``:
        the packed store where its C core is built, else ``QueueStore``). ``max_memory``
        caps ``store.bytes_held`` (0 for no cap); ``max_connections`` caps concurrent
        connections (further ones are accepted and closed at once); ``frame_timeout`` is how
        many seconds of reading a connection may hold an incomplete frame, and, on a server
        with a token, how long a new connection has to authenticate; ``token`` is the one
        token clients must present first (``auth.load_token``), ``None`` for none; without a
        token, ``protected_mode`` refuses connections from other hosts than this one; ``tls``
        (``tls.server_context``) makes every connection TLS; ``max_client_memory`` caps the
        bytes of incomplete frames and unsent output of all connections together (0 for no
        cap; ``None`` for ``client_memory.default_budget(max_memory)``); ``lease_default_ms``
        is the lease time of lease frames that say 0, and a group goes to its dead-letter queue
        after ``max_deliveries`` attempts (0: never). A ``BatchedStore`` (the Redis store) comes
        with its ``deliveries``, the subscriptions that deliver from it."""
        self.broker = Broker(
            store if store is not None else default_store(trio.current_time),
            max_memory=max_memory,
            token=token,
            lease_default_ms=lease_default_ms,
            max_deliveries=max_deliveries,
        )
        self.broker.on_room = self._room_freed
        #: ``broker.dirty``, the same list for the broker's life: read here, a plain list's
        #: truth, where the compiled broker's attribute is a ``getattr``.
        self.dirty = self.broker.dirty
        #: A store that runs operations in another process (Redis), and the subscriptions that
        #: deliver from it; ``None`` for the built-in store, whose path pays one test a batch.
        self.batched = store if isinstance(store, BatchedStore) else None
        if self.batched is not None:
            if deliveries is None:
                raise ValueError("a batched store needs its deliveries (subscriptions)")
            self.deliveries = deliveries
            self.broker.subscriptions = deliveries  # type: ignore[assignment]
            deliveries.flush = self.after_batch
            # Its lease table lives in the store too: the broker gets the front end's half.
            self.broker.leases = self.batched.make_leases(
                default_ms=lease_default_ms, max_deliveries=max_deliveries
            )
        store = self.broker.store
        #: The log of a server that keeps packets on disk, and what waits on it; ``None``
        #: for a memory-only server.
        self.journal: Journal | None = None
        self.keeper: Keeper | None = None
        self._logged: LogBacked | None = None
        if is_logged(store):
            self._logged = store
            self.journal = store.journal
            self.keeper = Keeper(store.journal)
            store.journal.on_disk_full = self.broker.set_disk_full
            store.journal.recovering = True  # until ``serve`` has recovered the log
        self.max_connections = max_connections
        self.frame_timeout = frame_timeout
        self.token = token
        self.protected_mode = protected_mode and token is None
        self.tls = tls
        if max_client_memory is None:
            max_client_memory = default_budget(max_memory)
        self.client_memory: ClientMemory[_Connection] = ClientMemory(max_client_memory)
        self._memory_freed = trio.Event()
        self._connections: dict[Session, _Connection] = {}
        self._all_closed = trio.Event()  # set when the last connection closes after shutdown
        self._expiry_scope = trio.CancelScope()
        #: The expiry scope's deadline, as a plain float: trio's ``CancelScope.deadline`` is a
        #: property, a Python call that ``_serve_now`` would pay every batch to read it.
        self.expiry_at = math.inf
        self._accepting = trio.CancelScope()
        self._listening = False
        #: Where plain-TCP connections on the built-in store wait for their next request
        #: (``reactor.py``), while ``serve`` runs; ``None`` with TLS or a batched store, whose
        #: connections each wait in their own task.
        self.reactor: Reactor | None = None
        #: With a log: whether the reactor is serving a turn, whose log block is sealed and
        #: whose output is written at its end (``end_turn``); the connections it owes output.
        self.in_turn = False
        self.owed: list[_Connection] = []

    @property
    def recovering(self) -> bool:
        """Whether the server is still reading its log back (``/readyz`` says not ready)."""
        return self.journal is not None and self.journal.recovering

    def flush_log(self) -> None:
        """Seal and write what the store logged since the last call; nothing without a log."""
        if self._logged is not None:
            self._logged.flush()

    async def log_stored(self) -> None:
        """Return once what the store logged so far (an admin purge's removals) is stored as
        the fsync policy promises: written, and under ``always`` fsynced. At once without a
        log."""
        if self.keeper is not None:
            self.flush_log()
            await self.keeper.wait_released()

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._connections)

    def peers(self) -> list[tuple[str, Session]]:
        """Each connection being served: its peer (HOST:PORT, as the log names it) and its
        protocol state, for the admin listener to read, never to change. O(connections)."""
        return [(conn.peer, session) for session, conn in self._connections.items()]

    def after_batch(self) -> None:
        """Called by a connection's reader right after ``Session.receive``, with no await in
        between: moves the expiry timer forward if a push needs it, and writes the deliveries
        the batch made to their connections' sockets, so a delivery reaches its subscriber
        before the pusher's next frame is read and no connection in the list can have closed
        meanwhile. Outside a reactor turn, writes what the batch logged first. ``_serve_now``
        calls it only when one of these has something to do."""
        broker = self.broker
        # In a reactor turn nothing is written yet: the turn's end seals its block.
        logged = None if self.in_turn else self._logged
        if logged is not None:
            logged.flush()
        if broker.timer < self.expiry_at:
            self.expiry_at = self._expiry_scope.deadline = broker.timer
        while self.dirty:
            for session in broker.take_dirty():
                # Writing may resume a paused subscriber, which may deliver again.
                self._connections[session].write_pending()
            if logged is not None:
                logged.flush()  # what those deliveries popped, before they are written

    def end_turn(self) -> None:
        """The reactor's hook after each turn: seal and write the block the turn's connections
        logged, one ``pwrite`` (and under ``always`` with fsyncs inline, one ``fdatasync``:
        ``Keeper.commit``), then write the output the turn made; what the log still holds
        back goes to the connections' writer tasks (``write_pending``)."""
        if not self.in_turn:
            return
        self.in_turn = False
        logged, keeper = self._logged, self.keeper
        assert logged is not None
        assert keeper is not None
        keeper.commit(logged.flush)
        owed = self.owed
        for conn in owed:
            conn.write_pending()
        owed.clear()
        if self.dirty:
            self.after_batch()  # the writes resumed a paused subscriber, which delivered

    def hold_input(self, conn: _Connection, size: int) -> None:
        """``conn``'s decoder now holds ``size`` bytes of an incomplete frame; past the client
        budget, close the connections holding the largest ones."""
        grew = size > conn.held_input
        conn.held_input = size
        memory = self.client_memory
        memory.hold_input(conn, size)
        if grew and memory.over:
            self._close_largest()

    def hold_output(self, conn: _Connection, size: int) -> None:
        """``conn`` now holds ``size`` bytes of output the kernel has not taken. Past the client
        budget, the connections holding output are paused (no deliveries, and their readers
        stop) rather than closed, and those holding incomplete frames are closed."""
        grew = size > conn.held_output
        conn.held_output = size
        memory = self.client_memory
        memory.hold_output(conn, size)
        if grew and memory.over:
            if not conn.session.paused:  # resumed by output_drained, once its client reads
                self.broker.subscriptions.pause(conn.session)
            self._close_largest()

    def _close_largest(self) -> None:
        memory = self.client_memory
        held, held_input, held_output = memory.held, memory.input, memory.output
        chosen = memory.to_close()
        if not chosen:
            return
        names = [f"{conn.peer} ({size} bytes)" for conn, size in chosen[:5]]
        more = f" and {len(chosen) - 5} more" if len(chosen) > 5 else ""
        log.warning(
            "client memory over its budget (%d bytes held: %d in incomplete frames, %d in "
            "unsent output; --max-client-memory %d): closing %d connections holding the "
            "largest incomplete frames: %s%s",
            held,
            held_input,
            held_output,
            memory.budget,
            len(chosen),
            ", ".join(names),
            more,
        )
        for conn, _ in chosen:
            conn.evict()

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
        # Recovery makes a few objects per packet, millions of them, long-lived and in no
        # cycle: the cyclic collector's passes over them while they are made cost a tenth of
        # recovery's instructions and find nothing, so it pauses, and then they are frozen out
        # of its later passes (as pinpriq-server freezes what exists after its start-up). What
        # is garbage before is collected first, so that nothing unreachable is frozen.
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            await trio.to_thread.run_sync(self._logged.recover, now, now_ms)
        finally:
            gc.freeze()
            if collecting:
                gc.enable()
        self.broker.expire()  # sets the expiry timer for the restored packets
        self.broker.check_memory()

    async def _serve(
        self, port: int, host: str, task_status: trio.TaskStatus[list[trio.SocketListener]]
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        if self.tls is None and self.batched is None:
            self.reactor = Reactor(self.end_turn if self.keeper is not None else None)
        try:
            await self._serve_listeners(listeners, task_status)
        finally:
            if self.reactor is not None:
                self.reactor.close()  # every task that parked there has ended
                self.reactor = None

    async def _serve_listeners(
        self,
        listeners: list[trio.SocketListener],
        task_status: trio.TaskStatus[list[trio.SocketListener]],
    ) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._expire_loop)
            if self.reactor is not None:
                nursery.start_soon(self.reactor.run)
            if self.keeper is not None:
                nursery.start_soon(self.keeper.run)
            for listener in listeners:
                address = listener.socket.getsockname()
                log.info(
                    "pinpriq listening on %s port %d%s",
                    address[0],
                    address[1],
                    " (TLS)" if self.tls is not None else "",
                )
            budget = self.client_memory.budget
            log.info(
                "client memory budget %s (incomplete frames and unsent output, all connections)",
                f"{budget:.0f} bytes" if budget != math.inf else "none",
            )
            if self.protected_mode and not all(
                is_loopback(listener.socket.getsockname()[0]) for listener in listeners
            ):
                log.warning(
                    "protected mode: this server has no token, so it refuses connections from "
                    "other hosts than this one; to let them in, %s",
                    PROTECTED_MODE_FIX,
                )
            self._listening = True
            task_status.started(listeners)
            with self._accepting:
                # serve_listeners closes the listeners when cancelled, and outlives a lack of
                # file descriptors by pausing accepts rather than failing.
                await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)
            if self._connections:
                await self._all_closed.wait()
            nursery.cancel_scope.cancel()

    @property
    def ready(self) -> bool:
        """Whether clients are being served: listening, and not shutting down. A full server is
        ready: consumers must reach it to drain it."""
        return self._listening and not self.stopping

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
        reason = None
        if self.stopping:
            reason = "shutting down"
        elif len(self._connections) >= self.max_connections:
            reason = f"at the connection limit, {len(self._connections)} open"
        elif self.protected_mode:
            address = _peer_address(stream)
            if address is not None and not is_loopback(address[0]):
                reason = (
                    "protected mode: this server has no token and the client is not on this "
                    f"host; {PROTECTED_MODE_FIX}"
                )
        if reason is not None:
            log.warning("refusing a connection from %s: %s", peer_name(stream), reason)
            await trio.aclose_forcefully(stream)
            return
        session = self.broker.open_session()
        if self.tls is None:
            conn = _Connection(self, stream, session)
        else:
            conn = _TlsConnection(self, stream, session, self.tls)
        self._connections[session] = conn
        log.debug("connection from %s", conn.peer)
        try:
            await conn.run()
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            conn.close_reason = "the connection broke"
        except* Exception:
            # A bug in handling one connection must not take the others down.
            log.exception("error serving %s; closing its connection", conn.peer)
            conn.close_reason = "an error (logged above)"
        finally:
            log.debug(
                "connection from %s closed: %s; %d frames handled",
                conn.peer,
                conn.close_reason,
                conn.frames,
            )
            del self._connections[session]
            session.close()
            self.client_memory.release(conn)
            conn.closed = True
            await trio.aclose_forcefully(stream)
            if not self._connections and self.stopping:
                self._all_closed.set()

    async def _expire_loop(self) -> None:
        """Sweep expired packets, let delayed packets in and end leases at the earliest
        deadline, and only then (decisions 1, 15 and 21); write the deliveries of packets that
        came back or fell due."""
        while True:
            self.expiry_at = self.broker.timer
            with trio.CancelScope(deadline=self.expiry_at) as self._expiry_scope:
                await trio.sleep_forever()
            self.broker.expire()
            self.after_batch()


async def serve(
    port: int,
    *,
    host: str = "127.0.0.1",
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a pinpriq server with a fresh in-memory store until cancelled."""
    await PinpriqServer().serve(port, host=host, task_status=task_status)
