"""What an operator reads about a broker, as plain data: no I/O, no trio, the clock passed in.

The admin listener (``pinpriq.admin.app``) turns these into JSON (``/stats``) and Prometheus
metrics (``/metrics``); the dashboard draws them. Everything here costs O(queues listed +
priority levels), never O(packets): the store keeps its counts as it changes
(``Store.queue_info``), and the broker derives its totals (``Broker.totals``).

Rates come from ``Sampler``: once a second the server records the totals and the packets held,
and a rate is the difference between now and a sample about ten seconds old. The samples of the
last five minutes are kept for the dashboard's chart.

Per-queue rates cover the last minute of the queues someone looks at: those ``/stats`` listed
or ``/queues/NAME`` answered for (``watch``) in the last minute, at most ``MAX_RATED_QUEUES``;
while nobody looks, a second's sample costs nothing per queue. Pushes per queue are counted by
the broker per run of pushes (``Broker.take_pushes``); pops are not counted per queue at all (a
count per pop, delivery and lease would cost the hot path): a queue's packets taken are its
pushes less its purges less how much deeper it got, from its depth sampled each second. So
they include packets that expired, and packets coming back from leases or arriving as dead
letters count against them.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable
from itertools import islice
from operator import itemgetter
from typing import Any
from urllib.parse import quote

from pinpriq import __version__
from pinpriq.broker import Broker, Session, Totals
from pinpriq.display import escape
from pinpriq.persistence.journal import Journal
from pinpriq.store_contract import QueueInfo

__all__ = [
    "DEFAULT_MAX_QUEUES",
    "HISTORY_SECONDS",
    "MAX_RATED_QUEUES",
    "QUEUE_RATE_WINDOW",
    "RATE_WINDOW",
    "Sample",
    "Sampler",
    "connection_stats",
    "listed_queues",
    "queue_stats",
    "server_stats",
]

#: Queues listed by ``/stats`` and given series by ``/metrics`` unless told otherwise: the
#: deepest first, so a server with a million queues does not answer with a million of them.
DEFAULT_MAX_QUEUES = 1000
#: Seconds the rates look back over.
RATE_WINDOW = 10.0
#: Seconds of samples kept for the dashboard's chart, one a second.
HISTORY_SECONDS = 300
#: Seconds per-queue rates look back over.
QUEUE_RATE_WINDOW = 60
#: Queues whose rates are kept, at most: a second's sample costs O(these queues' priority
#: levels).
MAX_RATED_QUEUES = 10_000
#: Peer addresses ``connection_stats`` lists, at most (those with the most connections).
MAX_ADDRESSES = 100


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


class Sample:
    """The totals and the packets held at one moment."""

    __slots__ = ("packets", "time", "totals")

    def __init__(self, time: float, totals: Totals, packets: int) -> None:
        self.time = time
        self.totals = totals
        self.packets = packets


class QueueSample:
    """One second of per-queue figures: pushes and purges during it, depths at its end."""

    __slots__ = ("depths", "purged", "pushed", "time")

    def __init__(
        self,
        time: float,
        pushed: dict[bytes, int],
        purged: dict[bytes, int],
        depths: dict[bytes, int],
    ) -> None:
        self.time = time
        self.pushed = pushed
        self.purged = purged
        self.depths = depths


class Sampler:
    """One sample a second (``tick``, called by the server), for rates and the chart."""

    def __init__(self, broker: Broker, clock: Callable[[], float]) -> None:
        self.broker = broker
        self.clock = clock
        self.started = clock()
        self.samples: deque[Sample] = deque(maxlen=HISTORY_SECONDS + 1)
        self.queue_samples: deque[QueueSample] = deque(maxlen=QUEUE_RATE_WINDOW + 1)
        #: Queues whose rates are kept, and when each was last asked about.
        self.watched: dict[bytes, float] = {}
        #: Packets purged per queue since the last tick (``purged``).
        self.purges: dict[bytes, int] = {}

    def now(self) -> Sample:
        """A sample of this moment (not kept)."""
        broker = self.broker
        return Sample(self.clock(), broker.totals(), len(broker.store))

    def tick(self) -> None:
        """Keep a sample of this moment, and let the store note the time (packets' ages)."""
        sample = self.now()
        self.samples.append(sample)
        self._sample_queues(sample.time)
        self.broker.store.note_time()

    def watch(self, queue: bytes) -> None:
        """Keep ``queue``'s rates for the next minute: someone is looking at it."""
        if queue in self.watched or len(self.watched) < MAX_RATED_QUEUES:
            self.watched[queue] = self.clock()

    def purged(self, queue: bytes, count: int) -> None:
        """Note a purge, so that its packets are not taken for pops."""
        if count:
            self.purges[queue] = self.purges.get(queue, 0) + count

    def moved(self, source: bytes, target: bytes, count: int) -> None:
        """Note a move (decision 22): packets that left ``source`` as a purge's do, and came to
        ``target`` other than by a push (a purge of minus ``count``), so neither queue's
        rates take them for pops."""
        self.purged(source, count)
        self.purged(target, -count)

    def _sample_queues(self, now: float) -> None:
        every_push = self.broker.take_pushes()
        purged, self.purges = self.purges, {}
        watched = self.watched
        for queue in [q for q, seen in watched.items() if now - seen > QUEUE_RATE_WINDOW]:
            del watched[queue]
        info = self.broker.store.queue_info
        depths = {queue: _depth(info(queue)) for queue in watched}
        # Only the watched queues' counts are kept: pushes to a million names in a second
        # must not be a million entries.
        pushed = {queue: every_push[queue] for queue in watched if queue in every_push}
        self.queue_samples.append(QueueSample(now, pushed, purged, depths))

    def queue_rates(self, queue: bytes) -> dict[str, Any]:
        """Packets pushed to and taken from ``queue`` per second: over the last minute (or the
        seconds since its depth was first sampled), and second by second, oldest first.
        ``None`` for taken while its depth has not been sampled twice."""
        window = [s for s in self.queue_samples if queue in s.depths]
        rates: dict[str, Any] = {"window_s": 0, "pushed_per_s": 0.0, "popped_per_s": None}
        pushed_each, popped_each = [], []
        for before, after in zip(window, islice(window, 1, None), strict=False):
            pushed = after.pushed.get(queue, 0)
            taken = pushed - after.purged.get(queue, 0) - after.depths[queue] + before.depths[queue]
            elapsed = max(after.time - before.time, 1e-9)
            pushed_each.append(round(pushed / elapsed, 3))
            popped_each.append(round(max(0, taken) / elapsed, 3))
        if len(window) >= 2:
            first, last = window[0], window[-1]
            elapsed = last.time - first.time
            pushed = sum(s.pushed.get(queue, 0) for s in window[1:])
            purged = sum(s.purged.get(queue, 0) for s in window[1:])
            taken = pushed - purged - last.depths[queue] + first.depths[queue]
            rates["window_s"] = round(elapsed, 3)
            rates["pushed_per_s"] = round(pushed / elapsed, 3)
            rates["popped_per_s"] = round(max(0, taken) / elapsed, 3)
        rates["history"] = {"pushed_per_s": pushed_each, "popped_per_s": popped_each}
        return rates

    def rates(self, now: Sample) -> dict[str, float]:
        """Packets per second over the last ``RATE_WINDOW`` seconds (fewer just after start),
        for each of ``Totals``' fields."""
        old = next((s for s in self.samples if now.time - s.time <= RATE_WINDOW), None)
        if old is None or now.time <= old.time:
            return dict.fromkeys(Totals._fields, 0.0)
        elapsed = now.time - old.time
        return {
            field: round((new - before) / elapsed, 3)
            for field, new, before in zip(Totals._fields, now.totals, old.totals, strict=True)
        }

    def history(self) -> dict[str, Any]:
        """The kept samples as series, oldest first: packets held, and each total's rate over
        the second before (so one entry fewer than samples)."""
        samples = list(self.samples)
        pairs = list(zip(samples, islice(samples, 1, None), strict=False))
        series: dict[str, Any] = {
            "interval_s": 1,
            "packets": [s.packets for s in samples[1:]],
        }
        for index, field in enumerate(Totals._fields):
            series[f"{field}_per_s"] = [
                round((b.totals[index] - a.totals[index]) / max(b.time - a.time, 1e-9), 3)
                for a, b in pairs
            ]
        return series


def memory_cap(broker: Broker) -> float:
    """What ``bytes_held`` is measured against: the broker's cap, or the store's own where it
    keeps one (the Redis store: Redis's maxmemory); infinite for none."""
    cap: float = getattr(broker.store, "memory_cap", broker.max_memory)
    return cap


def listed_queues(broker: Broker, limit: int) -> list[tuple[bytes, int, int]]:
    """The queues to list, as ``(name, packets, bytes)``: the ``limit`` deepest, then, by
    name, queues that hold no packets but have subscribers (consumers waiting) or packets on a
    lease (all of them being worked on), while room is left. O(queues log limit)."""
    sizes: Iterable[tuple[bytes, int, int]] = broker.store.sizes()
    listed = heapq.nlargest(limit, sizes, key=itemgetter(1))
    if len(listed) < limit:
        held = {name for name, _, _ in listed}
        busy = set(broker.subscriptions.subscribers).union(broker.leases.leased_queues())
        idle = sorted(busy - held)
        listed += [(name, 0, 0) for name in idle[: limit - len(listed)]]
    return listed


def _depth(info: QueueInfo) -> int:
    """A queue's depth for its rates: its packets, delayed ones included, since a delayed push
    is a push to it."""
    return info.packets + info.delayed


def queue_stats(broker: Broker, queue: bytes, sampler: Sampler) -> dict[str, Any]:
    """One queue's figures. O(priority levels + a minute's samples)."""
    info = broker.store.queue_info(queue)
    sampler.watch(queue)
    return {
        "name": escape(queue),
        "path_name": quote(queue, safe=""),  # as /queues/NAME takes it
        "packets": info.packets,
        "bytes": info.bytes,
        "by_priority": info.by_priority,  # JSON makes the keys strings
        "subscribers": broker.subscriptions.subscribers.get(queue, 0),
        "leased": broker.leases.leased(queue),  # on a lease: in no queue, not in "packets"
        "delayed": info.delayed,  # not yet due: in no queue, not in "packets"
        "oldest_age_ms": _ms(info.oldest_age),
        "next_expiry_ms": _ms(info.next_expiry),
        "rates": sampler.queue_rates(queue),
    }


def connection_stats(peers: Iterable[tuple[str, Session]]) -> dict[str, Any]:
    """The data port's connections: how many, how many subscribe and hold leases, and the
    same per peer address (the ``MAX_ADDRESSES`` with the most connections). O(connections)."""
    by_address: dict[str, list[int]] = {}
    for peer, session in peers:
        host = peer.rpartition(":")[0] or peer  # one address, any port ("unknown peer": as is)
        figures = by_address.setdefault(host, [0, 0, 0, 0])
        leases = len(session.holder.leases)
        figures[0] += 1
        figures[1] += bool(session.queues)
        figures[2] += bool(leases)
        figures[3] += leases
    fields = ("connections", "subscribers", "leased", "leases")
    totals = [sum(column) for column in zip(*by_address.values(), strict=True)] or [0] * 4
    busiest = heapq.nsmallest(
        MAX_ADDRESSES, by_address.items(), key=lambda item: (-item[1][0], item[0])
    )
    return {
        **dict(zip(fields, totals, strict=True)),
        "addresses": len(by_address),
        "by_address": [
            {"address": host, **dict(zip(fields, figures, strict=True))}
            for host, figures in busiest
        ],
    }


def server_stats(
    broker: Broker,
    sampler: Sampler,
    *,
    connections: int,
    ready: bool,
    limit: int = DEFAULT_MAX_QUEUES,
    history: bool = False,
    journal: Journal | None = None,
) -> dict[str, Any]:
    """Everything ``/stats`` answers: the server's figures, and the ``limit`` deepest queues'."""
    now = sampler.now()
    store = broker.store
    queues = listed_queues(broker, limit)
    stats: dict[str, Any] = {
        "version": __version__,
        "uptime_s": round(now.time - sampler.started, 3),
        "ready": ready,
        "connections": connections,
        "subscribers": broker.subscriptions.subscriber_count,
        "memory": {
            "held_bytes": store.bytes_held,
            "cap_bytes": None if math.isinf(cap := memory_cap(broker)) else int(cap),
            "full": broker.memory_full,
            "prio_0_bytes": store.unselectable_bytes,
            "delayed_bytes": store.delayed_bytes,
        },
        "packets": now.packets,
        "queues_total": store.queue_count,
        "totals": now.totals._asdict(),
        "leases": broker.lease_totals()._asdict(),
        "log": None if journal is None else journal.stats()._asdict(),
        "rates_per_s": sampler.rates(now),
        "queues": [queue_stats(broker, queue, sampler) for queue, _, _ in queues],
    }
    describe = getattr(store, "describe", None)  # a store in another process says what it is
    stats["store"] = describe() if describe is not None else {"kind": "memory"}
    if history:
        stats["history"] = sampler.history()
    return stats
