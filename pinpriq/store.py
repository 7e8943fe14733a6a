"""The queues: priority order, key groups and TTL expiry (decisions 1-5).

Pure and synchronous: no sockets, no trio, and no clock of its own. The owner passes a
``clock()`` returning monotonic seconds (the server passes ``trio.current_time``, tests a fake)
and calls ``expire()`` when ``next_deadline()`` comes; every read also expires what is due
first, so an expired packet is never returned even if the owner's timer is late.

Layout of one queue, chosen so that no operation touches packets it does not return:

* ``groups[key]``: every live packet with that key (prio 0 included), in push order: the packet
  itself while it is alone (most keys are unique, and a dict costs ~200 bytes), a dict from
  sequence number to packet once there are two or more. **A packet is live exactly while its
  group holds it**: leaving the group, by pop or expiry, is all it takes to remove a packet.
* ``levels[prio]``: the selectable packets (prio 1..255) of one priority, a list in push order
  used as a stack: the newest is last. Entries of packets that left with a key group or expired
  stay until they reach the top of their level and are skipped there (lazy deletion), so a
  grouped pop or an expiry costs nothing per level, and a level needs no index: 8 bytes a
  packet. Once a queue's stale entries outnumber its live packets, its levels are rebuilt,
  which keeps memory O(live) at O(1) amortised cost.
* ``mask``: bit ``p`` set while ``levels[p]`` is non-empty, so the best level is the lowest set
  bit, found in O(1) whatever the number of levels; ``best`` is that bit's number, kept as the
  mask changes (a level is made or emptied), so a pop reads a small int instead of doing
  arithmetic on a 256-bit one (which allocates, compiled or not).

Across all queues, one heap of ``(deadline, seq, queue, key)`` orders packets with a TTL, with
the same lazy deletion: entries of packets that left by pop stay until they reach the top, or
until the heap holds more than twice as many entries as the store holds packets, when it is
rebuilt (trio's timer heap does the same).

What an operator reads (``queue_info``, ``peek``) is kept as the store changes, at no cost to a
push or pop of a lone key beyond one addition for a queue's bytes:

* ``bytes``: the queue's share of ``bytes_held``.
* ``stale``: per priority, how many of a level's entries are stale. Entries go stale only off
  the hot path (a key group's siblings, expiry), so a level's live count is its length less
  these, and prio 0's is what the levels do not hold.
* ``displaced``: keys whose group may have lost its oldest packet while the group stayed (a
  sibling expired, or a pop took part of a group). ``groups`` is in the order keys arrived, so
  the first key not displaced holds the oldest packet among undisplaced groups; the oldest
  packet of the queue is that one or the oldest of a displaced group.
* ``expiry``: the queue's own heap of the same entries as the store-wide one (shared tuples),
  for its next deadline; stale entries leave it as they leave the store-wide heap.

Packets carry no time: ``note_time``, called about once a second by the owner, records which
sequence number had been reached when, so a packet's age is known to within that interval.

Leases (decisions 13-16) need three more operations, and no change to push or pop: ``take`` is
a pop whose packets stay counted in ``bytes_held``; ``discard`` forgets taken packets for good
(an ack); ``restore`` puts taken packets back, into their own queue or another (a dead-letter
queue). A packet carries its TTL deadline and how many times it was leased, so it goes back as
it was: ``restore`` files it under its old sequence number, in its key group and its level, in
push order, and gives it an expiry entry again. Entries a packet left behind when it was taken
are reused (a level's, found by bisection) or harmless (an expiry entry, which then names a live
packet twice; compaction keeps one). What the leases themselves are (ids, deadlines, attempts)
is ``leases.py``'s.

Delayed packets (decision 21) are in no queue until they are due. ``push_delayed`` gives one its
seq at once (its place in push order) and its TTL deadline (due time plus TTL), keeps it under
its queue's name in ``_delayed`` (a ``_Delayed``: packets by seq, and their bytes, which count in
``bytes_held`` and ``delayed_bytes``), and files a *due entry* in the expiry heap: an entry
``(due, seq, queue, key, _DUE)``, one field longer than a TTL entry. Sharing the heap is what
keeps delays free for everyone else: ``next_deadline`` and the owner's one timer cover due times
with no change, and a pop, whose test of the heap's top is already there for TTLs, makes
packets due by now arrive before it selects, at no cost to a pop while none is due. When its
entry comes out of the heap in ``expire``, a packet still held (no purge took it) is filed into
its queue as ``restore`` files a packet (by its seq: among its level and its key group, in push
order), or dropped if its TTL deadline passed too (TTL wins); its queue's name goes to
``take_arrived``, for the owner to offer to waiting subscribers. A due entry, like a TTL entry,
goes stale when its packet leaves (a purge) and is skipped or compacted away.

``move`` (decision 22) takes whole key groups out of a queue, in pop order or all of them, and
files them in another under new seqs, in their old relative order, as pushes made now.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain, islice
from operator import itemgetter
from typing import Any, Final

from mypy_extensions import mypyc_attr

# The one thing the store takes from the rest of pinpriq: the types its contract names.
from pinpriq.store_contract import QueuedPacket, QueueInfo

__all__ = [
    "DEADLINE",
    "DEFAULT_MAX_POP",
    "KEY",
    "LEASES",
    "PACKET_OVERHEAD",
    "PAYLOAD",
    "PRIO",
    "SEQ",
    "Clock",
    "LoadedPacket",
    "QueueInfo",
    "QueueStore",
    "QueuedPacket",
]

Clock = Callable[[], float]

#: Most packets one pop returns: a pop reply's count is a u16 (decision 3).
DEFAULT_MAX_POP: Final = 0xFFFF
_NEVER: Final = math.inf
#: ``_Queue.best`` of a queue with no selectable packet: beyond every priority the store may be
#: given (the protocol's are 1..255; a test's wrong store files prio 0 as 256), and a small int.
_NO_LEVEL: Final = 1 << 60
#: ``_NEVER`` as one shared float object, the deadline of every packet without a TTL. mypyc
#: keeps a ``float`` unboxed, so storing ``_NEVER`` in a packet tuple would box a new float
#: object per packet: 24 bytes a packet and an allocation per push. Typed ``Any`` so it stays
#: the object it is.
_NO_DEADLINE: Final[Any] = _NEVER

#: Estimated bytes of bookkeeping per queued packet beyond its key and payload bytes: the packet
#: object, its bytes objects' headers, its entries in a level, a key group and the expiry heap.
#: Measured with tracemalloc on 200,000 pushes of 8-byte keys and 16-byte payloads: 157 bytes
#: with unique keys and no TTL, 261 with a TTL, 134 when keys repeat; the server's resident memory
#: grows by 271 bytes per packet (docs/performance.md), allocator overhead included.
PACKET_OVERHEAD: Final = 256
#: Stale level entries a queue may hold beyond its live packets before its levels are rebuilt.
_STALE_SLACK: Final = 64
#: Most time notes (``note_time``) kept; past it the older half is thinned to every other note,
#: so the age of old packets is known more coarsely, and memory stays bounded.
_MAX_TIME_NOTES = 4096

# (deadline, seq, queue, key): ordered by deadline, then push order; names the packet it stands for.
# One object in both heaps, the store's and its queue's: the empty variadic tail keeps mypyc from
# unboxing it into C locals and boxing a copy for each heap (see QueuedPacket).
_ExpiryEntry = tuple[float, int, bytes, bytes, *tuple[bytes, ...]]


#: The last field of a due entry (a delayed packet's, ``push_delayed``) in the expiry heap, which
#: tells it from a TTL entry ``(deadline, seq, queue, key)``.
_DUE: Final = b"due"

#: A packet to ``load``: ``(queue, key, payload, prio, seq)``.
LoadedPacket = tuple[bytes, bytes, bytes, int, int]

#: A packet held by the store (``QueuedPacket``, which the contract, ``store_contract``, names):
#: ``(key, payload, prio, seq, deadline, leases)``, where ``seq`` is
#: store-wide push order, ``deadline`` its TTL deadline on the store's clock (inf for TTL 0), and
#: ``leases`` how many times it was leased (decision 13's attempt count; the store only keeps
#: it). A plain tuple, read through the indices below, because the store builds one per push
#: and reads its fields on every pop: a plain tuple is the cheapest object CPython builds (a
#: named tuple takes three allocations through ``tuple.__new__``, and its fields are read
#: through descriptors). The deadline is in the expiry-heap entry too, which orders it; the
#: packet's own copy is for a packet that comes back from a lease.
#:
#: Spelled with an empty variadic tail (always ``(bytes, bytes, int, int, float, int)``) so that
#: mypyc keeps packets as the tuple objects they are: it unboxes a fixed-length tuple into C
#: locals and boxes a new tuple object each time one is stored, which gave each packet a second
#: tuple (one in its level, one in its key group: 104 bytes more a packet), two allocations per
#: pop, and broke the identity tests below (``group is packet``: a packet is live while its
#: group holds that very object). Packets without a TTL share one ``inf`` object
#: (``_NO_DEADLINE``).
KEY: Final = 0
PAYLOAD: Final = 1
PRIO: Final = 2
SEQ: Final = 3
DEADLINE: Final = 4
LEASES: Final = 5
_seq_of = itemgetter(SEQ)


def _held(packets: Iterable[QueuedPacket]) -> int:
    """The bytes ``bytes_held`` counts for these packets."""
    return sum(len(p[KEY]) + len(p[PAYLOAD]) + PACKET_OVERHEAD for p in packets)


def _group_held(packets: Sequence[QueuedPacket]) -> int:
    """``_held`` of a key group, without a generator for the common group of one."""
    if len(packets) == 1:
        packet = packets[0]
        return len(packet[KEY]) + len(packet[PAYLOAD]) + PACKET_OVERHEAD
    return _held(packets)


def _unselectable(packets: Iterable[QueuedPacket]) -> int:
    """The bytes ``unselectable_bytes`` counts for these packets: those of prio 0."""
    return _held(p for p in packets if not p[PRIO])


#: A key's packets: the lone packet itself, or a dict from sequence number to packet, push order.
_Group = QueuedPacket | dict[int, QueuedPacket]


def _members(group: _Group) -> Iterable[QueuedPacket]:
    """A group's packets in push order."""
    return group.values() if isinstance(group, dict) else (group,)


def note_time(notes: list[tuple[int, float]], seq: int, now: float) -> None:
    """Note in ``notes`` that packets up to ``seq`` had been pushed by ``now`` (a store's
    ``note_time``, shared with the packed store). O(1) amortised."""
    if notes and notes[-1][0] == seq:
        # Nothing pushed since: this note replaces that one, or the next push would be
        # dated to the start of the quiet spell.
        notes.pop()
    notes.append((seq, now))
    if len(notes) > _MAX_TIME_NOTES:
        half = len(notes) // 2
        notes[:half] = notes[:half:2]


def load_time_notes(notes: list[tuple[int, float]], times: Sequence[tuple[int, float]]) -> None:
    """Replace ``notes`` by ``times`` (a store's ``load``: recovered packets' ages), thinned as
    ``note_time`` thins them. O(len(times))."""
    notes[:] = times
    while len(notes) > _MAX_TIME_NOTES:
        half = len(notes) // 2
        notes[:half] = notes[:half:2]


def age(notes: Sequence[tuple[int, float]], seq: int, now: float) -> float | None:
    """Seconds since packet ``seq`` was pushed, at most: since the last note before it."""
    index = bisect_left(notes, (seq, -math.inf)) - 1  # the last note with a smaller seq
    return now - notes[index][1] if index >= 0 else None


class _Queue:
    __slots__ = (
        "best",
        "bytes",
        "displaced",
        "entries",
        "expiry",
        "groups",
        "levels",
        "mask",
        "name",
        "size",
        "stale",
    )

    def __init__(self, name: bytes) -> None:
        # Expiry entries refer to this one name object, not to each push's copy of it.
        self.name = name
        self.groups: dict[bytes, _Group] = {}
        self.levels: dict[int, list[QueuedPacket]] = {}
        self.mask = 0
        self.best = _NO_LEVEL  # the lowest set bit of mask; _NO_LEVEL while it is 0
        self.size = 0  # live packets, prio 0 included
        self.entries = 0  # level entries, live or stale
        self.bytes = 0  # its share of bytes_held
        # Made when first needed: most queues never have a stale entry, a displaced group or
        # a TTL, and a queue is made per push to an empty one.
        self.stale: Counter[int] | None = None  # stale level entries per prio
        self.displaced: set[bytes] | None = None  # keys whose oldest packet may have left
        self.expiry: list[_ExpiryEntry] | None = None  # this queue's expiry entries, a heap

    def holds(self, packet: QueuedPacket) -> bool:
        """Whether ``packet`` is live: still in its key group."""
        group = self.groups.get(packet[KEY])
        return group is packet or (isinstance(group, dict) and packet[SEQ] in group)

    def top(self) -> tuple[int, int, QueuedPacket] | None:
        """The best live selectable packet as ``(prio, seq, packet)``, without removing it;
        stale entries found on the way are dropped. ``None`` if nothing is selectable."""
        while self.best != _NO_LEVEL:
            prio = self.best
            level = self.levels[prio]
            packet = level[-1]
            if self.holds(packet):
                return prio, packet[SEQ], packet
            self.drop_top(prio, level)
        return None

    def drop_top(self, prio: int, level: list[QueuedPacket]) -> None:
        """Remove the newest entry of a level, a stale one, forgetting the level if it empties."""
        level.pop()
        self.entries -= 1
        self.stale[prio] -= 1  # type: ignore[index]  # a stale entry was counted there
        if not level:
            self.drop_level(prio)

    def add_level(self, prio: int, packet: QueuedPacket) -> None:
        """Make the level of ``prio``, which holds nothing yet, with ``packet`` in it."""
        self.levels[prio] = [packet]
        self.mask |= 1 << prio
        if prio < self.best:
            self.best = prio

    def drop_level(self, prio: int) -> None:
        """Forget the level of ``prio``, which has emptied."""
        del self.levels[prio]
        mask = self.mask & ~(1 << prio)
        self.mask = mask
        self.best = (mask & -mask).bit_length() - 1 if mask else _NO_LEVEL

    def went_stale(self, packets: Iterable[QueuedPacket]) -> None:
        """Count the level entries of packets that left other than by being popped off their
        level (prio 0 has no level: not counted)."""
        if self.stale is None:
            self.stale = Counter()
        self.stale.update(p[PRIO] for p in packets if p[PRIO])

    def displace(self, key: bytes) -> None:
        """Note that ``key``'s group may have lost its oldest packet and stays queued."""
        if self.displaced is None:
            self.displaced = set()
        self.displaced.add(key)
        if len(self.displaced) > len(self.groups) + _STALE_SLACK:
            self.displaced &= self.groups.keys()  # forget keys that left: O(1) amortised

    def oldest(self) -> QueuedPacket | None:
        """The live packet pushed first. O(displaced keys)."""
        displaced = self.displaced or set()
        groups = self.groups
        oldest = None
        for key in groups:  # in the order keys arrived; each group in push order
            if key not in displaced:
                oldest = next(iter(_members(groups[key])))
                break
        for key in displaced & groups.keys():
            first = next(iter(_members(groups[key])))
            if oldest is None or first[SEQ] < oldest[SEQ]:
                oldest = first
        return oldest

    def by_priority(self) -> dict[int, int]:
        """Live packets per priority, prio 0 included, ascending; only those held. O(levels)."""
        levels, stale = self.levels, self.stale
        counts = {prio: len(levels[prio]) for prio in sorted(levels)}
        if stale:  # levels may hold entries of packets that left: not counted
            counts = {prio: n - stale.get(prio, 0) for prio, n in counts.items()}
            counts = {prio: n for prio, n in counts.items() if n}
        unselectable = self.size - sum(counts.values())
        return {0: unselectable, **counts} if unselectable else counts

    def packets(self) -> Iterator[QueuedPacket]:
        """Every live packet, in no particular order. O(packets)."""
        for group in self.groups.values():
            yield from _members(group)

    def refile(self, packet: QueuedPacket) -> None:
        """File a selectable packet coming back from a lease in its level, in push order. Its
        old entry, if still there (stale while it was away), is the one it takes again."""
        prio, seq = packet[PRIO], packet[SEQ]
        level = self.levels.get(prio)
        if level is None:
            self.add_level(prio, packet)
            self.entries += 1
            return
        at = bisect_left(level, seq, key=_seq_of)
        if at < len(level) and level[at][SEQ] == seq:
            level[at] = packet  # the same packet, perhaps as a new tuple (its lease count)
            self.stale[prio] -= 1  # type: ignore[index]  # it was stale while the packet was away
        else:
            level.insert(at, packet)
            self.entries += 1

    def compact(self) -> None:
        """Rebuild the levels without stale entries. O(entries)."""
        levels = {}
        for prio, level in self.levels.items():
            live = [packet for packet in level if self.holds(packet)]
            if live:
                levels[prio] = live
        self.levels = levels
        self.mask = sum(1 << prio for prio in levels)
        self.best = min(levels, default=_NO_LEVEL)
        self.entries = sum(len(level) for level in levels.values())
        self.stale = None


class _Delayed:
    """The delayed packets of one queue: in no level or key group until they are due."""

    __slots__ = ("bytes", "name", "packets")

    def __init__(self, name: bytes) -> None:
        self.name = name  # the one name object its due entries refer to
        self.packets: dict[int, QueuedPacket] = {}  # by seq; a packet leaves when it is due
        self.bytes = 0  # its share of ``bytes_held`` (and of ``delayed_bytes``)


# Compiled by mypyc where a C compiler is present (setup.py); subclassed by interpreted code
# (the conformance tests' wrong stores, a log-backed store), which mypyc refuses unless told.
@mypyc_attr(allow_interpreted_subclasses=True)
class QueueStore:
    """Named priority queues of packets, with key grouping and TTL expiry.

    Costs, for a queue of depth n: ``push`` O(log t) where t is the number of packets with a
    TTL (O(1) without one); ``pop`` O(g) for a reply of g packets, amortised over the stale
    entries it skips, plus O(log t) for each packet that expired since the last sweep. Neither
    depends on other queues or other keys.
    """

    def __init__(self, clock: Clock, *, max_pop: int = DEFAULT_MAX_POP) -> None:
        if max_pop < 1:
            raise ValueError(f"max_pop must be at least 1, not {max_pop}")
        self._clock = clock
        self._max_pop = max_pop
        #: Estimated memory held by queued packets: key and payload bytes plus
        #: ``PACKET_OVERHEAD`` each. What the server's memory cap compares against.
        self.bytes_held = 0
        #: The part of ``bytes_held`` held by prio-0 packets, which never leave on their own.
        self.unselectable_bytes = 0
        #: Packets removed at their deadline so far, by ``expire`` or before a read, or dropped
        #: by ``restore`` because their deadline passed while they were taken.
        self.expired = 0
        #: Packets removed by ``purge`` so far.
        self.purged = 0
        #: The part of ``bytes_held`` held by packets taken and not yet restored or discarded.
        self.taken_bytes = 0
        #: The part of ``bytes_held`` held by delayed packets, not yet due.
        self.delayed_bytes = 0
        self._queues: dict[bytes, _Queue] = {}
        #: Delayed packets by queue name; a queue is here while it holds one.
        self._delayed: dict[bytes, _Delayed] = {}
        #: Queues delayed packets entered since ``take_arrived`` was last called.
        self._arrived: list[bytes] = []
        self._seq = 0
        #: Packets removed by pops (``take`` included), and put back by ``restore`` (those it
        #: drops at their deadline included, as they count in ``expired``). Packets held are
        #: derived (``__len__``), which spares a push the addition that pays for its queue's
        #: ``bytes``.
        self._popped = 0
        self._restored = 0
        #: Seqs that are no push's: those ``load`` skipped (used, before a restart, by packets
        #: no longer held) and those ``move`` gave packets anew.
        self._skipped = 0
        self._expiry: list[_ExpiryEntry] = []
        #: ``(seq, time)``: by ``time``, packets up to ``seq`` had been pushed (``note_time``).
        self._time_notes: list[tuple[int, float]] = []

    def __len__(self) -> int:
        """Packets held, in all queues, delayed ones included."""
        return (
            self._seq - self._skipped - self._popped + self._restored - self.expired - self.purged
        )

    @property
    def pushed(self) -> int:
        """Packets pushed since the store was made, and those ``load`` put back."""
        return self._seq - self._skipped

    @property
    def queue_count(self) -> int:
        """Queues holding at least one packet, delayed ones included; empty queues are
        forgotten (decision 5). O(1), plus O(queues holding delayed packets)."""
        queues = self._queues
        return len(queues) + sum(name not in queues for name in self._delayed)

    def now(self) -> float:
        """The store's clock, which every deadline it takes and returns is on."""
        return self._clock()

    def depth(self, queue: bytes) -> int:
        """Packets held in one queue, selectable or not. O(1)."""
        q = self._queues.get(queue)
        return q.size if q is not None else 0

    def sizes(self) -> Iterator[tuple[bytes, int, int]]:
        """Every queue holding packets, with its packets (as ``QueueInfo.packets``: delayed
        ones not counted) and its bytes (delayed ones' included); a queue holding only delayed
        packets too. O(1) per queue."""
        delayed = self._delayed
        for name, q in self._queues.items():
            waiting = delayed.get(name) if delayed else None
            yield name, q.size, q.bytes if waiting is None else q.bytes + waiting.bytes
        for name, waiting in delayed.items():
            if name not in self._queues:
                yield name, 0, waiting.bytes

    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> float:
        """Queue a packet; returns its deadline on the store's clock (inf for TTL 0)."""
        self._seq += 1
        seq = self._seq
        deadline = self._clock() + ttl_ms / 1000 if ttl_ms else _NEVER
        # Any: one float object for the packet and its expiry entry, the shared one for no TTL.
        boxed: Any = deadline if ttl_ms else _NO_DEADLINE
        # Annotated where it is assigned: one tuple object (above).
        packet: QueuedPacket = (key, payload, prio, seq, boxed, 0)
        size = len(key) + len(payload) + PACKET_OVERHEAD
        q = self._queues.get(queue)
        if q is None:
            q = self._queues[queue] = _Queue(queue)
        groups = q.groups
        group = groups.get(key)
        if group is None:
            groups[key] = packet
        elif isinstance(group, dict):
            group[seq] = packet
        else:
            groups[key] = {group[SEQ]: group, seq: packet}
        if prio:
            level = q.levels.get(prio)
            if level is None:
                q.add_level(prio, packet)
            else:
                level.append(packet)
            q.entries += 1
        else:
            self.unselectable_bytes += size
        if ttl_ms:
            self._file_expiry(q, (boxed, seq, q.name, key))
        q.size += 1
        q.bytes += size
        self.bytes_held += size
        return deadline

    def push_delayed(
        self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int, delay_ms: int
    ) -> float:
        """Hold a packet until ``delay_ms`` from now, when it enters ``queue`` (decision 21);
        returns that due time on the store's clock. Its place in push order (its seq) is taken
        now; its TTL deadline is its due time plus ``ttl_ms`` (none for 0). O(log d) for d
        delayed packets and TTL entries."""
        self._seq += 1
        seq = self._seq
        due = self._clock() + delay_ms / 1000
        deadline: Any = due + ttl_ms / 1000 if ttl_ms else _NO_DEADLINE
        packet: QueuedPacket = (key, payload, prio, seq, deadline, 0)
        heapq.heappush(self._expiry, self._hold(queue, packet, due))
        self.bytes_held += len(key) + len(payload) + PACKET_OVERHEAD
        return due

    def _hold(self, queue: bytes, packet: QueuedPacket, due: float) -> _ExpiryEntry:
        """Keep a delayed packet under ``queue`` until ``due`` (its bytes counted in
        ``delayed_bytes``; the caller counts them in ``bytes_held``); returns its due entry,
        for the caller to put in the expiry heap."""
        waiting = self._delayed.get(queue)
        if waiting is None:
            waiting = self._delayed[queue] = _Delayed(queue)
        waiting.packets[packet[SEQ]] = packet
        size = len(packet[KEY]) + len(packet[PAYLOAD]) + PACKET_OVERHEAD
        waiting.bytes += size
        self.delayed_bytes += size
        return (due, packet[SEQ], waiting.name, packet[KEY], _DUE)

    def delayed_packets(self, queue: bytes) -> list[QueuedPacket]:
        """The delayed packets of ``queue`` not yet due, in no particular order (a log-backed
        store records their removal when a purge takes them). O(their number)."""
        waiting = self._delayed.get(queue)
        return list(waiting.packets.values()) if waiting is not None else []

    def take_arrived(self) -> list[bytes]:
        """The queues delayed packets entered since the last call (a name may repeat), for the
        owner to offer to waiting subscribers, as a push would be."""
        arrived, self._arrived = self._arrived, []
        return arrived

    def _file_expiry(self, q: _Queue, entry: _ExpiryEntry) -> None:
        """Enter a packet's expiry entry in the store's heap and its queue's."""
        heapq.heappush(self._expiry, entry)
        if q.expiry is None:
            q.expiry = [entry]
        else:
            heapq.heappush(q.expiry, entry)

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
        if q is None:
            return []
        levels, groups = q.levels, q.groups
        while True:  # the newest entry of the best level, skipping stale ones
            prio = q.best
            if prio == _NO_LEVEL:
                return []
            level = levels[prio]
            selected = level.pop()
            q.entries -= 1
            if not level:
                q.drop_level(prio)
            key = selected[KEY]
            group = groups.get(key)
            if group is selected:  # a key of its own: the common case
                del groups[key]
                reply = [selected]
                size = len(key) + len(selected[PAYLOAD]) + PACKET_OVERHEAD
                self.bytes_held -= size
                q.bytes -= size
                break
            if isinstance(group, dict) and selected[SEQ] in group:
                reply = self._take_group(q, key, group, selected)
                break
            q.stale[prio] -= 1  # type: ignore[index]  # a stale entry skipped: it was counted
        q.size -= len(reply)
        self._popped += len(reply)
        if not groups:
            del self._queues[queue]
        elif q.entries > 2 * q.size + _STALE_SLACK:
            q.compact()
        # The first test is redundant but spares the arithmetic when nothing has a TTL.
        if len(expiry) > _STALE_SLACK and len(expiry) > 2 * len(self) + _STALE_SLACK:
            self._compact_expiry()
        return reply

    def _take_group(
        self, q: _Queue, key: bytes, group: dict[int, QueuedPacket], selected: QueuedPacket
    ) -> list[QueuedPacket]:
        """Remove the selected packet and up to ``max_pop - 1`` siblings from their group."""
        del group[selected[SEQ]]
        if len(group) < self._max_pop:  # the whole group goes
            reply = [selected, *group.values()]
            del q.groups[key]
        else:
            reply = [selected, *islice(group.values(), self._max_pop - 1)]
            for sibling in islice(reply, 1, None):
                del group[sibling[SEQ]]
            if len(group) == 1:
                q.groups[key] = next(iter(group.values()))
            q.displace(key)
        q.went_stale(islice(reply, 1, None))
        held = _held(reply)
        self.bytes_held -= held
        q.bytes -= held
        self.unselectable_bytes -= _unselectable(reply)
        return reply

    def take(self, queue: bytes) -> list[QueuedPacket]:
        """``pop``, for a lease: the packets leave their queue but stay counted in
        ``bytes_held`` (and ``taken_bytes``) until ``restore`` or ``discard``. O(pop + g)."""
        # QueueStore's pop, not an override's: a take is no removal (decision 19: a log-backed
        # store does not log it; an ack is logged, through ``discard``).
        packets = QueueStore.pop(self, queue)
        if packets:
            held = _group_held(packets)
            self.bytes_held += held
            self.taken_bytes += held
        return packets

    def discard(self, packets: Sequence[QueuedPacket]) -> None:
        """Forget packets ``take`` returned, for good (an ack). O(g)."""
        held = _group_held(packets)
        self.bytes_held -= held
        self.taken_bytes -= held

    def restore(self, queue: bytes, packets: Sequence[QueuedPacket]) -> int:
        """Put packets ``take`` returned, all of one key, back into ``queue`` (theirs or
        another): each with its prio, its place in push order and its TTL deadline, as if it had
        never left. Those whose deadline has passed are dropped instead, and counted in
        ``expired`` (decision 15: TTL wins). Returns how many went back.

        O(g log g) for a group of g packets with the packets of their key already queued, plus,
        per packet, a bisection of its level and moving that level's later entries, and O(log t)
        for its expiry entry.
        """
        self.taken_bytes -= _held(packets)
        self._restored += len(packets)  # those dropped count as expired: they leave again
        now = self._clock()
        live = [packet for packet in packets if packet[DEADLINE] > now]
        if len(live) < len(packets):
            self.expired += len(packets) - len(live)
            self.bytes_held -= _held(p for p in packets if p[DEADLINE] <= now)
        if not live:
            return 0
        self._file_group(queue, live)
        return len(live)

    def _file_group(
        self, queue: bytes, packets: Sequence[QueuedPacket], *, newest: bool = False
    ) -> None:
        """File packets of one key, whose bytes ``bytes_held`` already counts, into ``queue``
        by their seqs: in their key group and their level, in push order, with an expiry entry
        each. ``newest``: their seqs are above every seq in the queue (a move), so keys still
        arrive in the order of their oldest packets and none is displaced. O(g log g) for a
        group of g packets with the packets of their key, plus a level's bisection each."""
        q = self._queues.get(queue)
        if q is None:
            q = self._queues[queue] = _Queue(queue)
        key = packets[0][KEY]
        group = q.groups.get(key)
        members = sorted(
            [*packets, *_members(group)] if group is not None else packets, key=_seq_of
        )
        q.groups[key] = members[0] if len(members) == 1 else {p[SEQ]: p for p in members}
        if not newest:
            q.displace(key)  # the group may now hold the queue's oldest packet
        for packet in packets:
            if packet[PRIO]:
                q.refile(packet)
            else:
                self.unselectable_bytes += len(key) + len(packet[PAYLOAD]) + PACKET_OVERHEAD
            if packet[DEADLINE] != _NEVER:
                self._file_expiry(q, (packet[DEADLINE], packet[SEQ], q.name, key))
        q.size += len(packets)
        q.bytes += _held(packets)

    def peek_rank(self, queue: bytes) -> tuple[int, int] | None:
        """How good the packet a pop of ``queue`` would select is: ``(prio, -seq)``, smaller is
        better, comparable across queues (decision 6); ``None`` if nothing is selectable."""
        expiry = self._expiry
        if expiry and expiry[0][0] <= self._clock():
            self.expire()
        q = self._queues.get(queue)
        top = q.top() if q is not None else None
        return (top[0], -top[1]) if top is not None else None

    def next_deadline(self) -> float | None:
        """When the earliest live packet expires, on the store's clock; ``None`` if none will."""
        heap = self._expiry
        while heap and self._live(heap[0]) is None:
            self._drop_queue_entries(heapq.heappop(heap)[2])
        return heap[0][0] if heap else None

    def _drop_queue_entries(self, queue: bytes) -> None:
        """Drop the stale entries at the top of a queue's expiry heap: called when an entry of
        that queue left the store-wide heap, the earliest, so the queue's copy is at its top."""
        q = self._queues.get(queue)
        heap = q.expiry if q is not None else None
        while heap and self._live(heap[0]) is None:
            heapq.heappop(heap)

    def expire(self) -> int:
        """Remove every packet whose deadline has come, and file every delayed packet that is
        due into its queue (``take_arrived`` names those queues); returns how many packets were
        removed, delayed ones whose TTL deadline passed before they arrived included.

        A packet expires when the clock reaches its deadline: with TTL t it is live for
        ``now < push_time + t``. A delayed packet is due when the clock reaches its due time.
        """
        heap = self._expiry
        if not heap:
            return 0
        now = self._clock()
        removed: list[QueuedPacket] = []
        late: list[QueuedPacket] = []  # delayed packets dropped as they arrived: in no queue
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            packet = self._live(entry)
            if packet is None:
                self._drop_queue_entries(entry[2])
                continue
            if len(entry) > 4:  # a due entry: the packet arrives
                if self._arrive(entry[2], packet, now):
                    late.append(packet)
                continue
            queue = entry[2]
            q = self._queues[queue]
            self._ungroup(q, packet)
            q.size -= 1
            q.bytes -= len(packet[KEY]) + len(packet[PAYLOAD]) + PACKET_OVERHEAD
            if not q.groups:
                del self._queues[queue]
            else:
                q.went_stale((packet,))
                self._drop_queue_entries(queue)
                if q.entries > 2 * q.size + _STALE_SLACK:
                    q.compact()
            removed.append(packet)
        self.unselectable_bytes -= _unselectable(removed)
        if late:
            removed += late
        self.bytes_held -= _held(removed)
        self.expired += len(removed)
        if removed:
            self._removed_by_expiry(removed)
        return len(removed)

    def _arrive(self, queue: bytes, packet: QueuedPacket, now: float) -> bool:
        """A delayed packet is due: file it into its queue, or, if its TTL deadline has passed
        as well, drop it (TTL wins). Whether it was dropped: ``expire`` counts it then."""
        waiting = self._delayed[queue]
        del waiting.packets[packet[SEQ]]
        size = len(packet[KEY]) + len(packet[PAYLOAD]) + PACKET_OVERHEAD
        waiting.bytes -= size
        self.delayed_bytes -= size
        if not waiting.packets:
            del self._delayed[queue]
        if packet[DEADLINE] <= now:
            return True  # expire takes its bytes from bytes_held
        self._file_group(queue, (packet,))
        arrived = self._arrived
        if not arrived or arrived[-1] != queue:
            arrived.append(queue)
        return False

    def _removed_by_expiry(self, packets: list[QueuedPacket]) -> None:
        """Called by ``expire`` with the packets it removed. A store that records removals
        (the log-backed store) overrides it; here there is nothing to do."""

    def load(
        self,
        packets: Iterable[LoadedPacket],
        deadlines: Mapping[int, float],
        last_seq: int,
        *,
        times: Sequence[tuple[int, float]] = (),
        delayed: Mapping[int, float] | None = None,
    ) -> None:
        """Put back packets queued before a restart, each ``(queue, key, payload, prio, seq)``
        with its own seq, in increasing seq, into a store no push has touched; ``deadlines``
        maps the seqs of those with a TTL to their deadline on this store's clock, and
        ``delayed`` the seqs of those still delayed to their due time on it. Pushes then
        go on after ``last_seq``, the last seq the log used. Levels and key groups are in push
        order, so this rebuilds exactly the order pops had. (Not ``restore``, which puts back
        packets a lease took.)

        It files each packet as ``push`` does (keep the two in step: a test compares a loaded
        store with the one that pushed), in one loop that keeps the queue it is filling in
        locals (packets of one queue tend to come in runs), and one heapify: recovery loads
        millions. Packets carry no time: ``times`` gives their ages (``queue_info``), as
        ``note_time``'s notes would have, ``(seq, time on this store's clock)`` in seq order:
        by that time packets up to that seq had been pushed. O(n).
        """
        queues, first = self._queues, self._seq
        last = first
        expiry: list[_ExpiryEntry] = []
        count = held = unselectable = riders = 0
        name: bytes | None = None
        q = _Queue(b"")  # replaced by the first packet's queue
        for queue, key, payload, prio, seq in packets:
            if seq <= last:
                raise ValueError(f"loading seq {seq} after seq {last}: not in push order")
            last = seq
            due = delayed.get(seq) if delayed else None
            if due is not None:  # held until it is due, in no queue, as push_delayed holds it
                held_until: Any = deadlines.get(seq, _NO_DEADLINE) if deadlines else _NO_DEADLINE
                expiry.append(self._hold(queue, (key, payload, prio, seq, held_until, 0), due))
                count += 1
                held += len(key) + len(payload)
                continue
            if queue != name:
                q = queues.get(queue) or queues.setdefault(queue, _Queue(queue))
                name = queue
            # Any: a boxed float, the shared one for no TTL (see push).
            deadline: Any = deadlines.get(seq, _NO_DEADLINE) if deadlines else _NO_DEADLINE
            packet: QueuedPacket = (key, payload, prio, seq, deadline, 0)  # one object (above)
            groups = q.groups
            group = groups.get(key)
            if group is None:
                groups[key] = packet
            elif isinstance(group, dict):
                group[seq] = packet
            else:
                groups[key] = {group[SEQ]: group, seq: packet}
            size = len(key) + len(payload)
            if prio:
                level = q.levels.get(prio)
                if level is None:
                    q.add_level(prio, packet)
                else:
                    level.append(packet)
                q.entries += 1
            else:
                unselectable += size
                riders += 1
            if deadline != _NEVER:
                entry: _ExpiryEntry = (deadline, seq, q.name, key)
                expiry.append(entry)
                if q.expiry is None:
                    q.expiry = [entry]
                else:
                    q.expiry.append(entry)
            q.size += 1
            q.bytes += size + PACKET_OVERHEAD
            count += 1
            held += size
        if last_seq < last:
            raise ValueError(f"last_seq {last_seq} is before the last packet's seq {last}")
        # Seqs the log used for packets that are gone: held packets are derived (__len__).
        self._skipped += last_seq - first - count
        self._seq = last_seq
        self.bytes_held += held + count * PACKET_OVERHEAD
        self.unselectable_bytes += unselectable + riders * PACKET_OVERHEAD
        self._expiry += expiry
        heapq.heapify(self._expiry)
        for q in queues.values():
            if q.expiry:
                heapq.heapify(q.expiry)
        # Notes taken while loading would date these packets to now.
        load_time_notes(self._time_notes, times)

    def holds(self, queue: bytes, key: bytes, seq: int) -> bool:
        """Whether packet ``seq``, pushed to ``queue`` with ``key``, is still queued, or
        delayed for ``queue``. O(1)."""
        if self._live((0.0, seq, queue, key)) is not None:
            return True
        waiting = self._delayed.get(queue) if self._delayed else None
        return waiting is not None and seq in waiting.packets

    @staticmethod
    def _ungroup(q: _Queue, packet: QueuedPacket) -> None:
        """Take a live packet out of its key group, which is what removes it."""
        key = packet[KEY]
        group = q.groups[key]
        if not isinstance(group, dict):
            del q.groups[key]
            return
        del group[packet[SEQ]]
        if len(group) == 1:
            q.groups[key] = next(iter(group.values()))
        q.displace(key)

    def _live(self, entry: _ExpiryEntry) -> QueuedPacket | None:
        """The packet an expiry entry stands for, or ``None`` if it has left the store; for a
        due entry, the delayed packet, or ``None`` if it was purged."""
        seq, queue, key = entry[1], entry[2], entry[3]
        if len(entry) > 4:
            waiting = self._delayed.get(queue)
            return waiting.packets.get(seq) if waiting is not None else None
        q = self._queues.get(queue)
        if q is None:
            return None
        group = q.groups.get(key)
        if isinstance(group, dict):
            return group.get(seq)
        return group if group is not None and group[SEQ] == seq else None

    def _compact_expiry(self) -> None:
        """Drop stale expiry entries, and all but one entry of a packet that came back from a
        lease and so has two; ``pop`` calls this once the entries outnumber the store's packets
        twice over, so the heap's memory stays O(live) and the rebuild's cost is amortised."""
        kept: dict[int, _ExpiryEntry] = {}
        for entry in self._expiry:
            if entry[1] not in kept and self._live(entry) is not None:
                kept[entry[1]] = entry
        self._expiry = list(kept.values())
        heapq.heapify(self._expiry)
        for q in self._queues.values():
            q.expiry = None
        for entry in self._expiry:
            if len(entry) > 4:
                continue  # a due entry: its packet is in no queue yet
            q = self._queues[entry[2]]
            if q.expiry is None:
                q.expiry = [entry]
            else:
                q.expiry.append(entry)
        for q in self._queues.values():
            if q.expiry is not None:
                heapq.heapify(q.expiry)

    def peek(self, queue: bytes, count: int) -> list[QueuedPacket]:
        """The next ``count`` packets (at most) that pops of ``queue`` would return, in that
        order, without removing any: each pop's selected packet, then its key group. A
        ``count`` of 0 shows nothing (as every store answers); a negative one is a
        ``ValueError``.

        O(count + levels), plus the stale entries passed on the way.
        """
        if count < 0:
            raise ValueError("peek count must be 0 or more")
        expiry = self._expiry
        if expiry and expiry[0][0] <= self._clock():
            self.expire()
        q = self._queues.get(queue)
        if q is None or count == 0:
            return []
        taken: set[int] = set()  # seqs already in the answer
        found: list[QueuedPacket] = []
        for prio in sorted(q.levels):
            for selected in reversed(q.levels[prio]):  # newest first
                if selected[SEQ] in taken or not q.holds(selected):
                    continue
                siblings = _members(q.groups[selected[KEY]])
                rest = (p for p in siblings if p[SEQ] not in taken and p is not selected)
                for packet in islice(chain((selected,), rest), self._max_pop):
                    taken.add(packet[SEQ])
                    found.append(packet)
                    if len(found) == count:
                        return found
        return found

    def queued(self, queue: bytes) -> list[QueuedPacket]:
        """Every queued packet of ``queue`` (prio 0 included), in push order. O(packets): for
        tests and tools, which see every packet through it whatever the store's layout."""
        q = self._queues.get(queue)
        return sorted(q.packets(), key=_seq_of) if q is not None else []

    def purge(self, queue: bytes) -> int:
        """Remove every packet of ``queue``, prio 0 and delayed ones included; returns how
        many. O(packets removed)."""
        # Its expiry and due entries go stale: they name a queue that is gone, or, once the
        # name is used again, sequence numbers that are not there.
        purged = 0
        q = self._queues.pop(queue, None)
        if q is not None:
            self.bytes_held -= q.bytes
            self.unselectable_bytes -= _unselectable(q.packets())
            purged += q.size
        waiting = self._delayed.pop(queue, None)
        if waiting is not None:
            self.bytes_held -= waiting.bytes
            self.delayed_bytes -= waiting.bytes
            purged += len(waiting.packets)
        self.purged += purged
        return purged

    def move(self, source: bytes, target: bytes, limit: int = 0) -> int:
        """Move queued packets from ``source`` to ``target`` (decision 22); returns how many.

        Whole key groups go, in pop order while fewer than ``limit`` packets have moved (the
        first group moves whole even if larger), or every packet for ``limit`` 0, prio-0 ones
        whose key has no selectable packet included. They keep key, payload, prio and TTL
        deadline; their lease counts start again; they enter ``target`` as pushes made now,
        under new seqs in their old relative order. Delayed (and leased) packets stay. O(m log
        m) for m packets moved, plus the stale entries passed on the way.
        """
        if source == target:
            raise ValueError("a queue cannot be moved to itself")
        expiry = self._expiry
        if expiry and expiry[0][0] <= self._clock():
            self.expire()
        q = self._queues.get(source)
        if q is None:
            return 0
        moving = self._take_groups(q, limit) if limit else list(q.packets())
        if not limit or not q.groups:
            del self._queues[source]  # its entries go stale, as a purge's do
        elif q.entries > 2 * q.size + _STALE_SLACK:
            q.compact()
        moving.sort(key=_seq_of)
        by_key: dict[bytes, list[QueuedPacket]] = {}
        renumbered_all: list[QueuedPacket] = []
        for packet in moving:
            self._seq += 1
            key = packet[KEY]
            renumbered: QueuedPacket = (
                key,
                packet[PAYLOAD],
                packet[PRIO],
                self._seq,
                packet[DEADLINE],
                0,
            )
            by_key.setdefault(key, []).append(renumbered)
            renumbered_all.append(renumbered)
        self._skipped += len(moving)  # seqs no push took: ``pushed`` and ``len`` stay
        if not limit:
            self.unselectable_bytes -= _unselectable(moving)
        for packets in by_key.values():
            self._file_group(target, packets, newest=True)
        if moving:
            self._moved(target, moving, renumbered_all)
        if len(expiry) > _STALE_SLACK and len(expiry) > 2 * len(self) + _STALE_SLACK:
            self._compact_expiry()
        return len(moving)

    def _moved(self, target: bytes, old: list[QueuedPacket], new: list[QueuedPacket]) -> None:
        """Called by ``move`` with the packets it took out (in seq order) and the same packets
        as filed into ``target`` under their new seqs (in the same order). A store that records
        changes (the log-backed store) overrides it; here there is nothing to do."""

    def _take_groups(self, q: _Queue, limit: int) -> list[QueuedPacket]:
        """Take whole key groups out of ``q``, in pop order, while fewer than ``limit`` packets
        were taken. Their bytes stay in ``bytes_held``; they leave ``unselectable_bytes``."""
        taken: list[QueuedPacket] = []
        while len(taken) < limit:
            top = q.top()
            if top is None:
                break
            members = list(_members(q.groups.pop(top[2][KEY])))
            q.went_stale(members)  # their level entries, the top's included, go stale
            q.size -= len(members)
            q.bytes -= _held(members)
            self.unselectable_bytes -= _unselectable(members)
            taken += members
        return taken

    def queue_info(self, queue: bytes) -> QueueInfo:
        """What one queue holds (all zero for one that holds nothing). O(levels + displaced
        keys), plus the stale expiry entries it drops."""
        waiting = self._delayed.get(queue)
        delayed, delayed_bytes = (len(waiting.packets), waiting.bytes) if waiting else (0, 0)
        q = self._queues.get(queue)
        if q is None:
            return QueueInfo(0, delayed_bytes, {}, None, None, delayed)
        now = self._clock()
        heap = q.expiry
        while heap and self._live(heap[0]) is None:
            heapq.heappop(heap)
        oldest = q.oldest()
        return QueueInfo(
            q.size,
            q.bytes + delayed_bytes,
            q.by_priority(),
            None if oldest is None else self._age(oldest[SEQ], now),
            max(0.0, heap[0][0] - now) if heap else None,
            delayed,
        )

    def note_time(self) -> None:
        """Note which packets had been pushed by now; ``queue_info`` reads packets' ages from
        these notes. The server calls it about once a second. O(1) amortised."""
        note_time(self._time_notes, self._seq, self._clock())

    def _age(self, seq: int, now: float) -> float | None:
        """Seconds since packet ``seq`` was pushed, at most: since the last note before it."""
        return age(self._time_notes, seq, now)

    def check_invariants(self) -> None:
        """Assert the internal structures agree with each other. For tests; O(n log n)."""
        count = 0
        held: list[QueuedPacket] = []
        for name, q in self._queues.items():
            assert q.groups, f"queue {name!r} is empty but remembered"
            assert q.name == name, f"queue {name!r} filed under {q.name!r}"
            selectable: dict[int, QueuedPacket] = {}
            for key, group in q.groups.items():
                members = list(_members(group))
                seqs = [packet[SEQ] for packet in members]
                assert seqs == sorted(seqs), "group out of push order"
                if isinstance(group, dict):
                    assert len(group) > 1, "a dict group of one packet"
                    assert list(group) == seqs, "group filed under the wrong seqs"
                for packet in members:
                    assert packet[KEY] == key, "packet filed under the wrong key"
                    if packet[PRIO]:
                        selectable[packet[SEQ]] = packet
                held.extend(members)
                count += len(members)
            assert q.size == sum(len(list(_members(g))) for g in q.groups.values()), "size"
            entries = {p[SEQ]: p for level in q.levels.values() for p in level}
            assert q.entries == sum(map(len, q.levels.values())), "entries count is wrong"
            assert len(entries) == q.entries, "a packet is twice in the levels"
            for seq, packet in selectable.items():
                assert entries.get(seq) is packet, "a live selectable packet is not in its level"
            for prio, level in q.levels.items():
                assert level, f"empty level {prio}"
                assert all(p[PRIO] == prio for p in level)
                seqs = [p[SEQ] for p in level]
                assert seqs == sorted(seqs), "level out of push order"
            assert q.mask == sum(1 << prio for prio in q.levels), "mask disagrees with levels"
            assert q.best == min(q.levels, default=_NO_LEVEL), "best is not the best level"
            assert q.entries <= 2 * q.size + _STALE_SLACK + 1, "stale entries not compacted"
            assert q.bytes == _held(q.packets()), f"queue {name!r}: bytes is wrong"
            for prio, level in q.levels.items():
                live = sum(q.holds(p) for p in level)
                assert len(level) - (q.stale or Counter())[prio] == live, "stale count is wrong"
            first = min(q.packets(), key=lambda p: p[SEQ])
            assert q.oldest() is first, f"queue {name!r}: oldest packet is wrong"
            in_heap = {entry[:2] for entry in q.expiry or ()}
            for packet in q.packets():
                if packet[DEADLINE] != _NEVER:
                    assert (packet[DEADLINE], packet[SEQ]) in in_heap, "no entry in its queue"
            heap = q.expiry or []
            assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))), "not a heap"
        delayed = 0
        due = {entry[1] for entry in self._expiry if len(entry) > 4}
        for name, waiting in self._delayed.items():
            assert waiting.packets, f"queue {name!r} has no delayed packet but is remembered"
            assert waiting.name == name, f"delayed packets of {name!r} filed under {waiting.name!r}"
            assert waiting.bytes == _held(waiting.packets.values()), "delayed bytes are wrong"
            assert due >= waiting.packets.keys(), "a delayed packet has no due entry"
            delayed += len(waiting.packets)
        assert sum(w.bytes for w in self._delayed.values()) == self.delayed_bytes, "delayed_bytes"
        assert count + delayed == len(self), f"count {len(self)} but {count + delayed} packets held"
        queued = _held(held)
        assert queued + self.taken_bytes + self.delayed_bytes == self.bytes_held, (
            f"bytes_held {self.bytes_held}"
        )
        assert _unselectable(held) == self.unselectable_bytes, "unselectable_bytes is wrong"
        ttl_entries = {entry[:2] for entry in self._expiry if self._live(entry) is not None}
        for packet in held:
            if packet[DEADLINE] != _NEVER:
                assert (packet[DEADLINE], packet[SEQ]) in ttl_entries, "a TTL packet has no entry"
