"""The workload of ``pinpriq-bench``: the scenarios, what one run of a scenario sends (sizes,
counts, keys, priorities, pacing), and the one error the bench reports to its user.

Pure data: it knows nothing of the wire, sockets or processes. Every other module of
``pinpriq.bench`` imports it; it imports nothing from them.
"""

from __future__ import annotations

import attrs

from pinpriq.wire import DEFAULT_PORT, MAX_PRIO

SCENARIOS = ("push", "push-stream", "pop", "mix", "subscribe")
SCENARIO_HELP = {
    "push": "P pushes then one pop of an empty queue as a barrier; wait for its reply",
    "push-stream": "every push sent without waiting, then one barrier",
    "pop": "pops from a queue prefilled with --prefill + N packets",
    "mix": "pushes and pops alternating, P per batch, on a queue of depth --prefill",
    "subscribe": "S subscribers with prefetch k; -c publishers push N timestamped packets",
}
REDIS_PORT = 6379


class BenchError(Exception):
    """A failure worth one line to the user: no server, a broken connection, a Redis error."""


@attrs.frozen
class Workload:
    """Everything one scenario run needs; picklable, so client processes get a copy."""

    scenario: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    redis: bool = False
    clients: int = 4
    ops: int = 100_000
    pipeline: int = 1
    key_size: int = 8
    payload_size: int = 16
    prio_levels: int = MAX_PRIO
    keys: int = 0  # distinct keys; 0: every packet its own key
    ttl_ms: int = 0
    prefill: int = 0
    subscribers: int = 1
    prefetch: int = 1
    rate: float = 0.0  # ops (subscribe: pushes) per second in all, 0 for as fast as possible
    queue: bytes = b"bench"
    seed: int = 1
    timeout: float = 30.0
    max_seconds: float = 900.0
    tls: bool = False  # connect over TLS
    tls_ca: str | None = None  # trusting these CA certificates (PEM) instead of the system's
    token: bytes | None = None  # presented first on every connection (pinpriq only)

    @property
    def fill(self) -> int:
        """Packets queued before the clock starts: pops need one each to find."""
        if self.scenario == "subscribe":
            return 0
        return self.prefill + (self.ops if self.scenario == "pop" else 0)

    def key(self, index: int) -> bytes:
        number = index % self.keys if self.keys else index
        return number.to_bytes(self.key_size, "big")

    def payload(self, index: int) -> bytes:
        # The sequence number first keeps Redis members (key + payload) unique.
        seq = (index % 256**8).to_bytes(8, "big")
        size = self.payload_size
        return seq[8 - size :] if size < 8 else seq + b"." * (size - 8)


def share(total: int, parts: int, index: int) -> tuple[int, int]:
    """The ``(start, count)`` of part ``index`` when ``total`` items are split in ``parts``."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)
