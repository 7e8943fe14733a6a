"""In-process cost of the store's push and pop and of encoding a pop's reply (issue 14).

The workload of compare_redis.py without the network: N packets of 8-byte unique keys and
16-byte payloads, priorities uniform in 1..255, pushed into one queue and popped back, each
pop's reply encoded. Prints microseconds per push and per pop (with its reply), the best of
``--repeat`` runs (the least disturbed by the rest of the machine), and which build ran.

    python benchmarks/store_ops.py                            # the installed build
    PINPRIQ_PURE_PYTHON=1 python benchmarks/store_ops.py      # the plain-Python modules
    /other/checkout/.venv/bin/python benchmarks/store_ops.py  # another checkout's modules
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from pinpriq.store import QueueStore
from pinpriq.wire import encode_reply

try:
    from pinpriq._build import build_name
except ImportError:  # a checkout from before issue 14: plain Python only

    def build_name() -> str:
        return "pure Python (a checkout without pinpriq._build)"


def once(count: int) -> tuple[float, float]:
    """Seconds per push and per pop of one run."""
    rng = random.Random(1)
    keys = [i.to_bytes(8, "big") for i in range(count)]
    payload = bytes(16)
    prios = [rng.randint(1, 255) for _ in range(count)]
    store = QueueStore(time.monotonic)
    push, pop = store.push, store.pop
    started = time.perf_counter()
    for key, prio in zip(keys, prios, strict=True):
        push(b"q", key, payload, 0, prio)
    pushed = time.perf_counter()
    for _ in range(count):
        encode_reply(pop(b"q"))
    popped = time.perf_counter()
    return (pushed - started) / count, (popped - pushed) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=300_000, help="packets (default 300,000)")
    parser.add_argument("--repeat", type=int, default=5, help="runs, best taken (default 5)")
    args = parser.parse_args()
    gc.disable()  # as pinpriq-server runs its collector rarely (tune_garbage_collector)
    runs = [once(args.n) for _ in range(args.repeat)]
    push = min(run[0] for run in runs)
    pop = min(run[1] for run in runs)
    print(f"{build_name()}: push {push * 1e6:.2f} us, pop+encode_reply {pop * 1e6:.2f} us")


if __name__ == "__main__":
    main()
