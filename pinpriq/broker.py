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
  the driver has written it). The driver waits, then calls ``receive`` with the rest.
* **Deliveries.** A push may deliver to any session, this one included. ``Session.deliver``
  appends to that session's ``output`` and files the session in ``Broker.dirty``; after each
  ``receive`` the driver writes the output of every dirty session, before it reads the pusher's
  next chunk, so a delivery goes out before the pusher's next frame is read (decision 6), and
  never inside another reply (decision 8), since all of a session's bytes go through one buffer.
* **Unread output.** ``unsent`` is what the driver took from ``output`` and has not yet handed
  to the kernel. Past ``OUTPUT_HIGH_WATER`` in all, a session applies no more frames and receives
  no more deliveries (its subscriber is paused, credits kept) until the driver calls
  ``output_drained``.
* **Time.** The store keeps its own clock. ``Broker.timer`` is the earliest TTL deadline the
  broker knows of; pushes only ever move it earlier. The driver sleeps until then and calls
  ``expire()``, which sweeps and sets the next one: one timer, whatever the number of packets.
* **Counting.** ``totals()`` reads what the store already counts (pushes, expiries, packets
  held) and the deliveries, and derives the rest: an addition per packet on the hot path costs
  more than a push's whole bookkeeping in the store, so there is none.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pinpriq.store_contract import Store
from pinpriq.subscriptions import Subscriber, Subscriptions
from pinpriq.wire import (
    FRAMES,
    ClientFrame,
    KeyedPayload,
    Pop,
    Push,
    Ready,
    Subscribe,
    Sync,
    Unsubscribe,
    encode_reply,
)

__all__ = [
    "DEFAULT_MAX_MEMORY",
    "LOW_WATER_FRACTION",
    "OUTPUT_HIGH_WATER",
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
OUTPUT_HIGH_WATER = 4 * 1024 * 1024
_SYNC_REPLY = b"\x00\x00"


class Blocked(enum.Enum):
    """Why ``Session.receive`` stopped before the end of its frames."""

    #: The next frame is a push and the memory cap is reached: wait for ``Broker.on_room``.
    MEMORY = "memory"
    #: The client's unread output passed ``OUTPUT_HIGH_WATER``: write it, then go on.
    OUTPUT = "output"


class Totals(NamedTuple):
    """Packets since the broker started: what metrics and stats export."""

    pushed: int  # accepted pushes
    popped: int  # returned by pop frames
    delivered: int  # sent to subscribers
    expired: int  # removed at their TTL deadline


def _nothing() -> None:
    """The default ``on_room``: nobody is waiting."""


class Broker:
    """The state every connection shares: store, subscriptions, memory cap and counters."""

    def __init__(self, store: Store, *, max_memory: int = DEFAULT_MAX_MEMORY) -> None:
        """``max_memory`` caps ``store.bytes_held``; 0 for no cap."""
        self.store = store
        self.subscriptions = Subscriptions(store)
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
        #: The earliest TTL deadline known, on the store's clock: when to call ``expire``.
        self.timer = math.inf
        #: Sessions given deliveries since the driver last took them (see ``take_dirty``).
        self.dirty: list[Session] = []
        #: Open sessions.
        self.sessions = 0

    def open_session(self) -> Session:
        """The protocol state of a new connection."""
        self.sessions += 1
        return Session(self)

    def totals(self) -> Totals:
        """The totals so far. O(1): every packet pushed is held, popped, delivered or expired."""
        store = self.store
        pushed, expired = store.pushed, store.expired
        popped = pushed - len(store) - expired - self.delivered
        return Totals(pushed, popped, self.delivered, expired)

    def take_dirty(self) -> list[Session]:
        """The sessions given deliveries since the last call, whose output is to be written."""
        dirty, self.dirty = self.dirty, []
        for session in dirty:
            session.dirty = False
        return dirty

    def expire(self) -> int:
        """Sweep the packets whose TTL deadline has come (decision 1); sets the next ``timer``.
        Returns how many packets went."""
        expired = self.store.expire()
        deadline = self.store.next_deadline()
        self.timer = math.inf if deadline is None else deadline
        if self.memory_full:
            self.check_memory()
        return expired

    def check_memory(self) -> None:
        """Enter or leave the full state after usage changed; logs each change once."""
        held = self.store.bytes_held
        if not self.memory_full and held >= self.max_memory:
            self.memory_full = True
            log.warning(
                "memory cap reached: %d bytes held, cap %d; pushes wait until usage falls below "
                "%d. %d of the held bytes are prio-0 packets, which leave only with a selectable "
                "packet of their key or by expiring",
                held,
                self.max_memory,
                self.low_water,
                self.store.unselectable_bytes,
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


class Session(Subscriber):
    """One connection's protocol state. Made by ``Broker.open_session``."""

    __slots__ = ("blocked", "broker", "closed", "dirty", "output", "unsent")

    def __init__(self, broker: Broker) -> None:
        super().__init__()
        self.broker = broker
        #: Bytes owed to the client, in order: replies and deliveries. The driver writes them
        #: and removes what it wrote.
        self.output = bytearray()
        #: Bytes the driver took from ``output`` and has not yet handed to the kernel.
        self.unsent = 0
        #: Why the last ``receive`` stopped early, if it did.
        self.blocked: Blocked | None = None
        self.dirty = False  # filed in ``broker.dirty``
        self.closed = False

    def receive(self, frames: Sequence[ClientFrame], start: int = 0) -> int:
        """Apply ``frames[start:]`` in order, appending what the client is owed to ``output``.

        Returns how many of ``frames`` are done: all of them, or fewer if the next must wait
        (``blocked`` says why). Call it again with the same list and the returned index once the
        wait is over.
        """
        broker = self.broker
        store, subscriptions, output = broker.store, broker.subscriptions, self.output
        waiting_queues = subscriptions.waiting_queues
        max_memory = broker.max_memory
        room = OUTPUT_HIGH_WATER - self.unsent
        try:
            for index in range(start, len(frames)):
                frame = frames[index]
                kind = frame.__class__
                if kind is Push:  # the hot path: inline, no reply
                    if broker.memory_full:
                        self.blocked = Blocked.MEMORY
                        return index
                    queue, key, payload, ttl_ms, prio = frame  # type: ignore[misc]
                    deadline = store.push(queue, key, payload, ttl_ms, prio)
                    if ttl_ms and deadline < broker.timer:
                        broker.timer = deadline
                    if prio and queue in waiting_queues:
                        subscriptions.offer(queue)
                    if store.bytes_held >= max_memory:
                        broker.check_memory()
                    continue
                if kind is Pop:
                    output += encode_reply(store.pop(frame[0]))  # type: ignore[misc]
                else:
                    try:
                        handle = _HANDLERS[kind]
                    except KeyError:
                        raise TypeError(f"no handler for {kind.__name__} frames") from None
                    handle(self, frame)
                if len(output) > room:
                    self.blocked = Blocked.OUTPUT
                    return index + 1
            self.blocked = None
            return len(frames)
        finally:
            if broker.memory_full:
                broker.check_memory()  # pops and deliveries may have made room

    def _subscribe(self, frame: Subscribe) -> None:
        self.broker.subscriptions.subscribe(self, frame.queue)

    def _unsubscribe(self, frame: Unsubscribe) -> None:
        self.broker.subscriptions.unsubscribe(self, frame.queue)

    def _ready(self, frame: Ready) -> None:
        self.broker.subscriptions.ready(self)

    def _sync(self, frame: Sync) -> None:
        # Every earlier frame is applied by now: frames are applied in order (decision 11).
        self.output += _SYNC_REPLY

    def deliver(self, packets: Sequence[KeyedPayload]) -> None:
        """Take a delivery the subscriptions made (``Subscriber``): queue its bytes."""
        self.output += encode_reply(packets)
        broker = self.broker
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
        """The connection is gone: its subscriptions and credits go (decision 7). Idempotent."""
        if not self.closed:
            self.closed = True
            self.broker.subscriptions.remove(self)
            self.broker.sessions -= 1


# Dispatch for every frame but the two that ``receive`` handles inline. An unknown frame class
# is an error in ``receive``, never a fall-through to some other frame's handler.
_HANDLERS: dict[type[ClientFrame], Callable[[Session, ClientFrame], None]] = {
    Subscribe: Session._subscribe,  # type: ignore[dict-item]
    Unsubscribe: Session._unsubscribe,  # type: ignore[dict-item]
    Ready: Session._ready,  # type: ignore[dict-item]
    Sync: Session._sync,  # type: ignore[dict-item]
}
assert set(_HANDLERS) | {Push, Pop} == set(FRAMES.values()), "a frame the broker cannot handle"
