"""``/metrics``: the broker's figures as Prometheus metrics, read at scrape time.

A custom collector rather than counters and gauges updated as things happen: the broker already
keeps every figure (``Broker.totals``, ``Store.queue_info``), so a scrape reads them and the hot
path pays nothing. prometheus_client writes the exposition format (``generate_latest``), with
its own process metrics (``process_resident_memory_bytes`` and friends) beside ours.

Queue series are given for at most ``max_queues`` queues, the deepest first (``listed_queues``),
so a server with a million queues does not export a million series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from pinpriq import __version__
from pinpriq.admin.stats import listed_queues
from pinpriq.broker import Broker, Totals
from pinpriq.display import escape

__all__ = ["CONTENT_TYPE_LATEST", "BrokerCollector", "registry_for"]

_COUNTER_HELP = {
    "pushed": "Packets accepted by pushes",
    "popped": "Packets returned by pop frames",
    "delivered": "Packets delivered to subscribers",
    "expired": "Packets removed at their TTL deadline",
    "purged": "Packets removed by purges",
}
assert set(_COUNTER_HELP) == set(Totals._fields), "a total without a counter"


class BrokerCollector(Collector):
    """Reads the broker's figures whenever the registry is scraped."""

    def __init__(self, broker: Broker, connections: Callable[[], int], max_queues: int) -> None:
        self.broker = broker
        self.connections = connections
        self.max_queues = max_queues

    def collect(self) -> Iterator[Metric]:
        broker, store = self.broker, self.broker.store
        for field, value in zip(Totals._fields, broker.totals(), strict=True):
            yield CounterMetricFamily(f"pinpriq_packets_{field}", _COUNTER_HELP[field], value=value)
        yield from _gauges(
            ("pinpriq_connections", "Client connections open", self.connections()),
            (
                "pinpriq_subscribers",
                "Connections with at least one subscription",
                broker.subscriptions.subscriber_count,
            ),
            ("pinpriq_packets", "Packets queued, in all queues", len(store)),
            ("pinpriq_queues", "Queues holding at least one packet", store.queue_count),
            (
                "pinpriq_memory_held_bytes",
                "Memory held by queued packets, as the cap counts it",
                store.bytes_held,
            ),
            (
                "pinpriq_memory_cap_bytes",
                "The memory cap (+Inf: no cap)",
                broker.max_memory,
            ),
            (
                "pinpriq_memory_prio_0_bytes",
                "Of the held memory, what prio-0 packets hold",
                store.unselectable_bytes,
            ),
            ("pinpriq_memory_full", "1 while pushes wait for room", int(broker.memory_full)),
        )
        yield from self._queue_gauges()
        info = InfoMetricFamily("pinpriq", "The server's version")
        info.add_metric([], {"version": __version__})
        yield info

    def _queue_gauges(self) -> Iterator[Metric]:
        packets = GaugeMetricFamily(
            "pinpriq_queue_packets", "Packets queued in a queue", labels=["queue"]
        )
        size = GaugeMetricFamily(
            "pinpriq_queue_bytes", "Memory a queue's packets hold", labels=["queue"]
        )
        subscribers = GaugeMetricFamily(
            "pinpriq_queue_subscribers", "Subscribers of a queue", labels=["queue"]
        )
        counts = self.broker.subscriptions.subscribers
        for queue, queue_packets, queue_bytes in listed_queues(self.broker, self.max_queues):
            label = [escape(queue)]
            packets.add_metric(label, queue_packets)
            size.add_metric(label, queue_bytes)
            subscribers.add_metric(label, counts.get(queue, 0))
        yield from (packets, size, subscribers)


def _gauges(*gauges: tuple[str, str, float]) -> Iterator[Metric]:
    for name, documentation, value in gauges:
        yield GaugeMetricFamily(name, documentation, value=value)


def registry_for(collector: BrokerCollector) -> CollectorRegistry:
    """A registry of the broker's metrics and this process's, for ``generate_latest``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The text exposition of a scrape."""
    return generate_latest(registry)
