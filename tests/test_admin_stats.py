"""The admin layer's figures without a loop or a socket: a broker, a fake clock, ``Sampler``."""

from __future__ import annotations

from pinpriq.admin.stats import (
    MAX_RATED_QUEUES,
    Sampler,
    connection_stats,
    listed_queues,
    server_stats,
)
from pinpriq.broker import Broker
from pinpriq.store import QueueStore
from pinpriq.wire import Pop, Push, Reserve, Subscribe


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rates_are_over_the_last_ten_seconds_and_history_per_second() -> None:
    clock = FakeClock()
    broker = Broker(QueueStore(clock))
    session = broker.open_session()
    sampler = Sampler(broker, clock)
    for second in range(15):
        sampler.tick()
        session.receive([Push(b"q", b"k%d-%d" % (second, i), b"") for i in range(10)])
        if second >= 5:
            session.receive([Pop(b"q")] * 4)
        clock.now += 1.0
    stats = server_stats(broker, sampler, connections=1, ready=True, history=True)
    # Pushes ran at 10/s throughout, pops at 4/s for the last 10 s.
    assert stats["rates_per_s"] == {
        "pushed": 10.0,
        "popped": 4.0,
        "delivered": 0.0,
        "expired": 0.0,
        "purged": 0.0,
    }
    history = stats["history"]
    assert history["pushed_per_s"] == [10.0] * 14
    assert history["popped_per_s"] == [0.0] * 5 + [4.0] * 9  # one entry per second between ticks
    assert history["packets"] == [10 * s - 4 * max(0, s - 5) for s in range(1, 15)]
    assert stats["uptime_s"] == 15.0


def test_rates_are_zero_before_any_sample() -> None:
    clock = FakeClock()
    sampler = Sampler(Broker(QueueStore(clock)), clock)
    assert set(sampler.rates(sampler.now()).values()) == {0.0}
    assert sampler.history()["packets"] == []


def test_listed_queues_are_the_deepest_then_the_subscribed_empty_ones() -> None:
    clock = FakeClock()
    broker = Broker(QueueStore(clock))
    session = broker.open_session()
    session.receive([Push(b"a", b"k", b"")] + [Push(b"b", b"k%d" % i, b"") for i in range(3)])
    session.receive([Subscribe(b"waiting"), Subscribe(b"also-waiting")])
    assert [q for q, _, _ in listed_queues(broker, 10)] == [b"b", b"a", b"also-waiting", b"waiting"]
    assert [q for q, _, _ in listed_queues(broker, 3)] == [b"b", b"a", b"also-waiting"]
    assert listed_queues(broker, 1) == [(b"b", 3, 3 * (2 + 256))]
    assert listed_queues(broker, 0) == []


def test_a_queue_whose_packets_are_all_leased_is_listed() -> None:
    # Every packet being worked on is not an empty queue an operator may overlook.
    clock = FakeClock()
    broker = Broker(QueueStore(clock))
    worker = broker.open_session()
    worker.receive([Push(b"jobs", b"k", b""), Push(b"other", b"k", b"")])
    worker.receive([Reserve(b"jobs", 30_000)])
    assert [q for q, _, _ in listed_queues(broker, 10)] == [b"other", b"jobs"]
    stats = server_stats(broker, Sampler(broker, clock), connections=1, ready=True)
    assert [(q["name"], q["packets"], q["leased"]) for q in stats["queues"]] == [
        ("other", 1, 0),
        ("jobs", 0, 1),
    ]


def test_queue_rates_count_pushes_per_queue_and_take_pops_from_depths() -> None:
    clock = FakeClock()
    broker = Broker(QueueStore(clock))
    producer, consumer = broker.open_session(), broker.open_session()
    sampler = Sampler(broker, clock)
    sampler.watch(b"jobs")
    sampler.watch(b"other")
    sampler.tick()
    for second in range(10):
        clock.now += 1.0
        # Interleaved queues in one batch: each run of pushes is counted to its own queue.
        batch = [Push(b"jobs", b"j%d-%d" % (second, i), b"") for i in range(6)]
        batch[3:3] = [Push(b"other", b"o%d" % second, b"")]
        producer.receive(batch)
        consumer.receive([Pop(b"jobs")] * 4)
        sampler.tick()
    rates = sampler.queue_rates(b"jobs")
    assert (rates["window_s"], rates["pushed_per_s"], rates["popped_per_s"]) == (10.0, 6.0, 4.0)
    assert rates["history"] == {"pushed_per_s": [6.0] * 10, "popped_per_s": [4.0] * 10}
    assert sampler.queue_rates(b"other")["pushed_per_s"] == 1.0
    assert sampler.queue_rates(b"other")["popped_per_s"] == 0.0
    # Nobody looked at it: nothing kept, nothing sampled.
    assert sampler.queue_rates(b"unwatched")["popped_per_s"] is None


def test_queue_rates_leave_purges_out_and_forget_queues_after_a_minute() -> None:
    clock = FakeClock()
    broker = Broker(QueueStore(clock))
    session = broker.open_session()
    sampler = Sampler(broker, clock)
    sampler.watch(b"q")
    sampler.tick()
    clock.now += 1.0
    session.receive([Push(b"q", b"k%d" % i, b"") for i in range(5)])
    sampler.purged(b"q", broker.purge(b"q"))
    sampler.tick()
    rates = sampler.queue_rates(b"q")
    # Five pushed and five purged in a second: none taken.
    assert (rates["window_s"], rates["pushed_per_s"], rates["popped_per_s"]) == (1.0, 5.0, 0.0)
    assert sampler.queue_rates(b"never")["popped_per_s"] is None  # no depth sampled yet
    for _ in range(61):  # a minute without questions: no longer sampled
        clock.now += 1.0
        sampler.tick()
    assert b"q" not in sampler.watched
    for _ in range(61):  # and a minute later no sample holds it
        clock.now += 1.0
        sampler.tick()
    assert sampler.queue_rates(b"q")["window_s"] == 0


def test_connection_stats_group_connections_by_peer_address() -> None:
    clock = FakeClock()
    broker = Broker(QueueStore(clock))
    plain, subscriber, worker, other = (broker.open_session() for _ in range(4))
    subscriber.receive([Subscribe(b"q")])
    worker.receive([Push(b"jobs", b"a", b""), Push(b"jobs", b"b", b"")])
    worker.receive([Reserve(b"jobs", 0), Reserve(b"jobs", 0)])
    peers = [
        ("127.0.0.1:5001", plain),
        ("127.0.0.1:5002", subscriber),
        ("[::1]:5003", worker),
        ("10.0.0.7:5004", other),
    ]
    stats = connection_stats(peers)
    assert {k: stats[k] for k in ("connections", "subscribers", "leased", "leases")} == {
        "connections": 4,
        "subscribers": 1,
        "leased": 1,
        "leases": 2,
    }
    assert stats["addresses"] == 3
    assert stats["by_address"] == [
        {"address": "127.0.0.1", "connections": 2, "subscribers": 1, "leased": 0, "leases": 0},
        {"address": "10.0.0.7", "connections": 1, "subscribers": 0, "leased": 0, "leases": 0},
        {"address": "[::1]", "connections": 1, "subscribers": 0, "leased": 1, "leases": 2},
    ]
    assert connection_stats([])["by_address"] == []


def test_a_broker_counts_pushes_per_queue_only_once_a_sampler_takes_them() -> None:
    clock = FakeClock()
    broker = Broker(QueueStore(clock))
    session = broker.open_session()
    session.receive([Push(b"q%d" % i, b"k", b"") for i in range(100)])
    assert broker.pushes is None  # no admin listener: no count per queue kept
    assert broker.take_pushes() == {}
    session.receive([Push(b"a", b"k", b""), Push(b"b", b"k", b""), Push(b"a", b"j", b"")])
    assert broker.take_pushes() == {b"a": 2, b"b": 1}
    assert broker.take_pushes() == {}


def test_the_sampler_keeps_at_most_its_limit_of_queues() -> None:
    clock = FakeClock()
    broker = Broker(QueueStore(clock))
    session = broker.open_session()
    sampler = Sampler(broker, clock)
    names = [b"q%d" % i for i in range(MAX_RATED_QUEUES + 5)]
    for name in names:
        sampler.watch(name)
    sampler.tick()
    session.receive([Push(name, b"k", b"") for name in names])
    clock.now += 1.0
    sampler.tick()
    last = sampler.queue_samples[-1]
    assert len(sampler.watched) == len(last.depths) == len(last.pushed) == MAX_RATED_QUEUES
    assert sampler.queue_rates(names[0])["pushed_per_s"] == 1.0
    assert sampler.queue_rates(names[-1])["popped_per_s"] is None  # past the limit
