"""What the broker needs from a store of queues, and what it may rely on.

``store.QueueStore`` (in memory) is the reference store, and ``packed.PackedStore`` the same
rules in C (the server's in-memory store where it is built); a log-backed or Redis-backed store
is written against this contract, not against either class. The broker (``broker.py``) and the
subscriptions (``subscriptions.py``) use a store only through ``Store``.

How an asynchronous store fits. ``Store`` is synchronous: each call has done its work when it
returns, so a ``Session`` applies a whole batch of frames without yielding. A store whose
operations complete later (Redis: one script call per push or pop, pipelined per batch) sits
behind the same broker in two parts, with no copy of the broker:

* before handing a connection's batch to ``Session.receive``, its driver runs the batch's store
  operations, in frame order, as one pipeline (``popped = await store.run(frames)``), and hands
  the pops' results to ``receive`` with the frames (``receive(frames, 0, popped)``): it calls
  ``push`` as it does today, and answers each pop with the next result, so replies keep their
  places in the output. The results travel with the call, so connections waiting in the
  middle of a batch never share them;
* deliveries, which another connection's push or another front end's causes, come from a
  subscriptions object of that store's own (the same methods as ``subscriptions.Subscriptions``),
  which pops asynchronously and hands each result to ``Session.deliver`` when it arrives, as the
  in-memory one does at once.

``BatchedStore`` and ``Deliveries`` below state both halves;
``server._Connection._apply_batched`` is the driver's side (it cuts a batch where a frame may
cause a delivery here, so replies and deliveries land where the built-in store puts them), and
``pinpriq/redis/`` the store's.

Leases (decisions 13-16) are ``leases.Leases``, built on three operations every store has:
``take`` (a pop whose packets stay counted), ``discard`` (an ack) and ``restore`` (a group going
back, in push order with its TTL deadline, or on to a dead-letter queue). A store that must
keep leases across front ends (decision 19: on Redis, a lease held through a front end that
dies returns at its deadline) keeps the lease table itself, with the same methods as
``Leases``; a store that persists packets logs an ack (``discard``) as a removal and a
dead-letter move (``restore`` to another queue) as a move, and never logs a ``take``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from pinpriq.wire import ClientFrame, KeyedPayload

__all__ = [
    "BatchedStore",
    "Deliveries",
    "PeekedPacket",
    "QueueInfo",
    "QueuedPacket",
    "Rank",
    "Store",
]

#: A packet a store holds and hands out (``take``, a pop's reply): ``(key, payload, prio, seq,
#: deadline, leases)``, read by index (``store.KEY`` and the rest); ``seq`` is push order,
#: ``deadline`` the TTL deadline on the store's clock (inf for none), ``leases`` how many times
#: it was leased. The built-in store (``store.py``) says why it is a plain tuple spelled with an
#: empty variadic tail.
QueuedPacket = tuple[bytes, bytes, int, int, float, int, *tuple[Any, ...]]

#: How good the packet a pop of a queue would select is: ``(prio, -seq)``, smaller is better.
Rank = tuple[int, int]
#: A packet ``peek`` shows: ``(key, payload, prio, ...)``; a store may add fields after these.
PeekedPacket = tuple[bytes, bytes, int, *tuple[object, ...]]


class QueueInfo(NamedTuple):
    """What ``Store.queue_info`` tells about one queue: what an operator reads."""

    packets: int  # live packets, prio 0 included
    bytes: int  # its share of ``bytes_held``
    by_priority: dict[int, int]  # live packets per priority (0..255), ascending, only those held
    #: Seconds since its oldest packet was pushed, at most (``note_time`` sets the precision);
    #: ``None`` when that is unknown (pushed before the first note) or the queue is empty.
    oldest_age: float | None
    next_expiry: float | None  # seconds until its next packet expires; ``None`` if none will
    #: Delayed packets not yet due (decision 21): not counted in ``packets`` or ``by_priority``;
    #: their bytes are in ``bytes``.
    delayed: int = 0


class Store(Protocol):
    """Named priority queues with key groups and TTLs (decisions 1-5 of docs/protocol.md).

    The broker relies on:

    * **Order.** Calls take effect in the order they are made: a push is visible to the next
      pop, and "newest" means "pushed by the latest call".
    * **Time.** The store reads a clock it was given; deadlines it returns are on that clock.
      An expired packet is never returned, even if ``expire`` has not run since its deadline.
    * **Cost.** ``push`` and ``pop`` are on the server's hot path: O(log n) or better, and
      independent of other queues.
    * **Memory.** ``bytes_held`` is what the memory cap compares against; it changes only in
      the calls below.
    * **Delayed packets** (decision 21) are held but in no queue until they are due: no pop,
      take, peek or move sees them, and they are in no key group; they count in
      ``bytes_held`` (``delayed_bytes``), in ``len``, ``queue_count``, a queue's bytes and
      ``QueueInfo.delayed`` (not in its ``packets``), and a purge removes them. A queue
      holding only delayed packets is empty for pops and is forgotten (decision 5) as far as
      pops can tell, yet listed.
      ``next_deadline`` covers their due times, and ``expire`` files every due packet into its
      queue in its place in push order (its seq, taken at the push, as ``restore`` files a
      packet), with its TTL deadline (due time plus TTL), or drops it if that has passed too.
      A store may make a packet arrive on any read once it is due, as it expires on a read.
    """

    #: Estimated bytes held by queued packets; what the server's memory cap compares against.
    bytes_held: int
    #: Of those, bytes held by prio-0 packets: they leave only with a selectable packet of their
    #: key (or by expiring), so a cap full of them never frees itself.
    unselectable_bytes: int
    #: Packets removed at their TTL deadline since the store was made, by ``expire`` or by the
    #: store itself before a read, or by ``restore`` (a deadline passed while taken).
    expired: int
    #: Packets removed by ``purge`` since the store was made.
    purged: int
    #: The part of ``bytes_held`` held by packets taken and not yet restored or discarded.
    taken_bytes: int
    #: The part of ``bytes_held`` held by delayed packets, not yet due (decision 21).
    delayed_bytes: int

    @property
    def pushed(self) -> int:
        """Packets pushed since the store was made."""
        ...

    def __len__(self) -> int:
        """Packets held, in all queues, delayed ones included."""
        ...

    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> float:
        """Queue a packet; returns its deadline on the store's clock (inf for TTL 0)."""
        ...

    def push_delayed(
        self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int, delay_ms: int
    ) -> float:
        """Hold a packet until ``now + delay_ms / 1000``, when it enters ``queue`` (decision
        21); returns that due time on the store's clock. It takes its place in push order (its
        seq) now; its TTL deadline is its due time plus ``ttl_ms`` (none for 0)."""
        ...

    def take_arrived(self) -> list[bytes]:
        """The queues delayed packets entered since the last call (a name may repeat), which
        the broker offers to waiting subscribers (as ``Leases.take_returned``'s)."""
        ...

    def pop(self, queue: bytes) -> Sequence[KeyedPayload]:
        """Remove and return the best packet and its key group, the selected packet first
        (decisions 2-4), at most 65,535 packets; empty if nothing is selectable."""
        ...

    def peek_rank(self, queue: bytes) -> Rank | None:
        """The rank of what ``pop(queue)`` would select, comparable across queues of this store
        (decision 6: best across a subscriber's queues); ``None`` if nothing is selectable."""
        ...

    def next_deadline(self) -> float | None:
        """When the earliest live packet expires or delayed packet is due, on the store's
        clock; ``None`` if nothing will happen."""
        ...

    def expire(self) -> int:
        """Remove every packet whose deadline has come, and file every delayed packet that is
        due into its queue; returns how many were removed (delayed packets whose TTL deadline
        passed before they arrived included)."""
        ...

    # What operators read and do (the admin listener). None of it is on the hot path, and none
    # may cost O(packets) except ``purge``, which removes them.

    @property
    def queue_count(self) -> int:
        """Queues holding at least one packet."""
        ...

    def sizes(self) -> Iterator[tuple[bytes, int, int]]:
        """Every queue holding packets, with its packets (as ``QueueInfo.packets``: delayed
        ones not counted) and its bytes (delayed ones' included); a queue holding only delayed
        packets too. O(1) per queue."""
        ...

    def queue_info(self, queue: bytes) -> QueueInfo:
        """What one queue holds; all zero for one that holds nothing. O(priority levels)."""
        ...

    def peek(self, queue: bytes, count: int) -> Sequence[PeekedPacket]:
        """The next ``count`` packets (at most) that pops of ``queue`` would return, in that
        order, removing nothing: none for a ``count`` of 0; ``ValueError`` for a negative
        one. O(count), plus what the store must skip on the way."""
        ...

    def purge(self, queue: bytes) -> int:
        """Remove every packet of ``queue``, prio 0 and delayed ones included; returns how
        many. The caller (the broker) checks the memory cap afterwards, since ``bytes_held``
        fell."""
        ...

    def move(self, source: bytes, target: bytes, limit: int) -> int:
        """Move queued packets from ``source`` to ``target`` (decision 22); returns how many.
        Whole key groups move, in pop order while fewer than ``limit`` packets have moved (a
        first group larger than ``limit`` moves whole), or, for ``limit`` 0, all of them, prio-0
        packets whose key has no selectable packet included (with a limit those stay). Each
        keeps key, payload, prio and TTL deadline, its lease count starts again at 0, and they
        enter ``target`` as pushes made now (newer than everything in it), in their old
        relative order. Delayed and leased packets stay where they are. ``source == target``
        raises ``ValueError``. The caller offers ``target`` to waiting subscribers."""
        ...

    def note_time(self) -> None:
        """Called about once a second: lets the store tell packets' ages (``queue_info``)
        without reading the clock per push."""
        ...

    # Leases (decisions 13-19).

    def now(self) -> float:
        """The store's clock: every deadline it takes and returns is on it."""
        ...

    def take(self, queue: bytes) -> Sequence[QueuedPacket]:
        """``pop``, for a lease: the same packets leave the queue, but stay counted in
        ``bytes_held`` (and ``taken_bytes``) until ``restore`` or ``discard``. Packets are
        ``store.QueuedPacket`` tuples: the lease table reads their lease count (``LEASES``)."""
        ...

    def discard(self, packets: Sequence[QueuedPacket]) -> None:
        """Forget packets ``take`` returned, for good (an ack): their bytes are free."""
        ...

    def restore(self, queue: bytes, packets: Sequence[QueuedPacket]) -> int:
        """Put packets ``take`` returned (all of one key, their lease counts possibly changed)
        into ``queue``, their own or another: each with its prio, its place in push order and
        its TTL deadline, as if it had never left; one whose deadline has passed is dropped and
        counted in ``expired``. Returns how many went back. O(g log n) for g packets."""
        ...


@runtime_checkable
class BatchedStore(Store, Protocol):
    """A store whose operations run elsewhere (the Redis store), in the two halves above."""

    #: Why lease frames close the connection on this store, or ``None`` if it takes them.
    leases_unsupported: str | None

    async def run(self, frames: Sequence[ClientFrame]) -> deque[list[KeyedPayload]]:
        """Apply the pushes and pops of ``frames``, in order; returns the pops' results, in
        frame order, for ``Session.receive(frames, 0, popped)``: the broker never calls this
        store's ``pop``."""
        ...

    async def run_leases(self, frames: Sequence[ClientFrame], session: Any) -> None:
        """Apply lease frames of ``session`` (reserves, acks, releases, touches), leaving what
        the session's ``receive`` answers from in the lease table ``make_leases`` made."""
        ...

    def make_leases(self, *, default_ms: int, max_deliveries: int) -> Any:
        """The broker's lease table for this store (a ``leases.Leases``)."""
        ...

    async def peek_async(self, queue: bytes, count: int) -> Sequence[PeekedPacket]:
        """``peek``, for a store that must wait for the answer."""
        ...

    async def purge_async(self, queue: bytes) -> int:
        """``purge``, likewise."""
        ...

    async def move_async(self, source: bytes, target: bytes, limit: int) -> int:
        """``move``, likewise."""
        ...


class Deliveries(Protocol):
    """The subscriptions of a ``BatchedStore``: ``subscriptions.Subscriptions``' methods, whose
    deliveries ``serve`` makes asynchronously."""

    #: Called after deliveries were made, to write them out; the server sets it.
    flush: Callable[[], None]
    waiting_queues: Mapping[bytes, object]

    @property
    def due(self) -> bool:
        """Whether ``serve`` has deliveries to attempt."""
        ...

    async def serve(self) -> None:
        """Make the deliveries noted since the last call."""
        ...
