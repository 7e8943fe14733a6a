"""What one ``/stats`` and one ``/metrics`` request cost on a server holding many packets.

    python benchmarks/admin_cost.py                       # 10,000 queues, 1,000,000 packets
    python benchmarks/admin_cost.py --queues 1000 --packets 100000 --runs 3

Fills a server's store in-process (queue depths uneven: 1 to 199, 8-byte keys, 16-byte
payloads, priorities 0..255, a quarter of the packets with a TTL), starts the server and its
admin listener on free loopback ports inside one Trio run, and times requests over real HTTP
from a worker thread: the wall time of each request, and the server's own CPU time for it,
which is how long it holds the event loop (every handler runs without yielding). Each figure is
the median of ``--runs`` requests, for the default listing (``--metrics-max-queues`` 1,000
queues) and for every queue (``?limit=`` all of them; ``/metrics`` with its limit raised).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import urllib.request
from functools import partial

import trio

from pinpriq.admin import serve_admin
from pinpriq.server import PinpriqServer
from pinpriq.store import QueueStore


def fill(store: QueueStore, queues: int, packets: int, seed: int = 1) -> None:
    """``packets`` packets over ``queues`` queues of uneven depth."""
    rng = random.Random(seed)
    weights = [1 + (i * 7919) % 199 for i in range(queues)]
    names = [b"queue-%05d" % i for i in range(queues)]
    for name, target in zip(rng.choices(names, weights, k=packets), range(packets), strict=True):
        ttl = 60_000 if target % 4 == 0 else 0
        store.push(name, rng.randbytes(8), rng.randbytes(16), ttl, rng.randrange(256))


def timed(url: str, runs: int) -> tuple[float, float, int]:
    """Median wall seconds per request, and the last body's size."""
    walls, size = [], 0
    for _ in range(runs):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=600) as response:
            size = len(response.read())
        walls.append(time.perf_counter() - started)
    return statistics.median(walls), min(walls), size


async def measure(args: argparse.Namespace) -> None:
    store = QueueStore(trio.current_time)
    started = time.perf_counter()
    fill(store, args.queues, args.packets)
    print(
        f"filled {len(store):,} packets in {store.queue_count:,} queues "
        f"in {time.perf_counter() - started:.1f} s; {store.bytes_held / 2**20:,.0f} MiB held"
    )
    async with trio.open_nursery() as nursery:
        for max_queues, label in ((1000, "the 1,000 deepest queues"), (args.queues, "every queue")):
            server = PinpriqServer(store, max_memory=0)
            await nursery.start(partial(server.serve, 0))
            listeners = await nursery.start(partial(serve_admin, server, 0, max_queues=max_queues))
            base = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
            paths = ["/stats", "/metrics"]
            if max_queues == 1000:
                paths.append("/stats?history=1&limit=50")  # what the dashboard asks each second
            for path in paths:
                cpu = time.process_time()
                wall, fastest, size = await trio.to_thread.run_sync(timed, base + path, args.runs)
                # Process CPU over the runs, per request: the server's handler plus the client's
                # reading (small beside it).
                per_request = (time.process_time() - cpu) / args.runs
                print(
                    f"{path[:8]:8} {label if '&' not in path else 'the dashboard poll, 50':26} "
                    f"{wall * 1000:8.1f} ms median wall "
                    f"({fastest * 1000:.1f} fastest), {per_request * 1000:8.1f} ms CPU, "
                    f"{size / 1024:,.0f} KiB"
                )
            server.shutdown()
        nursery.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queues", type=int, default=10_000)
    parser.add_argument("--packets", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    trio.run(measure, parser.parse_args())


if __name__ == "__main__":
    main()
