"""The Redis store: queues kept in Redis (standalone or Cluster), shared by any number of
pinpriq front ends.

It answers the ``Store`` contract the way ``store_contract`` describes for an asynchronous
store: before ``Session.receive`` applies a batch, the connection's reader awaits
``run(frames)``, which sends the batch's pushes and pops to Redis as one pipeline of scripts
(``lua.py``), one atomic script each; ``receive`` then calls ``push`` and ``pop`` as on the
built-in store, and ``pop`` hands back those results in order. Deliveries are
``deliveries.RedisSubscriptions``' work.

What stays in the front end is only what may be lost with it: counters of its own traffic, a
timer per queue it pushed a TTL to (so expired packets are swept at their deadline rather than
at the next pop), and a snapshot of the queues' sizes for the admin listener, refreshed every
few seconds by scanning each node (there is no cross-slot index on Cluster).

Redis trouble never reaches a client as an error. Unreachable, loading, or out of memory, the
reader's ``run`` logs once and retries with backoff, holding that connection's frames (and its
replies) until Redis answers; clients time out on their own if they want to.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
from collections import deque
from collections.abc import Callable, Container, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import coredis
import trio
from coredis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    ResponseError,
    TryAgainError,
)
from coredis.exceptions import ConnectionError as RedisConnectionError

from pinpriq.leases import DEAD_SUFFIX
from pinpriq.redis import lua
from pinpriq.redis.direct import DirectConnection, Pending
from pinpriq.redis.keys import PREFIX, QueueKeys, hash_tag, name_of, queue_keys
from pinpriq.redis.leases import RedisLeases
from pinpriq.store import QueuedPacket
from pinpriq.store_contract import PeekedPacket, QueueInfo, Rank
from pinpriq.wire import (
    MAX_FIELD,
    Ack,
    ClientFrame,
    DelayedPush,
    KeyedPayload,
    Pop,
    Push,
    Release,
    Reserve,
    Touch,
)

if TYPE_CHECKING:
    from pinpriq.broker import Session

__all__ = ["DEFAULT_MAX_POP", "Popped", "RedisStore", "busy"]

log = logging.getLogger("pinpriq.redis")

#: Most packets one pop returns (decision 3).
DEFAULT_MAX_POP = 0xFFFF
#: Seconds between refreshes of the queue-size snapshot the admin listener reads.
SNAPSHOT_INTERVAL = 5.0
#: How long a group of a cross-slot move may stay on its way before a scan finishes its move
#: (its front end died between the halves); far beyond the two calls a live one takes.
MOVE_ABANDONED_MS = 60_000
#: Most confirmed pop results one pop call tells Redis to forget (the rest wait for the next).
CONFIRMS_PER_CALL = 100
#: Backoff while Redis is unreachable or full: from the first to the last, doubling.
RETRY_FIRST, RETRY_MAX = 0.01, 1.0
#: The errors that mean "Redis is not answering now, try again": never the client's fault.
_TRANSIENT = (
    RedisConnectionError,
    TimeoutError,
    BusyLoadingError,
    ClusterDownError,
    TryAgainError,
    OSError,
)


class Popped(NamedTuple):
    """A packet as a pop script returns it: enough to put it back exactly as it was."""

    key: bytes
    payload: bytes
    prio: int
    seq: bytes
    deadline: bytes  # ms on Redis's clock, 0 for never, as the script wrote it


class _Snapshot(NamedTuple):
    """The queues' sizes and next deadlines, as last scanned."""

    sizes: dict[bytes, int]
    next_expiry: dict[bytes, float]  # queue -> seconds from the scan to its next deadline
    taken_at: float  # trio time of the scan
    delayed: dict[bytes, int]  # queue -> its delayed packets (decision 21), where it has any


def _ignore(queue: bytes) -> None:
    """The default ``on_arrived``."""


def _popped(reply: Sequence[Any]) -> list[Popped]:
    return [
        Popped(reply[i], reply[i + 1], int(reply[i + 2]), reply[i + 3], reply[i + 4])
        for i in range(0, len(reply), 5)
    ]


def _pops(reply: Sequence[Any]) -> Iterator[Sequence[Any]]:
    """Each pop's items in a pop call's reply: each pop's item count, then its items; then
    come how many selectable packets are left, and all."""
    at, end = 0, len(reply) - 2
    while at < end:
        count = int(reply[at])
        yield reply[at + 1 : at + 1 + count]
        at += 1 + count


def _keyed(packets: Sequence[bytes]) -> list[KeyedPayload]:
    """A plain pop's packets, as the function returns them (each its field and record)."""
    key_at, payload_at = lua.KEY_AT, lua.PAYLOAD_AT
    return [(packets[i][key_at:], packets[i + 1][payload_at:]) for i in range(0, len(packets), 2)]


_Call = tuple[str, Sequence[bytes], Sequence[bytes | int | str]]  # operation, KEYS, ARGV

#: The function each operation calls (``lua.LIBRARY``).
_FUNCTIONS = {
    operation: lua.function_name(operation)
    for operation in (
        "push", "push_delayed", "pop", "rank", "sweep", "purge", "restore", "peek", "move",
        "move_out", "move_in", "moves_kept", "reserve", "lease_op", "lease_sweep",
    )
}  # fmt: skip


class RedisStore:
    """Queues in Redis. Made by ``connect.open_store``, which checks the Redis first."""

    #: The broker's memory cap does not apply: Redis's ``maxmemory`` is the cap, and a push
    #: refused for it waits in ``run``. ``bytes_held`` is Redis's ``used_memory`` (every node's,
    #: as last scanned), shown against ``memory_cap``; the broker's cap stays infinite, so it
    #: never blocks on it. These stay 0.
    unselectable_bytes = 0
    taken_bytes = 0
    leases_unsupported: str | None = None

    def __init__(self, client: Any, *, cluster: bool, max_pop: int = DEFAULT_MAX_POP) -> None:
        self.client = client
        self.cluster = cluster
        self.max_pop = max_pop
        self._pushed = 0
        #: Packets this front end removed: by pop frames, sweeps and purges.
        self.popped = 0
        self.expired = 0
        self.purged = 0
        self._keys: dict[bytes, QueueKeys] = {}
        #: Sweeps owed: (trio time, queue), a heap; ``_sweep_at`` dedupes it per queue.
        self._sweeps: list[tuple[float, bytes]] = []
        self._sweep_at: dict[bytes, float] = {}
        self._sweep_wake = trio.CancelScope()
        #: Redis's clock less trio's, in seconds: turns deadlines into timer times.
        self.clock_offset = 0.0
        self._snapshot = _Snapshot({}, {}, 0.0, {})
        #: Estimated bytes of delayed packets (Redis's ``MEMORY USAGE`` of their hashes), as
        #: last scanned: a part of ``bytes_held``.
        self.delayed_bytes = 0
        #: Queues this front end has subscribers waiting on (``RedisSubscriptions`` sets it):
        #: it times their delayed packets' promotion whoever pushed them.
        self.waited: Container[bytes] = ()
        #: Called with a queue delayed packets just entered through this front end's timer,
        #: to offer it to the waiters here (``RedisSubscriptions`` sets it).
        self.on_arrived: Callable[[bytes], None] = _ignore
        #: The latest due time (ms, Redis's clock) of delayed packets this front end pushed,
        #: by queue: its timer follows the queue's due times up to there.
        self._own_due: dict[bytes, float] = {}
        self.bytes_held = 0
        #: Redis's ``maxmemory`` (summed over a Cluster's primaries); infinite for none.
        self.memory_cap = math.inf
        self._troubled: str | None = None  # what is wrong with Redis now, logged once
        #: The lease table's front-end half (``make_leases``), and what it needs from here.
        self.leases: RedisLeases | None = None
        self._front = os.urandom(6).hex().encode()  # this front end, in lease handles
        self._handles = itertools.count(1)
        self._pop_ids = itertools.count(1)
        #: Pop calls whose replies this front end has, by queue: Redis keeps each result
        #: (``:r``) until told so, so that a pop sent again after a lost reply is idempotent.
        self._confirmed: dict[bytes, list[bytes]] = {}
        #: Queues whose kept results' lifetime a pop call renewed since the last cleanup.
        self._kept_renewed: set[bytes] = set()
        #: Leases of closed connections, to release now: (queue, handle).
        self.closing: list[tuple[bytes, bytes]] = []
        #: Lease sweeps owed: (trio time, queue), as ``_sweeps``.
        self._lease_sweeps: list[tuple[float, bytes]] = []
        self._lease_sweep_at: dict[bytes, float] = {}
        self._lease_wake = trio.CancelScope()
        #: Connections to Redis that answer in the calling task, for every script call
        #: (standalone Redis only; ``connect.open_store`` makes them), or ``None``.
        self.direct: DirectConnection | None = None
        #: Pops sent for deliveries by ``pop_early``, by queue, until a delivery takes them.
        self._early: dict[bytes, tuple[_Call, Pending]] = {}

    # -- the Store contract, as the broker calls it ------------------------------------------

    @property
    def pushed(self) -> int:
        """Pushes this front end applied."""
        return self._pushed

    def __len__(self) -> int:
        """Packets held in all queues, delayed ones included, as of the last snapshot."""
        return sum(self._snapshot.sizes.values()) + sum(self._snapshot.delayed.values())

    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> float:
        """Already done by ``run``; the deadline is Redis's business, so never the broker's
        timer."""
        self._pushed += 1
        return math.inf

    def push_delayed(
        self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int, delay_ms: int
    ) -> float:
        """Already done by ``run``; the due time is on Redis's clock, so never the broker's
        timer (``sweep_loop`` promotes)."""
        self._pushed += 1
        return math.inf

    def take_arrived(self) -> list[bytes]:
        """None here: packets that fall due through this front end are offered to its waiters
        by ``on_arrived``, and to other front ends' by the queue's channel."""
        return []

    def pop(self, queue: bytes) -> list[KeyedPayload]:
        """Not used: pops run in ``run``, whose results the server hands to
        ``Session.receive`` with the frames."""
        raise NotImplementedError("the Redis store pops in run(), asynchronously")

    def peek_rank(self, queue: bytes) -> Rank | None:
        """Not used: ``RedisSubscriptions`` ranks queues in Redis (``ranks``)."""
        raise NotImplementedError("the Redis store ranks queues asynchronously")

    def next_deadline(self) -> float | None:
        return None  # sweeps are this store's own timer (``sweep_loop``)

    def expire(self) -> int:
        return 0

    @property
    def queue_count(self) -> int:
        return len(self._snapshot.sizes.keys() | self._snapshot.delayed.keys())

    def sizes(self) -> Iterator[tuple[bytes, int, int]]:
        """Queues and their packets (queues holding only delayed packets too), from the
        snapshot; bytes are not known (0)."""
        sizes, delayed = self._snapshot.sizes, self._snapshot.delayed
        for name, packets in sizes.items():
            yield name, packets, 0
        for name in delayed.keys() - sizes.keys():
            yield name, 0, 0

    def queue_info(self, queue: bytes) -> QueueInfo:
        """From the snapshot: packets and the next expiry; bytes, priorities and ages are not
        kept in Redis (each would cost every push another write)."""
        snapshot = self._snapshot
        expiry = snapshot.next_expiry.get(queue)
        if expiry is not None:
            expiry = max(0.0, expiry - (trio.current_time() - snapshot.taken_at))
        return QueueInfo(
            snapshot.sizes.get(queue, 0),
            0,
            {},
            None,
            expiry,
            delayed=snapshot.delayed.get(queue, 0),
        )

    def peek(self, queue: bytes, count: int) -> Sequence[PeekedPacket]:
        raise NotImplementedError("the Redis store peeks asynchronously: use peek_async")

    def purge(self, queue: bytes) -> int:
        raise NotImplementedError("the Redis store purges asynchronously: use purge_async")

    def move(self, source: bytes, target: bytes, limit: int) -> int:
        raise NotImplementedError("the Redis store moves asynchronously: use move_async")

    def note_time(self) -> None:
        """Nothing to note: ages are not kept."""

    # Leases: ``RedisLeases`` (made by ``make_leases``) takes the lease frames; the memory
    # store's take/discard/restore are never called here.

    def now(self) -> float:
        return trio.current_time()

    def take(self, queue: bytes) -> Sequence[QueuedPacket]:
        raise NotImplementedError("the Redis store leases in Redis (RedisLeases)")

    def discard(self, packets: Sequence[QueuedPacket]) -> None:
        raise NotImplementedError("the Redis store leases in Redis (RedisLeases)")

    def restore(self, queue: bytes, packets: Sequence[QueuedPacket]) -> int:
        raise NotImplementedError("the Redis store leases in Redis (RedisLeases)")

    def describe(self) -> dict[str, Any]:
        """What ``/stats`` says about this store, and which of its figures it cannot give."""
        return {
            "kind": "redis-cluster" if self.cluster else "redis",
            "snapshot_age_s": round(trio.current_time() - self._snapshot.taken_at, 3),
            "not_given": [
                "memory.prio_0_bytes (0 here)",
                "queues[].bytes, by_priority and oldest_age_ms (not kept in Redis)",
            ],
            "notes": [
                "memory: Redis's used_memory against its maxmemory (INFO memory, summed over a "
                "Cluster's primaries), as of the last scan",
                "packets and queue depths: a scan of Redis every "
                f"{SNAPSHOT_INTERVAL:g} s (snapshot_age_s)",
                "totals and rates: this front end's own traffic",
                "leases: this front end's lease traffic; leases.leased and queues[].leased are "
                "the packets on leases this front end made and still holds (other front ends' "
                "leases live in Redis and are not counted here)",
            ],
            #: The figures that count this front end only, not the whole Redis.
            "per_front_end": ["totals", "rates_per_s", "leases", "queues[].leased"],
        }

    # -- what the reader and the subscriptions await -----------------------------------------

    def keys(self, queue: bytes) -> QueueKeys:
        """The keys of a queue, remembered for the queues in use."""
        keys = self._keys.get(queue)
        if keys is None:
            if len(self._keys) > 10_000:
                self._keys.clear()  # a bound, not a policy: rebuilding one is cheap
            keys = self._keys[queue] = queue_keys(queue)
        return keys

    async def run(self, frames: Sequence[ClientFrame]) -> deque[list[KeyedPayload]]:
        """Apply the pushes and pops of ``frames`` in Redis, in order, as one pipeline; returns
        the pops' results, in frame order, for ``Session.receive``. Consecutive pushes to one
        queue are one script call, and so are consecutive pops of one queue: the same effect,
        far fewer calls."""
        calls: list[_Call] = []
        queues: list[bytes] = []  # the queue of each call
        last_kind: type | None = None
        last_queue = b""
        for frame in frames:
            kind = frame.__class__
            if kind is Push:
                queue, key, payload, ttl_ms, prio = cast(Push, frame)
                if kind is last_kind and queue == last_queue:
                    calls[-1][2].extend((key, payload, ttl_ms, prio))  # type: ignore[attr-defined]
                    continue
                k = self.keys(queue)
                calls.append(("push", k[:5], [k.channel, 0, key, payload, ttl_ms, prio]))
            elif kind is DelayedPush:
                queue, key, payload, ttl_ms, prio, delay_ms = cast(DelayedPush, frame)
                if kind is last_kind and queue == last_queue:
                    calls[-1][2].extend((key, payload, ttl_ms, prio, delay_ms))  # type: ignore[attr-defined]
                    continue
                k = self.keys(queue)
                calls.append(
                    (
                        "push_delayed",
                        [k.data, k.delayed, k.due, k.waiting],
                        [key, payload, ttl_ms, prio, delay_ms],
                    )
                )
            elif kind is Pop:
                queue = cast(Pop, frame).queue
                if kind is last_kind and queue == last_queue:
                    calls[-1][2][1] += 1  # type: ignore[index, operator]
                    continue
                calls.append(self._pop_call(queue, full=0))
            else:
                continue
            last_kind, last_queue = kind, queue
            queues.append(queue)
        results: deque[list[KeyedPayload]] = deque()
        if not calls:
            return results
        _count_last_pushes(calls, queues)
        replies = await self.call_all(calls)
        for (name, _, args), reply, queue in zip(calls, replies, queues, strict=True):
            if name == "pop":
                for one in _pops(reply):
                    results.append(_keyed(one))
                    self.popped += len(one) // 2
                self._took(queue, args, reply)
            elif name == "push_delayed":
                earliest, delayed = float(reply[0]), int(reply[1])
                self._own_due[queue] = max(self._own_due.get(queue, 0.0), earliest)
                self.schedule_sweep(queue, earliest)
                self._note_delayed(queue, delayed)
            else:
                earliest, size = reply
                if earliest:  # the earliest deadline of its pushes: sweep the queue then
                    self.schedule_sweep(queue, float(earliest))
                if int(size) >= 0:  # counted by the batch's last push call of the queue
                    self.note_size(queue, int(size))
        return results

    def _timed(self, queue: bytes) -> list[bytes]:
        """The KEYS of a function that promotes the queue's due packets: d s g x, its delayed
        packets, their due times, its waiting mark, its lease table."""
        k = self.keys(queue)
        return [*k[:4], k.delayed, k.due, k.waiting, k.leases]

    def _sweep_call(self, queue: bytes) -> _Call:
        return ("sweep", self._timed(queue), ())

    def _swept(self, queue: bytes, reply: Sequence[Any], *, chained: bool = True) -> None:
        """A sweep's reply: its figures; the queue offered to the waiters here when delayed
        packets entered it; and the next due time timed, when this front end follows the
        queue's (it pushed delayed packets due by then, or has waiters on it)."""
        expired, entered, next_due, size = reply
        self.expired += int(expired)
        self.note_size(queue, int(size))
        if int(entered):
            self.on_arrived(queue)
        due = float(next_due)
        own = self._own_due.get(queue, 0.0)
        if not due or due > own:
            self._own_due.pop(queue, None)
        if chained and due and (due <= own or queue in self.waited):
            # Not before a millisecond from now: should trio's clock run ahead of Redis's, the
            # sweep that found nothing due yet comes again a little later, not at once.
            due = max(due, (trio.current_time() + self.clock_offset + 0.001) * 1000)
            self.schedule_sweep(queue, due)

    def _pop_call(self, queue: bytes, *, full: int) -> _Call:
        """A pop of ``queue`` under a new call id, telling Redis which results it may forget."""
        k = self.keys(queue)
        call_id = b"%s:%d" % (self._front, next(self._pop_ids))
        confirmed = self._confirmed.pop(queue, [])
        if len(confirmed) > CONFIRMS_PER_CALL:
            self._confirmed[queue] = confirmed[CONFIRMS_PER_CALL:]
            confirmed = confirmed[:CONFIRMS_PER_CALL]
        refresh = 0
        if queue not in self._kept_renewed:  # its first pop since the last cleanup
            self._kept_renewed.add(queue)
            refresh = 1
        return (
            "pop",
            [*k[:4], k.results, k.delayed, k.due, k.waiting, k.leases],
            [self.max_pop, 1, full, call_id, 0, refresh, *confirmed],
        )

    def _took(self, queue: bytes, args: Sequence[Any], reply: Sequence[Any]) -> None:
        """A pop call's reply is here: its size figure (when it removed packets: else it did
        not count them), and its result to confirm."""
        if int(reply[-1]) >= 0:
            self.note_size(queue, int(reply[-1]))
        if any(_pops(reply)):  # it took packets: Redis kept the reply under its id
            self._confirmed.setdefault(queue, []).append(args[3])

    async def confirm_results(self) -> None:
        """Tell Redis which pop results this front end has, for queues no pop call told."""
        self._kept_renewed.clear()  # the next pop of each queue renews its kept results' life
        confirmed, self._confirmed = self._confirmed, {}
        if not confirmed:
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for queue, call_ids in confirmed.items():
                    pipe.hdel(self.keys(queue).results, call_ids)
        except _TRANSIENT:
            for queue, call_ids in confirmed.items():  # told next time
                self._confirmed.setdefault(queue, []).extend(call_ids)
            raise

    def _note_delayed(self, queue: bytes, delayed: int) -> None:
        """A script said how many delayed packets ``queue`` holds now."""
        if delayed:
            self._snapshot.delayed[queue] = delayed
        else:
            self._snapshot.delayed.pop(queue, None)

    def note_size(self, queue: bytes, packets: int) -> None:
        """A script said how many packets ``queue`` holds now: the admin listener's figures say
        so at once, not at the next scan (which still brings other front ends' changes)."""
        if packets:
            self._snapshot.sizes[queue] = packets
        else:
            self._snapshot.sizes.pop(queue, None)

    async def pop_for_delivery(self, queue: bytes) -> tuple[list[Popped], bool]:
        """Pop ``queue`` now, for a delivery (or take the result of the pop ``pop_early`` sent);
        and whether it holds more selectable packets."""
        early = self._early.pop(queue, None)
        if early is None:
            call = self._pop_call(queue, full=1)
            (reply,) = await self.call_all([call])
        else:
            call, reply = early[0], await self._early_reply(*early)
        self._took(queue, call[2], reply)
        return _popped(next(_pops(reply))), bool(reply[-2])

    def pop_early(self, queue: bytes) -> None:
        """Send a delivery's pop of ``queue`` now, from the task that heard packets entered it
        (``RedisSubscriptions._heard``): written in that task, it reaches Redis without waiting
        for the delivering task's turn and then the sender's; ``pop_for_delivery`` of the queue
        takes its result, and ``drop_early`` puts back what nobody took. One per queue at a
        time; standalone Redis only (the direct connection)."""
        if self.direct is None or queue in self._early:
            return
        call = self._pop_call(queue, full=1)
        self._early[queue] = (call, self.direct.send_now([_command(call)]))

    async def _early_reply(self, call: _Call, pending: Pending) -> Any:
        """An early pop's reply; if Redis could not answer it, the pop sent again as
        ``call_all`` sends it (it may have run: with its call id, it answers what it took)."""
        try:
            (reply,) = await DirectConnection.replies(pending)
        except _TRANSIENT:
            reply = None
        if reply is None or isinstance(reply, Exception):
            (reply,) = await self.call_all([_retried(call)])
        return reply

    async def drop_early(self, keep: Container[bytes] = ()) -> list[bytes]:
        """Put back the packets of early pops no delivery took (their waiter left meanwhile),
        but for the queues in ``keep`` (a delivery may take those still); returns the queues
        packets went back to."""
        dropped = [queue for queue in self._early if queue not in keep]
        returned = []
        for queue in dropped:
            call, pending = self._early.pop(queue)
            reply = await self._early_reply(call, pending)
            self._took(queue, call[2], reply)
            packets = _popped(next(_pops(reply)))
            if packets:
                await self.put_back(queue, packets)
                returned.append(queue)
        return returned

    async def put_back(self, queue: bytes, packets: Sequence[Popped]) -> int:
        """Put popped packets back as they were (a delivery nobody could take)."""
        k = self.keys(queue)
        args: list[bytes | int | str] = [k.channel]
        for packet in packets:
            args.extend(packet)
        (reply,) = await self.call_all([("restore", k[:5], args)])
        return int(reply)

    async def ranks(self, queues: Sequence[bytes]) -> list[tuple[int, int] | None]:
        """The rank (``(prio, -seq)``, smaller is better) of what each queue's pop would take;
        ``None`` where nothing is selectable. One pipeline; each rank is exact when read, but
        across Cluster slots they are read at slightly different moments."""
        replies = await self.call_all([("rank", self._timed(q), ()) for q in queues])
        return [(int(r[0]), -int(r[1])) if r else None for r in replies]

    async def peek_async(self, queue: bytes, count: int) -> list[PeekedPacket]:
        """What the next pops of ``queue`` would return, at most ``count`` packets (after
        promoting the delayed packets that are due: the peek itself writes nothing); none
        for a ``count`` of 0, ``ValueError`` for a negative one, as every store."""
        if count < 0:
            raise ValueError("peek count must be 0 or more")
        peek = ("peek", self.keys(queue)[:4], (count, self.max_pop))
        swept, reply = await self.call_all([self._sweep_call(queue), peek])
        self._swept(queue, swept, chained=False)
        return [(reply[i], reply[i + 1], int(reply[i + 2])) for i in range(0, len(reply), 3)]

    async def purge_async(self, queue: bytes) -> int:
        """Remove every packet of ``queue``, delayed ones included; returns how many."""
        k = self.keys(queue)
        purge = ("purge", [*k[:4], k.delayed, k.due, k.leases], ())
        (reply,) = await self.call_all([purge])
        self.note_size(queue, 0)
        self._note_delayed(queue, 0)
        removed = int(reply[0]) + int(reply[1])
        self.purged += removed
        return removed

    # -- move (decision 22) -----------------------------------------------------------------

    async def move_async(self, source: bytes, target: bytes, limit: int) -> int:
        """Move queued packets of ``source`` to ``target`` (decision 22): whole key groups in
        pop order while fewer than ``limit`` have moved (0: all), entering ``target`` as pushes
        made now in their old relative order, prio and TTL deadline kept, attempt counts
        reset; leased and delayed packets stay. Returns how many moved.

        One function call, atomic, when both queues live in one slot (always on one Redis; on
        a Cluster when their hash tags match, as a queue's and its ``.dead`` queue's do).
        Otherwise in rounds (``_move_across``), each atomic. ``source == target`` raises
        ``ValueError``."""
        if source == target:
            raise ValueError("a move needs two different queues")
        if self.cluster and hash_tag(source) != hash_tag(target):
            return await self._move_across(source, target, limit)
        t = self.keys(target)
        keys = [*self._move_keys(source)[:9], *t[:5]]
        (reply,) = await self.call_all([("move", keys, [limit])])
        moved, entered, earliest = int(reply[0]), int(reply[1]), float(reply[2])
        self._moved_in(target, entered, earliest, int(reply[4]))
        self.note_size(source, int(reply[3]))
        return moved

    async def _move_across(self, source: bytes, target: bytes, limit: int) -> int:
        """A move between two Cluster slots, in rounds: what a move of ``limit`` takes (of all:
        about ``MOVE_ROUND`` packets of whole groups a round) is taken out of ``source`` into
        its ``:m`` hash under a move id (``move_out``), put into ``target`` once per id
        (``move_in``), then deleted from ``:m``. So a group is wholly in one queue or on its
        way, never split or doubled, and the packets of a round enter in their old relative
        order; if this front end dies between the halves, any front end's scan finishes the
        round (``finish_moves``). When it is cut short (the task is cancelled: the server
        stops), the log says how many had moved."""
        out_keys = self._move_keys(source)
        moving = out_keys[-1]
        moved = 0
        try:
            while not limit or moved < limit:
                move_id = b"%s:m%d" % (self._front, next(self._pop_ids))
                left = limit - moved if limit else 0
                (packets,) = await self.call_all([("move_out", out_keys, [left, move_id, target])])
                if not packets:
                    break
                await self._move_in(target, move_id, packets)
                moved += len(packets) // 5
                await self._moved_out(moving, move_id)
        except trio.Cancelled:
            log.warning(
                "the move of %r to %r was cut short after %d packets", source, target, moved
            )
            raise
        return moved

    async def _moved_out(self, moving: bytes, move_id: bytes) -> None:
        """The group is in its target: forget it in the source's ``:m`` (should Redis not answer
        now, the scan does, ``finish_moves``: its ``move_in`` is then skipped)."""
        try:
            await self.client.hdel(moving, [move_id])
        except _TRANSIENT as error:
            self._trouble(f"Redis is unreachable ({error}); retrying")

    def _move_keys(self, source: bytes) -> list[bytes]:
        """A move's KEYS of its source: d s g x y Y w l a m."""
        s = self.keys(source)
        return [*s[:4], s.delayed, s.due, s.waiting, s.leases, s.attempts, s.moving]

    async def _move_in(self, target: bytes, move_id: bytes, packets: Sequence[Any]) -> None:
        t = self.keys(target)
        call: _Call = ("move_in", [*t[:5], t.moved], [move_id, *packets])
        (entered,) = await self.call_all([call])
        deadlines = [float(d) for d in packets[4::5] if float(d)]
        self._moved_in(target, int(entered), min(deadlines, default=0.0), -1)

    def _moved_in(self, target: bytes, entered: int, earliest: float, size: int) -> None:
        """Packets entered ``target`` through a move: offered to the waiters here (other
        front ends' hear the queue's channel), their earliest TTL deadline timed."""
        if size >= 0:
            self.note_size(target, size)
        if entered:
            self.on_arrived(target)
        if earliest:
            self.schedule_sweep(target, earliest)

    async def finish_moves(self) -> None:
        """Finish the cross-slot moves whose front end died between their halves: every
        group kept in a ``:m`` hash for longer than ``MOVE_ABANDONED_MS`` is put into its
        target (once: ``move_in`` skips an id it applied) and deleted."""
        async for key in self.client.scan_iter(match=PREFIX + b"{q*:m", count=1000):
            if name_of(key, b":m") is None:
                continue
            (abandoned,) = await self.call_all([("moves_kept", [key], [MOVE_ABANDONED_MS])])
            for move_id, target, packets in abandoned:
                await self._move_in(target, move_id, packets)
                await self._moved_out(key, move_id)

    # -- leases (decisions 13-19) ---------------------------------------------------------

    def make_leases(self, *, default_ms: int, max_deliveries: int) -> RedisLeases:
        """The broker's lease table for this store."""
        self.leases = RedisLeases(
            self,
            default_ms=default_ms,
            max_deliveries=max_deliveries,
            release_later=self.release_later,
        )
        return self.leases

    def release_later(self, leases: list[tuple[bytes, bytes]]) -> None:
        """Release these leases (``(queue, handle)`` each) of a closed connection now, in
        ``lease_loop``."""
        self.closing.extend(leases)
        self.wake_leases()

    def _lease_call(self, name: str, queue: bytes, *args: bytes | int | str) -> _Call:
        """A lease script's call: the queue's keys and its dead-letter queue's (one slot)."""
        k = self.keys(queue)
        dead = queue + DEAD_SUFFIX
        d = self.keys(dead)
        assert self.leases is not None
        keys = [
            *k[:4], k.delayed, k.due, k.waiting, k.leases, k.lease_due, k.attempts, *d[:5],
        ]  # fmt: skip
        return (
            name,
            keys,
            [
                k.channel,
                d.channel,
                self.leases.max_deliveries,
                1 if len(dead) <= MAX_FIELD else 0,
                *args,
            ],
        )

    def _reserve_call(self, queue: bytes, lease_ms: int) -> tuple[_Call, bytes]:
        assert self.leases is not None
        handle = b"%s:%d" % (self._front, next(self._handles))
        ms = lease_ms or self.leases.default_ms
        return self._lease_call("reserve", queue, self.max_pop, handle, ms), handle

    def _reserved(
        self, queue: bytes, handle: bytes, reply: Sequence[Any]
    ) -> tuple[bytes, int, list[KeyedPayload]] | None:
        """A RESERVE reply as ``RedisLeases.made`` takes it; schedules its deadline's sweep."""
        if not reply:
            return None
        self.schedule_lease_sweep(queue, float(reply[1]))
        packets = list(zip(reply[3::2], reply[4::2], strict=True))
        return handle, int(reply[0]), packets

    async def run_leases(self, frames: Sequence[ClientFrame], session: Session) -> None:
        """Apply lease frames of ``session`` (reserves, acks, releases, touches) in Redis, in
        order, as one pipeline, leaving their answers in ``leases.results[session.holder]`` for
        ``Session.receive``. The driver cuts the frames (``server._lease_segment_end``) so that
        every ack, release and touch names a lease made before them or by the one reserve
        before them in the segment (sent with that reserve's handle: an ack right after its
        reserve costs no round trip of its own); a frame the session will
        refuse (a reserve on a leased or plainly subscribed connection) runs nothing."""
        leases = self.leases
        assert leases is not None
        holder = session.holder
        results: deque[Any] = deque()
        leases.results[holder] = results
        calls: list[_Call] = []
        # Per frame: (what, queue, handle or lease, index of its call), or a fixed answer.
        plan: list[tuple[str, Any, Any]] = []
        reserved: tuple[bytes, bytes] | None = None  # the queue and handle of a reserve here
        for frame in frames:
            kind = frame.__class__
            if kind is Reserve:
                reserve = cast(Reserve, frame)
                if not session.may_reserve:  # refused (decisions 12, 18, 20): take nothing
                    plan.append(("fixed", None, None))
                    continue
                call, handle = self._reserve_call(reserve.queue, reserve.lease_ms)
                calls.append(call)
                plan.append(("reserve", reserve.queue, handle))
                reserved = (reserve.queue, handle)  # the segment has at most one before acks
                continue
            if kind is Ack:
                op, ms = "ack", 0
            elif kind is Release:
                op, ms = "release", cast(Release, frame).delay_ms
            elif kind is Touch:
                op, ms = "touch", cast(Touch, frame).lease_ms or leases.default_ms
            else:
                continue  # a leased subscribe: the subscriptions reserve for it
            lease_id = cast(Ack, frame).lease_id  # ack, release and touch: the id comes first
            lease = holder.leases.get(lease_id) if session.authenticated else None
            if lease is not None:
                queue, handle = lease.queue, lease.handle  # type: ignore[attr-defined]
            elif reserved is not None and lease_id == holder.last_id + 1:
                queue, handle = reserved  # the id the segment's reserve gives, if it finds any
            else:
                plan.append(("fixed", False, None))
                continue
            calls.append(self._lease_call("lease_op", queue, op, handle, ms))
            plan.append(("op", queue, None))
        replies = iter(await self.call_all(calls) if calls else [])
        for what, queue, handle in plan:
            if what == "fixed":
                results.append(queue)  # the fixed answer
            elif what == "reserve":
                results.append(self._reserved(queue, handle, next(replies)))
            else:
                reply = next(replies)
                leases.counted(int(reply[1]), int(reply[2]), int(reply[3]))
                # Packets back: offered to this front end's waiters before the next frame is
                # read, as on the built-in store (other front ends hear through the channel).
                if int(reply[1]):
                    leases.returned.append(queue)
                if int(reply[2]):
                    leases.returned.append(queue + DEAD_SUFFIX)
                if int(reply[4]):
                    self.schedule_lease_sweep(queue, float(reply[4]))
                results.append(bool(int(reply[0])))

    async def reserve_for_delivery(
        self, queue: bytes, lease_ms: int
    ) -> tuple[tuple[bytes, int, list[KeyedPayload]] | None, bool]:
        """Lease ``queue`` now for a leased subscriber (decision 17); and whether it holds
        more selectable packets."""
        call, handle = self._reserve_call(queue, lease_ms)
        (reply,) = await self.call_all([call])
        return self._reserved(queue, handle, reply), bool(reply and int(reply[2]))

    async def unreserve(self, queue: bytes, handle: bytes) -> None:
        """Put back a lease made for a delivery nobody could take, its attempt not counted."""
        unreserve = self._lease_call("lease_op", queue, "unreserve", handle, 0)
        await self.call_all([unreserve])

    def wake_leases(self) -> None:
        """``closing`` has leases to release: ``lease_loop`` runs now."""
        self._lease_wake.deadline = -math.inf

    def schedule_lease_sweep(self, queue: bytes, deadline_ms: float) -> None:
        """Sweep ``queue``'s leases when a deadline (ms on Redis's clock) comes."""
        due = deadline_ms / 1000 - self.clock_offset
        known = self._lease_sweep_at.get(queue)
        if known is not None and known <= due:
            return
        self._lease_sweep_at[queue] = due
        heapq.heappush(self._lease_sweeps, (due, queue))
        if due < self._lease_wake.deadline:
            self._lease_wake.deadline = due

    async def lease_loop(self) -> None:
        """Release the leases of closed connections at once, and sweep each queue's leases at
        the deadlines this front end knows of (its own leases', and those the scan found). A
        sweep ends every due lease of the queue, whichever front end made it."""
        while True:
            wake = self._lease_sweeps[0][0] if self._lease_sweeps else math.inf
            if self.closing:
                wake = -math.inf
            with trio.CancelScope(deadline=wake) as self._lease_wake:
                await trio.sleep_forever()
            closing, self.closing = self.closing, []
            calls = [self._lease_call("lease_op", q, "release", h, 0) for q, h in closing]
            now = trio.current_time()
            due: list[bytes] = []
            while self._lease_sweeps and self._lease_sweeps[0][0] <= now:
                _, queue = heapq.heappop(self._lease_sweeps)
                if self._lease_sweep_at.get(queue, math.inf) <= now:
                    del self._lease_sweep_at[queue]
                    due.append(queue)
            calls += [self._lease_call("lease_sweep", q) for q in due]
            if not calls or self.leases is None:
                continue
            replies = await self.call_all(calls)
            leases = self.leases
            for reply in replies[: len(closing)]:
                leases.counted(int(reply[1]), int(reply[2]), int(reply[3]))
            for queue, reply in zip(due, replies[len(closing) :], strict=True):
                leases.counted(int(reply[0]), int(reply[1]), int(reply[2]))
                if int(reply[3]):
                    self.schedule_lease_sweep(queue, float(reply[3]))
                for handle in reply[4:]:
                    lease = leases.mine.get(handle)
                    if lease is not None:
                        leases.forget(lease)

    # -- talking to Redis --------------------------------------------------------------------

    async def load_scripts(self) -> None:
        """Load the functions library into Redis (every primary of a Cluster). ``REPLACE``:
        front ends of one layout share the library, the one loaded last (``lua.LAYOUT``)."""
        await self.client.function_load(lua.LIBRARY, replace=True)

    async def call_all(self, calls: Sequence[_Call]) -> list[Any]:
        """Run scripts as one pipeline, in order; retries what Redis could not run yet (it is
        unreachable, loading, out of memory, or lost the scripts in a restart) with backoff,
        logging once, until it has. Another error is a bug, raised."""
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        delay = RETRY_FIRST
        calls = list(calls)
        while todo:
            if delay > RETRY_FIRST:  # sent before: it may have run, its reply lost
                for index in todo:
                    calls[index] = _retried(calls[index])
            try:
                replies = await self._pipeline([calls[i] for i in todo])
            except _TRANSIENT as error:
                self._trouble(f"Redis is unreachable ({error}); retrying")
                replies = None
            retry = []
            for index, reply in zip(todo, replies or [None] * len(todo), strict=True):
                if replies is None:
                    retry.append(index)
                elif isinstance(reply, ResponseError) and "Function not found" in str(reply):
                    await self._reload_scripts()  # a Redis restarted without persistence
                    retry.append(index)
                elif isinstance(reply, _TRANSIENT) or busy(reply):
                    self._trouble(f"Redis cannot run scripts now ({reply}); retrying")
                    retry.append(index)
                elif isinstance(reply, ResponseError) and str(reply).startswith("OOM"):
                    self._trouble(
                        "Redis is out of memory (maxmemory reached); pushes wait and are "
                        "retried, pops and purges go on"
                    )
                    retry.append(index)
                elif isinstance(reply, Exception):
                    raise reply
                else:
                    results[index] = reply
            todo = retry
            if todo:
                await trio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
        if self._troubled is not None:
            log.warning("Redis answers again (after: %s)", self._troubled)
            self._troubled = None
        return results

    async def _pipeline(self, calls: Sequence[_Call]) -> list[Any]:
        """One round trip: through the direct connections where there are (``direct.py``
        says why), else coredis's pipeline."""
        if self.direct is not None:
            return await self.direct.pipeline([_command(call) for call in calls])
        async with self.client.pipeline(transaction=False, raise_on_error=False) as pipe:
            requests = [
                pipe.fcall(_FUNCTIONS[name], keys=keys, args=args) for name, keys, args in calls
            ]
        replies = []
        for request in requests:
            try:
                replies.append(await request)
            except Exception as error:  # the pipeline hands each command's error back here
                replies.append(error)
        return replies

    async def _reload_scripts(self) -> None:
        try:
            await self.load_scripts()
        except _TRANSIENT as error:
            self._trouble(f"Redis is unreachable ({error}); retrying")

    def _trouble(self, what: str) -> None:
        if self._troubled is None:
            log.warning("%s", what)
            self._troubled = what

    # -- expiry: a timer per queue this front end pushed TTLs to -----------------------------

    def schedule_sweep(self, queue: bytes, deadline_ms: float) -> None:
        """Sweep ``queue`` (expire its packets, promote its delayed ones) when a deadline or a
        due time (ms on Redis's clock) comes: one timer for the earliest of all, not one a
        packet."""
        due = deadline_ms / 1000 - self.clock_offset
        known = self._sweep_at.get(queue)
        if known is not None and known <= due:
            return
        self._sweep_at[queue] = due
        heapq.heappush(self._sweeps, (due, queue))
        if due < self._sweep_wake.deadline:
            self._sweep_wake.deadline = due

    async def sweep_loop(self) -> None:
        """Sweep each queue at the deadlines and due times ``schedule_sweep`` was told of. A
        sweep finds every packet due by then, whoever pushed it, and promotes every delayed
        packet due by then (idempotent: another front end's sweep may have come first)."""
        while True:
            wake = self._sweeps[0][0] if self._sweeps else math.inf
            with trio.CancelScope(deadline=wake) as self._sweep_wake:
                await trio.sleep_forever()
            now = trio.current_time()
            due: list[bytes] = []
            while self._sweeps and self._sweeps[0][0] <= now:
                _, queue = heapq.heappop(self._sweeps)
                if self._sweep_at.get(queue, math.inf) <= now:
                    del self._sweep_at[queue]
                    due.append(queue)
            if due:
                replies = await self.call_all([self._sweep_call(q) for q in due])
                for queue, reply in zip(due, replies, strict=True):
                    self._swept(queue, reply)

    async def sync_clock(self) -> None:
        """Measure Redis's clock against trio's (for the sweep timers only)."""
        # Through a script: coredis's ``time()`` gives a datetime without the microseconds.
        # The key only routes it on a Cluster; it is never touched.
        seconds, micros = await self.client.eval("return redis.call('TIME')", keys=[PREFIX])
        self.clock_offset = int(seconds) + int(micros) / 1e6 - trio.current_time()

    # -- the snapshot the admin listener reads -----------------------------------------------

    async def snapshot_loop(self) -> None:
        """Refresh the queue-size snapshot every ``SNAPSHOT_INTERVAL`` seconds. It also sweeps
        queues whose deadline has passed that no live front end has a timer for (their pusher
        died): the scan is the backstop of the timers."""
        while True:
            try:
                await self.confirm_results()
                await self.refresh_snapshot()
                if self.cluster:  # only a Cluster moves across slots
                    await self.finish_moves()
            except _TRANSIENT as error:
                self._trouble(f"Redis is unreachable ({error}); retrying")
            except ResponseError as error:
                if not busy(error):
                    raise
                self._trouble(f"Redis cannot answer now ({error}); retrying")
            await trio.sleep(SNAPSHOT_INTERVAL)

    async def refresh_snapshot(self) -> None:
        """Scan every node for queues (those holding only delayed packets too); one pipeline
        of HLEN and the next deadline each, and of the delayed packets' count, next due time
        and memory where a queue has them."""
        names: list[bytes] = []
        delaying: list[bytes] = []
        async for key in self.client.scan_iter(match=PREFIX + b"{q*:[dy]", count=1000):
            if (name := name_of(key)) is not None:
                names.append(name)
            elif (name := name_of(key, b":y")) is not None:
                delaying.append(name)
        sizes: dict[bytes, int] = {}
        expiry: dict[bytes, float] = {}
        delayed: dict[bytes, int] = {}
        async with self.client.pipeline(transaction=False, raise_on_error=False) as pipe:
            lengths = [pipe.hlen(self.keys(n).data) for n in names]
            metas = [pipe.hget(self.keys(n).data, lua.META) for n in names]
            firsts = [pipe.zrange(self.keys(n).expiry, 0, 0, withscores=True) for n in names]
            counts = [pipe.hlen(self.keys(n).delayed) for n in delaying]
            dues = [pipe.zrange(self.keys(n).due, 0, 0, withscores=True) for n in delaying]
            usages = [pipe.memory_usage(self.keys(n).delayed) for n in delaying]
        redis_now = trio.current_time() + self.clock_offset
        for name, length, meta, first in zip(names, lengths, metas, firsts, strict=True):
            count, head = lua.packets_held(int(await length), await meta), await first
            if count:
                sizes[name] = int(count)
            if head:
                deadline = float(head[0][1]) / 1000
                expiry[name] = deadline - redis_now
                if deadline <= redis_now:
                    self.schedule_sweep(name, deadline * 1000)
        delayed_bytes = 0
        for name, count, first, usage in zip(delaying, counts, dues, usages, strict=True):
            number, head, used = await count, await first, await usage
            if number:
                delayed[name] = int(number)
                delayed_bytes += int(used or 0)
            if head:
                # Promoted at its due time by a front end that follows the queue (its pusher,
                # one with waiters on it); by this scan's timer once past due, whoever pushed
                # it (its pusher died).
                due = float(head[0][1])
                if due <= redis_now * 1000 or name in self.waited:
                    self.schedule_sweep(name, due)
        self._snapshot = _Snapshot(sizes, expiry, trio.current_time(), delayed)
        self.delayed_bytes = delayed_bytes
        await self._read_memory()
        if self.leases is not None:
            await self._find_lease_deadlines()

    async def _read_memory(self) -> None:
        """Redis's memory use and cap (``INFO memory``), summed over a Cluster's primaries;
        no cap if any of them has none."""
        used, cap = 0, 0.0
        for info in await self.info_of_nodes("memory"):
            used += int(info["used_memory"])
            cap += int(info["maxmemory"]) or math.inf
        self.bytes_held, self.memory_cap = used, cap

    async def info_of_nodes(self, section: str) -> list[dict[str, Any]]:
        """``INFO section`` of Redis, or of each primary of a Cluster."""
        if not self.cluster:
            return [await self.client.info(section)]
        infos = []
        for node in self.client.primaries:
            async with node:
                infos.append(await node.info(section))
        return infos

    async def _find_lease_deadlines(self) -> None:
        """Time a sweep for the next lease deadline of every queue with leases, whichever front
        end made them: the leases of a front end that died come back at their deadline."""
        leased: list[bytes] = []
        async for key in self.client.scan_iter(match=PREFIX + b"{q*:L", count=1000):
            name = name_of(key, b":L")
            if name is not None:
                leased.append(name)
        if not leased:
            return
        async with self.client.pipeline(transaction=False, raise_on_error=False) as pipe:
            firsts = [pipe.zrange(self.keys(n).lease_due, 0, 0, withscores=True) for n in leased]
        for name, first in zip(leased, firsts, strict=True):
            head = await first
            if head:
                self.schedule_lease_sweep(name, float(head[0][1]))


def busy(reply: object) -> bool:
    """Whether Redis refused a command, without running it, because a script or function has
    run past ``busy-reply-threshold`` (it answers every other command so until that ends):
    the command is sent again later, as to a Redis that is loading."""
    return isinstance(reply, ResponseError) and str(reply).startswith("BUSY ")


def _command(call: _Call) -> tuple[Any, ...]:
    """A call as the ``FCALL`` command the direct connection sends."""
    name, keys, args = call
    return (b"FCALL", _FUNCTIONS[name], len(keys), *keys, *args)


def _count_last_pushes(calls: Sequence[_Call], queues: Sequence[bytes]) -> None:
    """Let the last push call of each queue in a pipeline count the queue's packets (the
    figure ``note_size`` keeps): the earlier ones' counts would be out of date at once."""
    counted: set[bytes] = set()
    for (name, _, args), queue in zip(reversed(calls), reversed(queues), strict=True):
        if name == "push" and queue not in counted:
            counted.add(queue)
            args[1] = 1  # type: ignore[index]


def _retried(call: _Call) -> _Call:
    """A call sent again: a pop then answers with what it took the first time, if it ran."""
    name, keys, args = call
    if name != "pop":
        return call
    return name, keys, [*args[:4], 1, *args[5:]]


def redis_client(*args: Any, **kwargs: Any) -> Any:
    """A coredis client that returns bytes (queue names, keys and payloads are bytes)."""
    return coredis.Redis(*args, decode_responses=False, **kwargs)
