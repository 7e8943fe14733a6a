"""The admin layer's figures without a loop or a socket: a broker, a fake clock, ``Sampler``."""

from __future__ import annotations

from pinpriq.admin.stats import Sampler, listed_queues, server_stats
from pinpriq.broker import Broker
from pinpriq.store import QueueStore
from pinpriq.wire import Pop, Push, Subscribe


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
