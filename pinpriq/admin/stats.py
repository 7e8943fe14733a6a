"""What an operator reads about a broker, as plain data: no I/O, no trio, the clock passed in.

The admin listener (``pinpriq.admin.app``) turns these into JSON (``/stats``) and Prometheus
metrics (``/metrics``); the dashboard draws them. Everything here costs O(queues listed +
priority levels), never O(packets): the store keeps its counts as it changes
(``Store.queue_info``), and the broker derives its totals (``Broker.totals``).

Rates come from ``Sampler``: once a second the server records the totals and the packets held,
and a rate is the difference between now and a sample about ten seconds old. The samples of the
last five minutes are kept for the dashboard's chart.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable
from itertools import islice
from operator import itemgetter
from typing import Any

from pinpriq import __version__
from pinpriq.broker import Broker, Totals
from pinpriq.display import escape
from pinpriq.persistence.journal import Journal

__all__ = [
    "DEFAULT_MAX_QUEUES",
    "HISTORY_SECONDS",
    "RATE_WINDOW",
    "Sample",
    "Sampler",
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


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


class Sample:
    """The totals and the packets held at one moment."""

    __slots__ = ("packets", "time", "totals")

    def __init__(self, time: float, totals: Totals, packets: int) -> None:
        self.time = time
        self.totals = totals
        self.packets = packets


class Sampler:
    """One sample a second (``tick``, called by the server), for rates and the chart."""

    def __init__(self, broker: Broker, clock: Callable[[], float]) -> None:
        self.broker = broker
        self.clock = clock
        self.started = clock()
        self.samples: deque[Sample] = deque(maxlen=HISTORY_SECONDS + 1)

    def now(self) -> Sample:
        """A sample of this moment (not kept)."""
        broker = self.broker
        return Sample(self.clock(), broker.totals(), len(broker.store))

    def tick(self) -> None:
        """Keep a sample of this moment, and let the store note the time (packets' ages)."""
        self.samples.append(self.now())
        self.broker.store.note_time()

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
    """The queues to list, as ``(name, packets, bytes)``: the ``limit`` deepest, then queues
    with subscribers and no packets (consumers waiting), while room is left. O(queues log
    limit)."""
    sizes: Iterable[tuple[bytes, int, int]] = broker.store.sizes()
    listed = heapq.nlargest(limit, sizes, key=itemgetter(1))
    if len(listed) < limit:
        held = {name for name, _, _ in listed}
        idle = sorted(q for q in broker.subscriptions.subscribers if q not in held)
        listed += [(name, 0, 0) for name in idle[: limit - len(listed)]]
    return listed


def queue_stats(broker: Broker, queue: bytes) -> dict[str, Any]:
    """One queue's figures. O(priority levels)."""
    info = broker.store.queue_info(queue)
    return {
        "name": escape(queue),
        "packets": info.packets,
        "bytes": info.bytes,
        "by_priority": info.by_priority,  # JSON makes the keys strings
        "subscribers": broker.subscriptions.subscribers.get(queue, 0),
        "leased": broker.leases.leased(queue),  # on a lease: in no queue, not in "packets"
        "oldest_age_ms": _ms(info.oldest_age),
        "next_expiry_ms": _ms(info.next_expiry),
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
        },
        "packets": now.packets,
        "queues_total": store.queue_count,
        "totals": now.totals._asdict(),
        "leases": broker.lease_totals()._asdict(),
        "log": None if journal is None else journal.stats()._asdict(),
        "rates_per_s": sampler.rates(now),
        "queues": [queue_stats(broker, queue) for queue, _, _ in queues],
    }
    describe = getattr(store, "describe", None)  # a store in another process says what it is
    stats["store"] = describe() if describe is not None else {"kind": "memory"}
    if history:
        stats["history"] = sampler.history()
    return stats
