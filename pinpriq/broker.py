"""The broker: what a pinpriq server does with frames, without any I/O.

This is the h11 move one level up from the codec. ``wire`` turns bytes into frames; this module
turns frames into effects on the queues and into the bytes each client is owed; the Trio server
(``server.py``) only reads sockets, writes sockets, waits and keeps time. Nothing here imports
trio or socket, so a test can drive whole conversations with no event loop, and the same broker
can sit behind another driver.

* A ``Broker`` owns what every connection shares: the store (any ``store_contract.Store``), the
  subscriptions, the memory cap and the counters an operator reads.
* A ``Session`` is one connection's protocol state: its subscriptions and credits (it is the
  ``Subscriber``), and ``output``, the bytes owed to its client. ``receive(frames)`` applies
  decoded frames in order and appends their replies to ``output``.

Theory of operation, as the driver sees it:

* **Batches.** The driver decodes every complete frame of a received chunk and passes them to
  ``receive`` at once, then writes ``output`` with one send. ``receive`` returns how many frames
  it applied: all, or fewer when the next one must wait, with the reason in ``blocked``: a push
  while the memory cap is reached (``Blocked.MEMORY``: wait until the broker calls ``on_room``)
  or a client whose unread output passed ``OUTPUT_HIGH_WATER`` (``Blocked.OUTPUT``: wait until
  the driver has written it). The driver waits, then calls ``receive`` with the rest. On a
  store whose operations run in another process (``store_contract.BatchedStore``), the driver
  runs a batch's pushes and pops there first and passes the pops' results with the frames
  (``receive(frames, start, popped)``): the broker then answers each pop from them, in order.
* **Deliveries.** A push may deliver to any session, this one included. A delivery's bytes go
  to that session's ``output`` (on the packed store written by the store itself, as a pop
  frame's reply is) and ``Session.deliver`` files the session in ``Broker.dirty``; after each
  ``receive`` the driver writes the output of every dirty session, before it reads the pusher's
  next chunk, so a delivery goes out before the pusher's next frame is read (decision 6), and
  never inside another reply (decision 8), since all of a session's bytes go through one buffer.
* **Unread output.** ``unsent`` is what the driver took from ``output`` and has not yet handed
  to the kernel. Past ``OUTPUT_HIGH_WATER`` in all, a session applies no more frames and receives
  no more deliveries (its subscriber is paused, credits kept) until the driver calls
  ``output_drained``.
* **Time.** The store keeps its own clock. ``Broker.timer`` is the earliest time the broker
  knows something is due: a TTL deadline, a lease's deadline, the end of a release delay or a
  delayed packet's due time; pushes and lease frames only ever move it earlier. The driver
  sleeps until then and calls ``expire()``, which sweeps, ends what is due and sets the next
  one: one timer, whatever the number of packets and leases.
* **Delayed pushes** (decision 21) are pushes in every rule (auth first, the memory cap, counted
  per queue, allowed on any connection) but go to ``Store.push_delayed``, off the hot path.
  Delayed packets enter their queues when the store files them (on ``expire``, or on a read
  after their due time); ``expire()`` offers the queues they entered to waiting subscribers,
  as ``settle()`` offers the queues packets came back to. The timer was set to their due time
  at the push, so a packet that entered its queue on a read is offered no later than then.
* **Auth** (decision 12). On a broker with a token, a session starts unauthenticated: its first
  frame must be auth with the right token, answered ``00 00``. Anything else (another frame, a
  wrong token, and later a second auth with a wrong token) makes ``receive`` stop at that frame
  with ``Blocked.REJECTED``, applying nothing from it on; ``rejected`` says why, in words that
  never include a token. The driver then closes the connection after ``REJECT_DELAY`` seconds,
  which slows down guessing, and logs the reason with the peer. The check costs an
  authenticated session one attribute test per batch, never one per frame.
* **Leases** (decisions 13-18) are ``leases.Leases``; a session holds its connection's lease
  ids (a ``Holder``). Packets that come back from a lease (released, past their deadline, their
  connection closed) are offered to waiting subscribers as a push's are, by ``settle()``, which
  every lease frame, a close and ``expire()`` end with. A connection that makes a leased
  subscribe is *leased* for the rest of its life: everything it is sent has the 11-byte header
  (a sync's and an auth's answer too: 11 zero bytes), and a pop, a plain subscribe or a reserve
  on it breaks decision 18. Plain subscriptions and lease frames never share a connection
  (decision 20): once a connection has sent a plain subscribe (an unsubscribe does not undo
  it), a reserve, ack, release, touch or leased subscribe breaks the rule, and once it has sent
  one of those, a plain subscribe does. Such a frame is not applied: ``receive`` stops before
  it and sets ``error``, and the driver closes the connection (decision 9's way).
* **Counting.** ``totals()`` reads what the store already counts (pushes, expiries, purges,
  packets held) and the deliveries, and derives the rest: an addition per packet on the hot
  path costs more than a push's whole bookkeeping in the store, so there is none. The lease
  table counts per lease (``lease_totals()``, ``leases.leased(queue)``). Pushes per queue
  (``pushes``, for the admin layer's per-queue rates) are counted per run of pushes to one
  queue, across batches and connections (``run_queue``, added up when the queue changes and
  when the admin layer takes the counts): a push pays a comparison of queue names and an
  addition to a local, a run one dictionary update.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple

from pinpriq.auth import tokens_match
from pinpriq.leases import (
    DEFAULT_LEASE_MS,
    DEFAULT_MAX_DELIVERIES,
    Holder,
    Lease,
    Leases,
    LeaseTotals,
)
from pinpriq.packed import PackedStore
from pinpriq.store import QueueStore
from pinpriq.store_contract import Store
from pinpriq.subscriptions import Subscriber, Subscriptions
from pinpriq.wire import (
    FRAMES,
    LEASED_EMPTY,
    Ack,
    Auth,
    ClientFrame,
    DelayedPush,
    KeyedPayload,
    LeasedSubscribe,
    Opcode,
    Pop,
    Push,
    Ready,
    Release,
    Reserve,
    Subscribe,
    Sync,
    Touch,
    Unsubscribe,
    append_reply,
    encode_lease_reply,
    encode_lease_status,
)

__all__ = [
    "DEFAULT_MAX_MEMORY",
    "LOW_WATER_FRACTION",
    "OUTPUT_HIGH_WATER",
    "REJECT_DELAY",
    "Blocked",
    "Broker",
    "Session",
    "Totals",
]

log = logging.getLogger("pinpriq.broker")

#: Default cap on ``Store.bytes_held``.
DEFAULT_MAX_MEMORY = 1024**3
#: Pushes resume once usage falls below this fraction of the cap, so a full server does not
#: flap between full and not full on every pop.
LOW_WATER_FRACTION = 0.9
#: A session whose unread output passes this applies no more frames and is given no more
#: deliveries until its output drains: a client pipelining pops without reading its replies,
#: or a subscriber that stops reading, must not grow the server's memory.
OUTPUT_HIGH_WATER: Final = 4 * 1024 * 1024
#: Seconds a rejected connection is held before it is closed (decision 12): long enough to make
#: guessing tokens slow, short enough that a client with a wrong token learns it soon.
REJECT_DELAY = 0.5
_SYNC_REPLY = b"\x00\x00"  # the answer to a sync, and to an auth that is accepted
#: The frame classes ``Session.receive`` applies inline. Final: compiled, a Final module name is
#: a C static, where any other module global is a dictionary lookup each time it is read.
_PUSH: Final = Push
_POP: Final = Pop


class Blocked(enum.Enum):
    """Why ``Session.receive`` stopped before the end of its frames."""

    #: The next frame is a push and the memory cap is reached: wait for ``Broker.on_room``.
    MEMORY = "memory"
    #: The client's unread output passed ``OUTPUT_HIGH_WATER``: write it, then go on.
    OUTPUT = "output"
    #: The connection is refused (decision 12): close it after ``REJECT_DELAY`` seconds and
    #: apply nothing more; ``Session.rejected`` says why. There is no going on.
    REJECTED = "rejected"


class _Rejected(Exception):
    """Raised by a frame's handler to stop ``receive`` at that frame: the session is
    rejected."""


class Totals(NamedTuple):
    """Packets since the broker started: what metrics and stats export."""

    pushed: int  # accepted pushes
    popped: int  # returned by pop frames
    delivered: int  # sent to subscribers
    expired: int  # removed at their TTL deadline
    purged: int  # removed by an operator's purge


def _nothing() -> None:
    """The default ``on_room``: nobody is waiting."""


class Broker:
    """The state every connection shares: store, subscriptions, memory cap and counters."""

    def __init__(
        self,
        store: Store,
        *,
        max_memory: int = DEFAULT_MAX_MEMORY,
        token: bytes | None = None,
        lease_default_ms: int = DEFAULT_LEASE_MS,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
    ) -> None:
        """``max_memory`` caps ``store.bytes_held``; 0 for no cap. ``token``: the one token a
        session must present first (``auth.load_token``); ``None``: sessions need none.
        ``lease_default_ms`` is the lease time of lease frames that say 0; a group goes to its
        dead-letter queue after ``max_deliveries`` attempts (0: never)."""
        self.store = store
        #: The store again if it is the built-in ``QueueStore`` itself (no subclass, no other
        #: store), for ``Session.receive``'s push and pop: compiled, a call through this type is
        #: a C call, where one through ``Store`` is a Python method call with boxed arguments.
        self.native_store = store if store.__class__ is QueueStore else None
        #: The store again if it is the packed store (``packed.PackedStore``, the server's
        #: default where its C core is built), for ``Session.receive``'s pop: its
        #: ``pop_reply`` writes the reply straight into the session's output, making no object
        #: per packet (the log-backed packed store's too: its C core logs what ``pop_reply``
        #: removes). Not a subclass with a ``pop`` of its own. Typed ``Any``: a C type mypyc
        #: knows nothing of.
        self.packed_store: Any = (
            store if isinstance(store, PackedStore) and type(store).pop is PackedStore.pop else None
        )
        # The store's methods ``Session.receive`` calls, bound once here (the store never
        # changes): compiled, a method looked up on a store mypyc knows only as ``Store`` (or
        # on the packed store, a C type) is a ``getattr`` making a bound method, ~400
        # instructions, where reading one of these is a native read. At pipeline 1 every
        # request is a batch of its own, so a per-batch lookup is a per-request one.
        self.store_push: Callable[[bytes, bytes, bytes, int, int], float] = store.push
        packed = self.packed_store
        #: The packed store's ``pop_reply`` and ``prefetch_pushes``; ``None`` on another store.
        self.pop_reply: Any = None if packed is None else packed.pop_reply
        self.prefetch_pushes: Any = None if packed is None else packed.prefetch_pushes
        self.token = token
        self.subscriptions = Subscriptions(store)
        self.leases = Leases(store, default_ms=lease_default_ms, max_deliveries=max_deliveries)
        self.max_memory: float = max_memory or math.inf
        self.low_water = self.max_memory * LOW_WATER_FRACTION
        #: Whether pushes wait: set at the cap, cleared below the low-water mark; also set
        #: while ``disk_full``.
        self.memory_full = False
        #: Whether the store's disk is full (a log-backed store's reserve in use): pushes wait
        #: as at the memory cap, pops go on. Set by ``set_disk_full``.
        self.disk_full = False
        #: Called once when pushes may go on after the cap was reached; the driver sets it.
        self.on_room: Callable[[], None] = _nothing
        #: Packets sent to subscribers so far.
        self.delivered = 0
        #: The earliest TTL deadline, lease deadline or end of a release delay known, on the
        #: store's clock: when to call ``expire``.
        self.timer = math.inf
        #: Sessions given deliveries since the driver last took them (see ``take_dirty``);
        #: the same list for the broker's life, so that the driver may hold it.
        self.dirty: list[Session] = []
        #: Open sessions.
        self.sessions = 0
        #: Pushes per queue since the admin layer last took them (``take_pushes``); ``None``
        #: until it first does, so that a server without one keeps no count per queue.
        self.pushes: dict[bytes, int] | None = None
        #: The run of pushes to one queue not yet added to ``pushes``: its queue and length.
        #: A run goes on across batches and connections (``Session.receive`` carries it in
        #: locals), so that at pipeline 1, where each push is a batch of its own, a push pays
        #: a comparison and an addition rather than a dictionary update.
        self.run_queue = b""
        self.run_length = 0

    def open_session(self) -> Session:
        """The protocol state of a new connection."""
        self.sessions += 1
        return Session(self)

    def totals(self) -> Totals:
        """The totals so far. O(1): every packet pushed is held, popped, delivered, expired,
        purged or on the lease side (leased now, acked, or dropped on its way to a dead-letter
        queue)."""
        store = self.store
        pushed, expired, purged = store.pushed, store.expired, store.purged
        leased = self.leases.totals()
        taken = leased.leased + leased.acked + leased.dropped
        # A store shared by several servers (Redis) counts this server's pops itself: packets
        # held there were pushed through any of them.
        popped: int | None = getattr(store, "popped", None)
        if popped is None:
            popped = pushed - len(store) - expired - purged - self.delivered - taken
        return Totals(pushed, popped, self.delivered, expired, purged)

    def purge(self, queue: bytes) -> int:
        """Remove every packet of a queue, prio 0 included (an operator's way out of a cap full
        of prio-0 packets); pushes waiting for room resume if it made enough. Leased packets
        are not in the queue: they come back when their lease ends. Returns how many packets
        went."""
        purged = self.store.purge(queue)
        if purged:
            log.info("purged %d packets from queue %r", purged, queue)
            if self.memory_full:
                self.check_memory()
        return purged

    def move(self, source: bytes, target: bytes, limit: int = 0) -> int:
        """Move queued packets from ``source`` to ``target`` (decision 22: whole key groups in
        pop order while fewer than ``limit`` have moved, all for 0; leased and delayed packets
        stay), and offer them to ``target``'s waiting subscribers as pushes are; the driver
        writes what that delivers. Returns how many packets moved; ``ValueError`` if the two
        are one queue. ``bytes_held`` does not change."""
        moved = self.store.move(source, target, limit)
        if moved:
            log.info("moved %d packets from queue %r to queue %r", moved, source, target)
            self.offer([target])
        return moved

    def take_pushes(self) -> dict[bytes, int]:
        """Pushes per queue since the last call (the admin layer's sampler calls it once a
        second), forgetting them; the first call starts the counting."""
        self.count_pushes(self.run_queue, self.run_length)  # the run so far
        self.run_length = 0
        pushes, self.pushes = self.pushes, {}
        return pushes or {}

    def count_pushes(self, queue: bytes, count: int) -> None:
        """Add a run of ``count`` pushes to ``queue`` to ``pushes``, if anyone takes them."""
        pushes = self.pushes
        if count and pushes is not None:
            pushes[queue] = pushes.get(queue, 0) + count

    def lease_totals(self) -> LeaseTotals:
        """What the leases count, for metrics (leased packets per queue: ``leases.leased``)."""
        return self.leases.totals()

    def take_dirty(self) -> list[Session]:
        """The sessions given deliveries since the last call, whose output is to be written."""
        dirty = self.dirty.copy()
        self.dirty.clear()
        for session in dirty:
            session.dirty = False
        return dirty

    def expire(self) -> int:
        """Sweep the packets whose TTL deadline has come (decision 1), let the delayed packets
        that are due into their queues and offer them (decision 21), end the leases whose
        deadline has come and send back the groups whose release delay ran out (decisions 14,
        15); sets the next ``timer``. Returns how many packets expired."""
        store = self.store
        expired = store.expire()
        self.leases.expire()
        self.settle()  # may deliver, and so lease, again: the timer comes after
        # Offering reads the store, which lets in what fell due meanwhile: those are offered
        # too, since the timer computed below no longer covers them.
        while arrived := store.take_arrived():
            self.offer(arrived)
        deadline = self.store.next_deadline()
        leases_due = self.leases.next_deadline()
        self.timer = min(
            math.inf if deadline is None else deadline,
            math.inf if leases_due is None else leases_due,
        )
        if self.memory_full:
            self.check_memory()
        return expired

    def settle(self) -> None:
        """After lease operations: offer the queues that got packets back to their waiting
        subscribers, as a push does (decision 15), and bring ``timer`` forward if a lease, a
        release delay or a returning packet's TTL needs it."""
        leases = self.leases
        if leases.returned:
            self.offer(leases.take_returned())
            deadline = self.store.next_deadline()
            if deadline is not None and deadline < self.timer:
                self.timer = deadline
        soonest = leases.soonest()
        if soonest < self.timer:
            self.timer = soonest

    def offer(self, queues: list[bytes]) -> None:
        """Offer queues that got packets other than by a push (back from a lease, due, moved)
        to their waiting subscribers, as a push would be offered."""
        if queues:
            waiting = self.subscriptions.waiting_queues
            for queue in queues:
                if queue in waiting:
                    self.subscriptions.offer(queue)

    def check_memory(self) -> None:
        """Enter or leave the full state after usage changed; logs each change once."""
        held = self.store.bytes_held
        if not self.memory_full and held >= self.max_memory:
            self.memory_full = True
            log.warning(
                "memory cap reached: %d bytes held, cap %d; pushes wait until usage falls below "
                "%d. %d of the held bytes are prio-0 packets, which leave only with a selectable "
                "packet of their key or by expiring; %d are delayed packets, held until they "
                "are due (up to 30 days) unless purged",
                held,
                self.max_memory,
                self.low_water,
                self.store.unselectable_bytes,
                self.store.delayed_bytes,
            )
        elif self.memory_full and held < self.low_water and not self.disk_full:
            self.memory_full = False
            log.warning("memory below the low-water mark (%d bytes held); pushes resume", held)
            self.on_room()

    def set_disk_full(self, full: bool) -> None:
        """The store's disk is full, or has room again: pushes wait while it is full, exactly
        as at the memory cap (``on_room`` is called when they may go on); pops go on."""
        if full == self.disk_full:
            return
        self.disk_full = full
        if full:
            self.memory_full = True
            return
        self.memory_full = False
        if self.store.bytes_held >= self.max_memory:
            self.check_memory()  # over the memory cap as well: full again, for that reason
        else:
            self.on_room()


class _Refused(Exception):
    """A frame that breaks decision 18 or 20: the connection is to be closed, the frame
    unapplied."""


class Session(Subscriber):
    """One connection's protocol state. Made by ``Broker.open_session``."""

    __slots__ = (
        "authenticated",
        "blocked",
        "broker",
        "closed",
        "dirty",
        "error",
        "holder",
        "lease_frames",
        "lease_ms",
        "leased",
        "output",
        "plain",
        "rejected",
        "unsent",
    )

    def __init__(self, broker: Broker) -> None:
        super().__init__()
        self.broker = broker
        #: This connection's lease ids and live leases.
        self.holder = Holder()
        #: Whether it made a leased subscribe, for the rest of its life (decision 18).
        self.leased = False
        #: Whether it sent a plain subscribe, for the rest of its life: deliveries in the
        #: 2-byte format may be on their way, so lease frames are refused (decision 20).
        self.plain = False
        #: Whether it sent a reserve, ack, release, touch or leased subscribe, for the rest of
        #: its life: a plain subscribe is refused (decision 20).
        self.lease_frames = False
        #: The lease time of its deliveries: that of its latest leased subscribe (decision 17).
        self.lease_ms = 0
        #: Why the connection must be closed, once a frame broke a rule; ``receive`` stopped
        #: before that frame.
        self.error: str | None = None
        #: Bytes owed to the client, in order: replies and deliveries. The driver writes them
        #: and removes what it wrote.
        self.output = bytearray()
        #: Bytes the driver took from ``output`` and has not yet handed to the kernel.
        self.unsent = 0
        #: Why the last ``receive`` stopped early, if it did.
        self.blocked: Blocked | None = None
        self.dirty = False  # filed in ``broker.dirty``
        self.closed = False
        #: Whether frames other than auth may be applied: from the start on a broker without
        #: a token, else once the first frame was auth with the right token.
        self.authenticated = broker.token is None
        #: Why the session was refused (``Blocked.REJECTED``), for the log; never a token.
        self.rejected: str | None = None
        if broker.packed_store is not None:  # deliveries written by the store, as pops are
            self.take_from = self._pop_delivery

    def receive(
        self,
        frames: Sequence[ClientFrame],
        start: int = 0,
        popped: deque[list[KeyedPayload]] | None = None,
    ) -> int:
        """Apply ``frames[start:]`` in order, appending what the client is owed to ``output``.

        Returns how many of ``frames`` are done: all of them, or fewer if the next must wait
        (``blocked`` says why) or breaks a rule (``error`` says which; close the connection).
        Call it again with the same list and the returned index once the wait is over, unless
        the session is ``Blocked.REJECTED``, which is final.

        ``popped``: on a store whose pops already ran (a ``BatchedStore``'s ``run``), what the
        pops of ``frames`` found, in frame order; each pop answers with the next, taken from
        the left, instead of calling the store's ``pop``.
        """
        if not self.authenticated:
            start = self._authenticate(frames, start)
            if not self.authenticated:
                return start
        broker = self.broker
        store, subscriptions, output = broker.store, broker.subscriptions, self.output
        native = broker.native_store
        # The store's bound methods, taken once by the broker: calling one is a direct call.
        store_push, pop_reply = broker.store_push, broker.pop_reply
        waiting_queues = subscriptions.waiting_queues
        max_memory = broker.max_memory
        room = OUTPUT_HIGH_WATER - self.unsent
        # A pop is applied inline, unless the connection is leased: then it goes to _HANDLERS,
        # which refuses it (decision 18). Only a handled frame can make the connection leased,
        # so ``pop`` is looked at again after each one, and the pop path pays nothing for it.
        pop = None if self.leased else _POP
        # Pushes are counted per queue by runs of pushes to one queue (``Broker.run_queue``),
        # in locals: a push pays a comparison and an addition in C (``queue`` and
        # ``run_queue`` are typed bytes for mypyc), and a run one dictionary update
        # (``Broker.count_pushes``).
        queue: bytes
        run_queue, run_length = broker.run_queue, broker.run_length
        # Compiled, indexing a list is a native read where a ``Sequence`` is indexed through
        # ``PyObject_GetItem``; the driver passes a list, so this copies nothing.
        # Annotated: the narrowed ``list`` alone would type the frames ``Any``, and mypyc would
        # then unpack a push through an iterator instead of reading the tuple's items.
        batch: list[ClientFrame] = frames if isinstance(frames, list) else list(frames)
        if len(batch) - start > 1 and broker.prefetch_pushes is not None:
            # At depth, the pushes' cache misses overlap, not queue up. A lone frame (every
            # request at pipeline 1) has nothing to overlap with.
            broker.prefetch_pushes(batch, start)
        try:
            for index in range(start, len(batch)):
                frame = batch[index]
                kind = type(frame)  # compiled, a native read; ``__class__`` is a getattr
                if kind is _PUSH:  # the hot path: inline, no reply
                    if broker.memory_full:
                        self.blocked = Blocked.MEMORY
                        return index
                    queue, key, payload, ttl_ms, prio = frame  # type: ignore[misc]
                    if queue != run_queue:
                        broker.count_pushes(run_queue, run_length)
                        run_queue, run_length = queue, 0
                    run_length += 1
                    if native is not None:  # the same call, made natively
                        deadline = native.push(queue, key, payload, ttl_ms, prio)
                        held = native.bytes_held
                    else:
                        deadline = store_push(queue, key, payload, ttl_ms, prio)
                        held = store.bytes_held
                    if ttl_ms and deadline < broker.timer:
                        broker.timer = deadline
                    # Mostly nobody waits: a dict's size is a native read, a lookup ~100.
                    if prio and waiting_queues and queue in waiting_queues:
                        subscriptions.offer(queue)
                    if held >= max_memory:
                        broker.check_memory()
                    continue
                if kind is pop:
                    name: bytes = frame[0]  # type: ignore[assignment,misc]
                    if pop_reply is not None:  # the reply's bytes, written by the store
                        pop_reply(name, output)
                    elif native is not None:
                        append_reply(output, native.pop(name))
                    elif popped is not None:
                        append_reply(output, popped.popleft())
                    else:
                        append_reply(output, store.pop(name))
                else:
                    if kind is DelayedPush and broker.memory_full:  # waits as a push does
                        self.blocked = Blocked.MEMORY
                        return index
                    try:
                        handle = _HANDLERS[kind]
                    except KeyError:
                        raise TypeError(f"no handler for {kind.__name__} frames") from None
                    handle(self, frame)
                    pop = None if self.leased else _POP
                if len(output) > room:
                    self.blocked = Blocked.OUTPUT
                    return index + 1
            self.blocked = None
            return len(frames)
        except _Rejected:
            return index  # that frame and the ones after it are not applied
        except _Refused as refused:
            self.error = str(refused)
            self.blocked = None
            return index
        finally:
            broker.run_queue, broker.run_length = run_queue, run_length
            if broker.memory_full:
                broker.check_memory()  # pops and deliveries may have made room

    def opens_with(self, opcode: int) -> bool:
        """Whether a session that has not authenticated may go on, its next frame starting
        with ``opcode``: only auth may, so a client without the token is refused at its first
        byte and cannot make the server hold a frame of another kind (a push may be 196,615
        bytes). Rejects the session if not."""
        if self.authenticated or opcode == Opcode.AUTH:
            return True
        kind = FRAMES.get(opcode)
        self._reject(
            f"{_describe(kind)} before auth"
            if kind is not None
            else f"byte 0x{opcode:02x}, not an opcode, before auth"
        )
        return False

    def _authenticate(self, frames: Sequence[ClientFrame], start: int) -> int:
        """Before auth: take the first frame if it is auth with the right token; otherwise
        reject. Returns the index of the first frame not taken."""
        if start >= len(frames) or self.rejected is not None:
            return start
        frame = frames[start]
        token = self.broker.token
        assert token is not None  # a session without a token starts authenticated
        if frame.__class__ is not Auth:
            self._reject(f"{_describe(frame.__class__)} before auth")
        elif not tokens_match(frame[0], token):
            self._reject("a wrong token")
        else:
            self.authenticated = True
            self.output += _SYNC_REPLY
            return start + 1
        return start

    def _reject(self, reason: str) -> None:
        self.rejected = reason
        self.blocked = Blocked.REJECTED

    def _auth(self, frame: Auth) -> None:
        # Auth on an authenticated session: a server without a token takes any token; with
        # one, a second auth must be right too (decision 12).
        token = self.broker.token
        if token is not None and not tokens_match(frame.token, token):
            self._reject("a wrong token in a second auth")
            raise _Rejected
        self.output += LEASED_EMPTY if self.leased else _SYNC_REPLY  # decision 18's framing

    @property
    def may_reserve(self) -> bool:
        """Whether a reserve would be applied now: after auth, on a connection neither leased
        (decision 18) nor ever plainly subscribed (decision 20). A store that runs reserves
        before ``receive`` applies them (Redis) asks first, so a refused one takes nothing."""
        return self.authenticated and not self.leased and not self.plain

    def _subscribe(self, frame: Subscribe) -> None:
        if self.leased:
            raise _Refused("a plain subscribe on a leased connection (decision 18)")
        if self.lease_frames:
            raise _Refused("a plain subscribe on a connection that sent lease frames (decision 20)")
        self.plain = True
        self.broker.subscriptions.subscribe(self, frame.queue)

    def _lease_frame(self, frame: ClientFrame) -> None:
        """A reserve, ack, release, touch or leased subscribe is about to be applied: refused
        on a connection that sent a plain subscribe (decision 20), else remembered."""
        if self.plain:
            raise _Refused(
                f"{_describe(frame.__class__)} on a connection that sent a plain subscribe "
                "(decision 20)"
            )
        self.lease_frames = True

    def _unsubscribe(self, frame: Unsubscribe) -> None:
        self.broker.subscriptions.unsubscribe(self, frame.queue)

    def _ready(self, frame: Ready) -> None:
        self.broker.subscriptions.ready(self)

    def _sync(self, frame: Sync) -> None:
        # Every earlier frame is applied by now: frames are applied in order (decision 11).
        self.output += LEASED_EMPTY if self.leased else _SYNC_REPLY

    def _refuse_pop(self, frame: Pop) -> None:
        raise _Refused("a pop on a leased connection (decision 18)")

    def _reserve(self, frame: Reserve) -> None:
        if self.leased:
            raise _Refused("a reserve on a leased connection (decision 18)")
        self._lease_frame(frame)
        broker = self.broker
        lease = broker.leases.reserve(self.holder, frame.queue, frame.lease_ms)
        if lease is None:
            self.output += LEASED_EMPTY
            return
        self.output += encode_lease_reply(lease.lease_id, lease.attempt, lease.packets)
        if lease.due < broker.timer:
            broker.timer = lease.due

    def _ack(self, frame: Ack) -> None:
        self._lease_frame(frame)
        leases = self.broker.leases
        live = leases.ack(self.holder, frame.lease_id)
        self.output += encode_lease_status(frame.lease_id, live)
        if leases.returned:  # an ack racing the deadline ended the lease the other way
            self.broker.settle()

    def _release(self, frame: Release) -> None:
        self._lease_frame(frame)
        live = self.broker.leases.release(self.holder, frame.lease_id, frame.delay_ms)
        self.output += encode_lease_status(frame.lease_id, live)
        self.broker.settle()

    def _touch(self, frame: Touch) -> None:
        self._lease_frame(frame)
        live = self.broker.leases.touch(self.holder, frame.lease_id, frame.lease_ms)
        self.output += encode_lease_status(frame.lease_id, live)
        self.broker.settle()

    def _delayed_push(self, frame: DelayedPush) -> None:
        # A push in every other rule (decision 21): ``receive`` made it wait at the memory cap.
        broker = self.broker
        store = broker.store
        queue, key, payload, ttl_ms, prio, delay_ms = frame
        try:
            due = store.push_delayed(queue, key, payload, ttl_ms, prio, delay_ms)
        except NotImplementedError as missing:  # a store that cannot hold them yet
            raise _Refused(f"a push with a delay: {missing}") from None
        if due < broker.timer:
            broker.timer = due
        broker.count_pushes(queue, 1)
        if store.bytes_held >= broker.max_memory:
            broker.check_memory()

    def _leased_subscribe(self, frame: LeasedSubscribe) -> None:
        self._lease_frame(frame)
        self.leased = True
        self.lease_ms = frame.lease_ms
        self.take_from = self._take_lease
        self.broker.subscriptions.subscribe(self, frame.queue)

    def _take_lease(self, queue: bytes) -> Lease | None:
        """How a leased subscriber takes from a queue (decision 17)."""
        return self.broker.leases.reserve(self.holder, queue, self.lease_ms)

    def _pop_delivery(self, queue: bytes) -> int:
        """How a plain subscriber takes from a queue on the packed store: the store writes the
        delivery's bytes into ``output`` itself, making no object per packet, and says how
        many packets (0: nothing was selectable, nothing written)."""
        count: int = self.broker.packed_store.pop_delivery(queue, self.output)
        return count

    def deliver(self, packets: Any) -> None:
        """Take a delivery the subscriptions made (``Subscriber``): queue its bytes. It is a
        pop's packets, on a leased connection the ``Lease`` that ``_take_lease`` made, or on
        the packed store how many packets ``_pop_delivery`` already wrote."""
        broker = self.broker
        if self.leased:
            lease: Lease = packets
            self.output += encode_lease_reply(lease.lease_id, lease.attempt, lease.packets)
            if lease.due < broker.timer:
                broker.timer = lease.due
        elif isinstance(packets, int):  # written into output by the store
            broker.delivered += packets
        else:
            append_reply(self.output, packets)
            broker.delivered += len(packets)
        if not self.dirty:
            self.dirty = True
            broker.dirty.append(self)
        if len(self.output) + self.unsent > OUTPUT_HIGH_WATER:
            # A subscriber that does not read gets nothing more until it does: further packets
            # stay queued, for others to take and for the memory cap to count.
            self.paused = True

    def output_drained(self) -> None:
        """The driver has handed ``output`` to the kernel: a paused subscriber may resume."""
        if self.paused and len(self.output) + self.unsent <= OUTPUT_HIGH_WATER:
            self.broker.subscriptions.resume(self)

    def close(self) -> None:
        """The connection is gone: its subscriptions and credits go (decision 7), and its
        leases end, their packets going back (decision 15). Idempotent."""
        if not self.closed:
            self.closed = True
            self.take_from = None  # a bound method of this session: a reference cycle
            self.broker.subscriptions.remove(self)  # first: none of it comes back to itself
            self.broker.leases.close(self.holder)
            self.broker.settle()
            self.broker.sessions -= 1


# Dispatch for every frame but those ``receive`` handles inline: the push, and the pop except
# on a leased connection. An unknown frame class is an error in ``receive``, never a
# fall-through to some other frame's handler.
_HANDLERS: dict[type[ClientFrame], Callable[[Session, ClientFrame], None]] = {
    Subscribe: Session._subscribe,  # type: ignore[dict-item]
    Unsubscribe: Session._unsubscribe,  # type: ignore[dict-item]
    Ready: Session._ready,  # type: ignore[dict-item]
    Sync: Session._sync,  # type: ignore[dict-item]
    Auth: Session._auth,  # type: ignore[dict-item]
    Pop: Session._refuse_pop,  # type: ignore[dict-item]
    Reserve: Session._reserve,  # type: ignore[dict-item]
    Ack: Session._ack,  # type: ignore[dict-item]
    Release: Session._release,  # type: ignore[dict-item]
    Touch: Session._touch,  # type: ignore[dict-item]
    LeasedSubscribe: Session._leased_subscribe,  # type: ignore[dict-item]
    DelayedPush: Session._delayed_push,  # type: ignore[dict-item]
}
assert set(_HANDLERS) | {Push} == set(FRAMES.values()), "a frame the broker cannot handle"


def _describe(kind: type[ClientFrame]) -> str:
    """A frame kind for a log line: ``a pop``, ``an unsubscribe``, ``a leased subscribe``."""
    name = "".join(" " + c.lower() if c.isupper() else c for c in kind.__name__).lstrip()
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"
