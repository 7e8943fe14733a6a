"""Leases (decisions 13-16 of docs/protocol.md): who holds which packets, until when, and where
they go when the lease ends.

Pure and synchronous, like the store it draws from: it reads time only through the store's
clock (``Store.now``), knows a connection only as a ``Holder`` (that connection's lease ids), and
never touches a socket. The broker turns frames into calls here and replies into bytes.

Theory of operation.

* **A lease** is a key group the store ``take``s (out of its queue, still counted against the
  memory cap), filed under its holder's next id (1, 2, ... per connection, never reused) and
  given a ``due`` time: its deadline. It ends in one of four ways. An ack ``discard``s its
  packets. A release, a passed deadline or its connection's close sends them back, through
  ``restore``, which puts each packet back where it was (push order, prio, TTL deadline; TTL
  wins). A release with a delay first waits: the lease leaves its holder at once (its id is
  dead) and its ``due`` becomes the end of the delay.
* **Attempts.** The store keeps, in each packet, how many times it was leased. A lease's
  attempt is one more than the most of its packets'; a packet going back counts one more. A
  group going back after attempt ``max_deliveries`` goes to its queue's name plus ``.dead``
  instead, its counts reset; a name too long for the suffix drops the group (``dropped``).
* **Time.** One heap of ``(due, serial, lease)`` holds deadlines and the ends of delays alike,
  with lazy deletion: an entry counts while its time is still its lease's ``due`` (a touch
  files a new entry; an end sets ``due`` to infinity). It is rebuilt once it holds more than
  twice as many entries as there are leases, so an acked lease's entry does not keep its
  packets for the length of the lease. The broker sleeps until ``soonest()`` and calls
  ``expire()``. A frame naming a lease whose deadline has passed finds it ended, whether or not
  ``expire`` has run: the lease ends there and then.
* **Going back** appends each queue that got packets to ``returned``; the broker offers those
  queues to waiting subscribers, as a push would (decision 15).
* **Counting** happens per lease, never per pushed or popped packet: leased packets in all and
  per queue (O(1) to read), and totals (``totals()``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from pinpriq.store import LEASES, QueuedPacket
from pinpriq.store_contract import Store
from pinpriq.wire import MAX_FIELD

__all__ = [
    "DEAD_SUFFIX",
    "DEFAULT_LEASE_MS",
    "DEFAULT_MAX_DELIVERIES",
    "Holder",
    "Lease",
    "LeaseTotals",
    "Leases",
]

#: Lease time when a frame says 0: the server's ``--lease-default``.
DEFAULT_LEASE_MS = 30_000
#: Attempts after which a group goes to the dead-letter queue: ``--max-deliveries``; 0 for none.
DEFAULT_MAX_DELIVERIES = 20
#: Appended to a queue's name to name its dead-letter queue (decision 16).
DEAD_SUFFIX = b".dead"
#: Heap entries beyond twice the leases before the heap is rebuilt.
_STALE_SLACK = 64
_NEVER = math.inf


class Lease:
    """One lease: its id on its holder's connection, its key group and when it ends."""

    __slots__ = ("attempt", "due", "holder", "lease_id", "packets", "queue")

    def __init__(
        self,
        lease_id: int,
        holder: Holder,
        queue: bytes,
        packets: Sequence[QueuedPacket],
        due: float,
    ) -> None:
        self.lease_id = lease_id
        #: The holder while the lease is live; None once released (waiting out a delay) or ended.
        self.holder: Holder | None = holder
        self.queue = queue
        self.packets = packets
        #: One more than the most times any of its packets was leased before (1 the first time).
        self.attempt = 1 + (
            packets[0][LEASES] if len(packets) == 1 else max(p[LEASES] for p in packets)
        )
        #: When it ends (its deadline), or, released with a delay, when its packets go back;
        #: infinity once over.
        self.due = due

    def __len__(self) -> int:
        """Its packets: a lease is what a leased subscriber takes (``Subscriber.take_from``)."""
        return len(self.packets)


class Holder:
    """One connection's live leases, by id. Its ids start at 1 and are never reused."""

    __slots__ = ("last_id", "leases")

    def __init__(self) -> None:
        self.leases: dict[int, Lease] = {}
        self.last_id = 0


class LeaseTotals(NamedTuple):
    """Packets since the leases were made, and now: what metrics and stats export."""

    leased: int  # now on a lease or waiting out a release delay
    acked: int  # acked, gone for good
    redelivered: int  # back in their queue after a lease ended other than by ack (TTL passed: not)
    dead_lettered: int  # moved to a dead-letter queue (TTL passed: not)
    dropped: int  # due for a dead-letter queue whose name would be too long
    unknown: int  # ack, release and touch frames naming no live lease (answered status 0)


class Leases:
    """Every lease of one store."""

    def __init__(
        self,
        store: Store,
        *,
        default_ms: int = DEFAULT_LEASE_MS,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
    ) -> None:
        """``default_ms`` is the lease time of frames that say 0; after ``max_deliveries``
        attempts a group goes to its dead-letter queue (0: never)."""
        if default_ms <= 0:
            raise ValueError(f"the default lease time must be positive, not {default_ms} ms")
        self._store = store
        self.default_ms = default_ms
        self.max_deliveries = max_deliveries
        #: Queues that got packets back since the broker last took them (``take_returned``).
        self.returned: list[bytes] = []
        self._heap: list[tuple[float, int, Lease]] = []
        self._serial = itertools.count()
        self._pending = 0  # leases live or waiting out a delay
        self._by_queue: dict[bytes, int] = {}  # leased packets per queue, absent when 0
        self._leased = self._acked = self._redelivered = 0
        self._dead_lettered = self._dropped = self._unknown = 0

    # -- what frames do ---------------------------------------------------------------------

    def reserve(self, holder: Holder, queue: bytes, lease_ms: int) -> Lease | None:
        """Lease what a pop of ``queue`` would take (decision 13), for ``lease_ms`` (0: the
        default); ``None`` if nothing is selectable."""
        packets = self._store.take(queue)
        if not packets:
            return None
        holder.last_id += 1
        lease = Lease(holder.last_id, holder, queue, packets, self._due(lease_ms))
        self._file(lease)
        self._schedule(lease)
        return lease

    def ack(self, holder: Holder, lease_id: int) -> bool:
        """The lease's packets are gone for good. Whether it was live (decision 14)."""
        lease = self._live(holder, lease_id)
        if lease is None:
            return False
        self._close(lease)
        self._store.discard(lease.packets)
        self._acked += len(lease.packets)
        lease.packets = []  # a heap entry may outlive it for a while: keep nothing there
        return True

    def release(self, holder: Holder, lease_id: int, delay_ms: int) -> bool:
        """End the lease now; its packets go back after ``delay_ms`` (0: at once)."""
        lease = self._live(holder, lease_id)
        if lease is None:
            return False
        if not delay_ms:
            self._end(lease)
            return True
        del holder.leases[lease_id]
        lease.holder = None
        lease.due = self._store.now() + delay_ms / 1000
        self._schedule(lease)
        return True

    def touch(self, holder: Holder, lease_id: int, lease_ms: int) -> bool:
        """The lease now ends ``lease_ms`` from now (0: the default)."""
        lease = self._live(holder, lease_id)
        if lease is None:
            return False
        lease.due = self._due(lease_ms)
        self._schedule(lease)
        return True

    def close(self, holder: Holder) -> None:
        """The holder's connection closed: every lease it holds goes back (decision 15)."""
        for lease in list(holder.leases.values()):
            self._end(lease)

    # -- time -------------------------------------------------------------------------------

    def soonest(self) -> float:
        """The earliest time ``expire`` may have work, on the store's clock; infinity if none.
        O(1); may be early (an entry a touch or an ack made stale), never late."""
        return self._heap[0][0] if self._heap else _NEVER

    def next_deadline(self) -> float | None:
        """When the earliest lease ends or delay runs out; ``None`` if none will. Drops stale
        entries on the way, so it is exact."""
        heap = self._heap
        while heap and heap[0][2].due != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def expire(self) -> None:
        """End every lease whose deadline has come and send back every group whose release
        delay has run out."""
        heap = self._heap
        now = self._store.now()
        while heap and heap[0][0] <= now:
            due, _, lease = heapq.heappop(heap)
            if lease.due == due:
                self._end(lease)

    # -- counting ---------------------------------------------------------------------------

    def leased_queues(self) -> Iterable[bytes]:
        """The queues with packets on a lease now. O(1); iterate before the next change."""
        return self._by_queue.keys()

    def leased(self, queue: bytes) -> int:
        """Packets of ``queue`` on a lease or waiting out a release delay now. O(1)."""
        return self._by_queue.get(queue, 0)

    def totals(self) -> LeaseTotals:
        return LeaseTotals(
            self._leased,
            self._acked,
            self._redelivered,
            self._dead_lettered,
            self._dropped,
            self._unknown,
        )

    def take_returned(self) -> list[bytes]:
        """The queues that got packets back since the last call, for the broker to offer."""
        returned, self.returned = self.returned, []
        return returned

    # -- inside -----------------------------------------------------------------------------

    def _due(self, lease_ms: int) -> float:
        return self._store.now() + (lease_ms or self.default_ms) / 1000

    def _schedule(self, lease: Lease) -> None:
        heap = self._heap
        heapq.heappush(heap, (lease.due, next(self._serial), lease))
        if len(heap) > 2 * self._pending + _STALE_SLACK:
            self._heap = [entry for entry in heap if entry[2].due == entry[0]]
            heapq.heapify(self._heap)

    def _live(self, holder: Holder, lease_id: int) -> Lease | None:
        """The holder's lease ``lease_id`` if it is live: a lease is live while now < its
        deadline, judged here, so a frame racing the deadline finds it ended."""
        lease = holder.leases.get(lease_id)
        if lease is not None and lease.due <= self._store.now():
            self._end(lease)  # its deadline passed before expire() came round to it
            lease = None
        if lease is None:
            self._unknown += 1
        return lease

    def _file(self, lease: Lease) -> None:
        """File a new lease under its holder's id and in the counts (``_close`` undoes it)."""
        assert lease.holder is not None
        lease.holder.leases[lease.lease_id] = lease
        count = len(lease.packets)
        self._pending += 1
        self._leased += count
        self._by_queue[lease.queue] = self._by_queue.get(lease.queue, 0) + count

    def _close(self, lease: Lease) -> None:
        """Take a lease out of its holder and the counts: it is over."""
        if lease.holder is not None:
            del lease.holder.leases[lease.lease_id]
            lease.holder = None
        lease.due = _NEVER
        self._pending -= 1
        count = len(lease.packets)
        self._leased -= count
        left = self._by_queue[lease.queue] - count
        if left:
            self._by_queue[lease.queue] = left
        else:
            del self._by_queue[lease.queue]

    def _end(self, lease: Lease) -> None:
        """The lease is over other than by an ack: its packets go back, or on to the dead."""
        self._close(lease)
        packets, lease.packets = lease.packets, []
        if self.max_deliveries and lease.attempt >= self.max_deliveries:
            self._bury(lease.queue, packets)
            return
        back = [(*packet[:LEASES], packet[LEASES] + 1) for packet in packets]
        returned = self._store.restore(lease.queue, back)  # fewer if some TTLs passed
        if returned:
            self.returned.append(lease.queue)
        self._redelivered += returned

    def _bury(self, queue: bytes, packets: Sequence[QueuedPacket]) -> None:
        """Move a group that used up its attempts to its dead-letter queue (decision 16)."""
        dead = queue + DEAD_SUFFIX
        if len(dead) > MAX_FIELD:
            self._store.discard(packets)
            self._dropped += len(packets)
            return
        moved = self._store.restore(dead, [(*packet[:LEASES], 0) for packet in packets])
        if moved:
            self.returned.append(dead)
        self._dead_lettered += moved
