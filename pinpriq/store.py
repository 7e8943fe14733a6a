"""The queues: priority order, key groups and TTL expiry (decisions 1-5).

Pure and synchronous: no sockets, no trio, and no clock of its own. The owner passes a
``clock()`` returning monotonic seconds (the server passes ``trio.current_time``, tests a fake)
and calls ``expire()`` when ``next_deadline()`` comes; every read also expires what is due
first, so an expired packet is never returned even if the owner's timer is late.

Layout of one queue, chosen so that no operation touches packets it does not return:

* ``levels[prio]``: the selectable packets (prio 1..255) of one priority, a dict from sequence
  number to packet. Dicts keep insertion order and ``popitem()`` removes the newest entry, so
  each level is a stack with O(1) removal from the middle as well.
* ``mask``: bit ``p`` set while ``levels[p]`` is non-empty, so the best level is the lowest set
  bit, found in O(1) whatever the number of levels.
* ``groups[key]``: every packet with that key (prio 0 included), in push order: the packet
  itself while it is alone (most keys are unique, and a dict costs ~200 bytes), a dict from
  sequence number to packet once there are two or more.

Across all queues, one heap of ``(deadline, seq, queue, key)`` orders packets with a TTL.
Entries of packets that left by pop stay in the heap until they reach its top or until stale
entries outnumber live ones, when the heap is rebuilt (trio's timer heap does the same).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from itertools import islice
from typing import NamedTuple

__all__ = ["DEFAULT_MAX_POP", "PACKET_OVERHEAD", "Clock", "QueueStore", "QueuedPacket"]

Clock = Callable[[], float]

#: Most packets one pop returns: a pop reply's count is a u16 (decision 3).
DEFAULT_MAX_POP = 0xFFFF
_NEVER = math.inf

#: Estimated bytes of bookkeeping per queued packet beyond its key and payload bytes: the packet
#: object, its bytes objects' headers, its entries in a level, a key group and the expiry heap.
#: Measured with tracemalloc on 200,000 pushes of 8-byte keys and 16-byte payloads: 180 bytes
#: with unique keys and no TTL, 284 with a TTL, 157 when keys repeat.
PACKET_OVERHEAD = 256

# (deadline, seq, queue, key): ordered by deadline, then push order; names the packet it stands for.
_ExpiryEntry = tuple[float, int, bytes, bytes]


class QueuedPacket(NamedTuple):
    """A packet held by the store. ``seq`` is store-wide push order; ``deadline`` is inf for
    TTL 0. A named tuple because the store builds one per push: ``tuple.__new__`` is several
    times cheaper than an ``__init__``."""

    key: bytes
    payload: bytes
    prio: int
    seq: int
    deadline: float


_new_packet = tuple.__new__


def _held(packets: list[QueuedPacket]) -> int:
    """The bytes ``bytes_held`` counts for these packets."""
    if len(packets) == 1:
        packet = packets[0]
        return len(packet.key) + len(packet.payload) + PACKET_OVERHEAD
    return sum(len(p.key) + len(p.payload) for p in packets) + PACKET_OVERHEAD * len(packets)


#: A key's packets: the lone packet itself, or a dict from sequence number to packet, push order.
_Group = QueuedPacket | dict[int, QueuedPacket]


def _members(group: _Group) -> Iterable[QueuedPacket]:
    """A group's packets in push order."""
    return group.values() if isinstance(group, dict) else (group,)


class _Queue:
    __slots__ = ("groups", "levels", "mask", "name")

    def __init__(self, name: bytes) -> None:
        # Expiry entries refer to this one name object, not to each push's copy of it.
        self.name = name
        self.levels: dict[int, dict[int, QueuedPacket]] = {}
        self.mask = 0
        self.groups: dict[bytes, _Group] = {}

    def best_prio(self) -> int:
        """The lowest non-empty priority level; only valid while ``mask`` is non-zero."""
        return (self.mask & -self.mask).bit_length() - 1


class QueueStore:
    """Named priority queues of packets, with key grouping and TTL expiry.

    Costs, for a queue of depth n: ``push`` O(log t) where t is the number of packets with a
    TTL (O(1) without one); ``pop`` O(g) for a reply of g packets, plus O(log t) for each packet
    that expired since the last sweep. Neither depends on other queues or other keys.
    """

    def __init__(self, clock: Clock, *, max_pop: int = DEFAULT_MAX_POP) -> None:
        if max_pop < 1:
            raise ValueError(f"max_pop must be at least 1, not {max_pop}")
        self._clock = clock
        self._max_pop = max_pop
        #: Estimated memory held by queued packets: key and payload bytes plus
        #: ``PACKET_OVERHEAD`` each. What the server's memory cap compares against.
        self.bytes_held = 0
        self._queues: dict[bytes, _Queue] = {}
        self._seq = 0
        self._count = 0
        self._expiry: list[_ExpiryEntry] = []
        self._timed = 0  # live packets with a deadline, to tell when the heap is mostly stale

    def __len__(self) -> int:
        """Packets held, in all queues."""
        return self._count

    @property
    def queue_count(self) -> int:
        """Queues holding at least one packet; empty queues are forgotten (decision 5)."""
        return len(self._queues)

    def depth(self, queue: bytes) -> int:
        """Packets held in one queue, selectable or not. O(number of keys in the queue)."""
        q = self._queues.get(queue)
        if q is None:
            return 0
        return sum(len(group) if isinstance(group, dict) else 1 for group in q.groups.values())

    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> float:
        """Queue a packet; returns its deadline on the store's clock (inf for TTL 0)."""
        self._seq += 1
        seq = self._seq
        deadline = self._clock() + ttl_ms / 1000 if ttl_ms else _NEVER
        packet = _new_packet(QueuedPacket, (key, payload, prio, seq, deadline))
        q = self._queues.get(queue)
        if q is None:
            q = self._queues[queue] = _Queue(queue)
        group = q.groups.get(key)
        if group is None:
            q.groups[key] = packet
        elif isinstance(group, dict):
            group[seq] = packet
        else:
            q.groups[key] = {group.seq: group, seq: packet}
        if prio:
            level = q.levels.get(prio)
            if level is None:
                q.levels[prio] = {seq: packet}
                q.mask |= 1 << prio
            else:
                level[seq] = packet
        if ttl_ms:
            heapq.heappush(self._expiry, (deadline, seq, q.name, key))
            self._timed += 1
        self._count += 1
        self.bytes_held += len(key) + len(payload) + PACKET_OVERHEAD
        return deadline

    def pop(self, queue: bytes) -> list[QueuedPacket]:
        """Remove and return the best packet with the rest of its key group (decision 3).

        The best packet is the lowest prio among 1..255, the newest on ties; it comes first,
        then its same-key siblings (any prio) oldest first, up to ``max_pop`` packets in all.
        An empty list when the queue has no selectable packet (decision 4).
        """
        expiry = self._expiry
        if expiry and expiry[0][0] <= self._clock():
            self.expire()
        q = self._queues.get(queue)
        if q is None or not q.mask:
            return []
        mask = q.mask
        prio = (mask & -mask).bit_length() - 1  # the lowest set bit: the best level
        level = q.levels[prio]
        seq, selected = level.popitem()
        if not level:
            self._drop_level(q, prio)
        if selected.deadline != _NEVER:
            self._timed -= 1
        key = selected.key
        group = q.groups[key]
        if isinstance(group, dict):
            del group[seq]
            reply = [selected, *islice(group.values(), self._max_pop - 1)]
            for sibling in islice(reply, 1, None):
                del group[sibling.seq]
                self._unlevel(q, sibling)
            self._settle_group(q, key, group)
            self.bytes_held -= _held(reply)
        else:  # a key of its own: the common case
            del q.groups[key]
            reply = [selected]
            self.bytes_held -= len(key) + len(selected.payload) + PACKET_OVERHEAD
        self._count -= len(reply)
        if not q.groups:
            del self._queues[queue]
        if len(expiry) > 2 * self._timed + 64:
            self._compact_expiry()
        return reply

    def peek_rank(self, queue: bytes) -> tuple[int, int] | None:
        """How good the packet a pop of ``queue`` would select is: ``(prio, -seq)``, smaller is
        better, comparable across queues (decision 6); ``None`` if nothing is selectable."""
        self.expire()
        q = self._queues.get(queue)
        if q is None or not q.mask:
            return None
        prio = q.best_prio()
        return (prio, -next(reversed(q.levels[prio])))

    def next_deadline(self) -> float | None:
        """When the earliest live packet expires, on the store's clock; ``None`` if none will."""
        heap = self._expiry
        while heap and self._live(heap[0]) is None:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def expire(self) -> int:
        """Remove every packet whose deadline has come; returns how many were removed.

        A packet expires when the clock reaches its deadline: with TTL t it is live for
        ``now < push_time + t``.
        """
        heap = self._expiry
        if not heap:
            return 0
        now = self._clock()
        removed: list[QueuedPacket] = []
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            packet = self._live(entry)
            if packet is None:
                continue
            queue = entry[2]
            q = self._queues[queue]
            self._remove(q, packet)
            if not q.groups:
                del self._queues[queue]
            removed.append(packet)
        self._count -= len(removed)
        self.bytes_held -= _held(removed)
        return len(removed)

    def _remove(self, q: _Queue, packet: QueuedPacket) -> None:
        """Take a packet out of its group and its level; the caller fixes counts and empty
        queues."""
        group = q.groups[packet.key]
        if isinstance(group, dict):
            del group[packet.seq]
            self._settle_group(q, packet.key, group)
        else:
            del q.groups[packet.key]
        self._unlevel(q, packet)

    @staticmethod
    def _settle_group(q: _Queue, key: bytes, group: dict[int, QueuedPacket]) -> None:
        """After removals from a dict group: forget it if empty, unwrap it if one is left."""
        if len(group) > 1:
            return
        if group:
            q.groups[key] = next(iter(group.values()))
        else:
            del q.groups[key]

    def _unlevel(self, q: _Queue, packet: QueuedPacket) -> None:
        """Take a packet out of its priority level (if selectable) and the timed count."""
        if packet.prio:
            level = q.levels[packet.prio]
            del level[packet.seq]
            if not level:
                self._drop_level(q, packet.prio)
        if packet.deadline != _NEVER:
            self._timed -= 1

    @staticmethod
    def _drop_level(q: _Queue, prio: int) -> None:
        del q.levels[prio]
        q.mask &= ~(1 << prio)

    def _live(self, entry: _ExpiryEntry) -> QueuedPacket | None:
        """The packet an expiry entry stands for, or ``None`` if it has left the store."""
        _, seq, queue, key = entry
        q = self._queues.get(queue)
        if q is None:
            return None
        group = q.groups.get(key)
        if isinstance(group, dict):
            return group.get(seq)
        return group if group is not None and group.seq == seq else None

    def _compact_expiry(self) -> None:
        """Drop stale expiry entries; ``pop`` calls this once they outnumber live ones twice
        over, so the heap's memory stays O(live) and the rebuild's cost is amortised."""
        self._expiry = [entry for entry in self._expiry if self._live(entry) is not None]
        heapq.heapify(self._expiry)

    def check_invariants(self) -> None:
        """Assert the internal structures agree with each other. For tests; O(n log n)."""
        count = timed = 0
        for name, q in self._queues.items():
            assert q.groups, f"queue {name!r} is empty but remembered"
            assert q.name == name, f"queue {name!r} filed under {q.name!r}"
            selectable: dict[int, QueuedPacket] = {}
            for key, group in q.groups.items():
                members = list(_members(group))
                seqs = [packet.seq for packet in members]
                assert seqs == sorted(seqs), "group out of push order"
                if isinstance(group, dict):
                    assert len(group) > 1, "a dict group of one packet"
                    assert list(group) == seqs, "group filed under the wrong seqs"
                for packet in members:
                    assert packet.key == key, "packet filed under the wrong key"
                    if packet.prio:
                        selectable[packet.seq] = packet
                    if packet.deadline != _NEVER:
                        timed += 1
                count += len(members)
            levels = {seq: p for level in q.levels.values() for seq, p in level.items()}
            assert levels.keys() == selectable.keys(), "levels disagree with groups"
            for prio, level in q.levels.items():
                assert level, f"empty level {prio}"
                assert all(p.prio == prio for p in level.values())
                assert list(level) == sorted(level), "level out of push order"
            assert q.mask == sum(1 << prio for prio in q.levels), "mask disagrees with levels"
        assert count == self._count, f"count {self._count} but {count} packets held"
        held = _held(
            [p for q in self._queues.values() for g in q.groups.values() for p in _members(g)]
        )
        assert held == self.bytes_held, f"bytes_held {self.bytes_held} but {held} held"
        assert timed == self._timed, f"{self._timed} timed but {timed} held"
        live_entries = [entry for entry in self._expiry if self._live(entry) is not None]
        assert len(live_entries) == timed, "a timed packet has no expiry entry"
