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
from pinpriq.admin.stats import listed_queues, memory_cap
from pinpriq.broker import Broker, Totals
from pinpriq.display import escape
from pinpriq.leases import LeaseTotals
from pinpriq.persistence.journal import Journal, JournalStats

__all__ = ["CONTENT_TYPE_LATEST", "BrokerCollector", "registry_for"]

_COUNTER_HELP = {
    "pushed": "Packets accepted by pushes",
    "popped": "Packets returned by pop frames",
    "delivered": "Packets delivered to subscribers",
    "expired": "Packets removed at their TTL deadline",
    "purged": "Packets removed by purges",
}
assert set(_COUNTER_HELP) == set(Totals._fields), "a total without a counter"
#: The lease table's counters (``LeaseTotals``), all but ``leased``, which is a gauge.
_LEASE_COUNTERS = {
    "acked": ("pinpriq_packets_acked_total", "Leased packets acked: gone for good"),
    "redelivered": (
        "pinpriq_packets_redelivered_total",
        "Leased packets back in their queue after a release, a lease's deadline or a close",
    ),
    "dead_lettered": (
        "pinpriq_packets_dead_lettered_total",
        "Leased packets moved to a dead-letter queue after --max-deliveries attempts",
    ),
    "dropped": (
        "pinpriq_packets_dead_letter_dropped_total",
        "Packets due for a dead-letter queue whose name would be too long, dropped",
    ),
    "unknown": (
        "pinpriq_acks_unknown_total",
        "Ack, release and touch frames naming no live lease (answered status 0)",
    ),
}
assert set(_LEASE_COUNTERS) | {"leased"} == set(LeaseTotals._fields), "a lease total unexported"


class BrokerCollector(Collector):
    """Reads the broker's figures whenever the registry is scraped."""

    def __init__(
        self,
        broker: Broker,
        connections: Callable[[], int],
        max_queues: int,
        journal: Journal | None = None,
    ) -> None:
        self.broker = broker
        self.connections = connections
        self.max_queues = max_queues
        self.journal = journal

    def collect(self) -> Iterator[Metric]:
        broker, store = self.broker, self.broker.store
        for field, value in zip(Totals._fields, broker.totals(), strict=True):
            yield CounterMetricFamily(f"pinpriq_packets_{field}", _COUNTER_HELP[field], value=value)
        leases = broker.lease_totals()
        for field, (name, documentation) in _LEASE_COUNTERS.items():
            # The name without _total: prometheus_client adds it to a counter.
            yield CounterMetricFamily(
                name.removesuffix("_total"), documentation, value=getattr(leases, field)
            )
        yield from _gauges(
            ("pinpriq_connections", "Client connections open", self.connections()),
            (
                "pinpriq_subscribers",
                "Connections with at least one subscription",
                broker.subscriptions.subscriber_count,
            ),
            (
                "pinpriq_packets",
                "Packets held, in all queues, delayed ones included (leased ones not)",
                len(store),
            ),
            (
                "pinpriq_packets_leased",
                "Packets on a lease or waiting out a release delay, in no queue",
                leases.leased,
            ),
            ("pinpriq_queues", "Queues holding at least one packet", store.queue_count),
            (
                "pinpriq_memory_held_bytes",
                "Memory held by queued packets, as the cap counts it",
                store.bytes_held,
            ),
            (
                "pinpriq_memory_cap_bytes",
                "The memory cap (+Inf: no cap)",
                memory_cap(broker),
            ),
            (
                "pinpriq_memory_prio_0_bytes",
                "Of the held memory, what prio-0 packets hold",
                store.unselectable_bytes,
            ),
            (
                "pinpriq_memory_delayed_bytes",
                "Of the held memory, what delayed packets hold until they are due",
                store.delayed_bytes,
            ),
            ("pinpriq_memory_full", "1 while pushes wait for room", int(broker.memory_full)),
        )
        yield from self._queue_gauges()
        if self.journal is not None:
            yield from _log_metrics(self.journal.stats())
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
        leased = GaugeMetricFamily(
            "pinpriq_queue_leased", "Packets of a queue on a lease, in no queue", labels=["queue"]
        )
        delayed = GaugeMetricFamily(
            "pinpriq_queue_delayed",
            "Delayed packets of a queue, not yet due, in no queue",
            labels=["queue"],
        )
        counts, leases = self.broker.subscriptions.subscribers, self.broker.leases
        info = self.broker.store.queue_info
        for queue, queue_packets, queue_bytes in listed_queues(self.broker, self.max_queues):
            label = [escape(queue)]
            packets.add_metric(label, queue_packets)
            size.add_metric(label, queue_bytes)
            subscribers.add_metric(label, counts.get(queue, 0))
            leased.add_metric(label, leases.leased(queue))
            delayed.add_metric(label, info(queue).delayed)
        yield from (packets, size, subscribers, leased, delayed)


def _log_metrics(log: JournalStats) -> Iterator[Metric]:
    """The log's figures (``--data-dir``): size, segments, fsyncs, recovery."""
    yield from _gauges(
        ("pinpriq_log_segments", "Segment files of the log, the spare not included", log.segments),
        (
            "pinpriq_log_disk_bytes",
            "Bytes the log's files take, reserved space included",
            log.disk_bytes,
        ),
        ("pinpriq_log_bytes", "Bytes of records in the log's segments", log.log_bytes),
        (
            "pinpriq_log_live_packets",
            "Packets the log holds live (queued and leased)",
            log.live_packets,
        ),
        ("pinpriq_log_last_fsync_seconds", "How long the last fsync took", log.last_fsync_seconds),
        (
            "pinpriq_log_recovery_seconds",
            "How long reading the log back at start took",
            log.recovery_seconds,
        ),
        ("pinpriq_log_recovering", "1 while the log is read back at start", int(log.recovering)),
        ("pinpriq_log_disk_full", "1 while the disk is full and pushes wait", int(log.disk_full)),
    )
    for name, documentation, value in (
        ("pinpriq_log_blocks_written", "Blocks of records written", log.blocks_written),
        ("pinpriq_log_written_bytes", "Bytes written to the log", log.bytes_written),
        ("pinpriq_log_fsyncs", "fsyncs of the log", log.fsyncs),
        ("pinpriq_log_fsync_seconds", "Time spent in the log's fsyncs", log.fsync_seconds),
        ("pinpriq_log_copied_packets", "Packets compaction copied forward", log.copied),
        ("pinpriq_log_segments_deleted", "Segment files deleted", log.segments_deleted),
    ):
        yield CounterMetricFamily(name, documentation, value=value)


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
