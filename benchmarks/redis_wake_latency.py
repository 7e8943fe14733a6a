"""How soon a subscriber on one front end hears of a push through another, both on one Redis.

Starts a redis-server (noeviction, no persistence) on a free loopback port and two pinpriq front
ends on it (in this process), subscribes one connection on front end B, then 300 times: grants a
credit, pushes one packet through front end A, and times the push's send to the delivery's
arrival. Prints the median, p90, p99 and max. Once both front ends are up, the process's
garbage collector is set as ``pinpriq-server`` sets it (``tune_garbage_collector``): with
Python's default thresholds its collections of everything the front ends made at start were a
tail a real server does not have.

    python benchmarks/redis_wake_latency.py [--samples 300]
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pinpriq.cli.server import tune_garbage_collector  # noqa: E402
from pinpriq.redis.connect import open_store  # noqa: E402
from pinpriq.redis.spec import parse_store  # noqa: E402
from pinpriq.server import PinpriqServer  # noqa: E402

SYNC, READY = b"\x21", b"\x41"


@contextlib.asynccontextmanager
async def front_end(url: str) -> AsyncIterator[int]:
    async with open_store(parse_store(url)) as (store, deliveries):
        server = PinpriqServer(store, deliveries=deliveries, max_memory=0)
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(server.serve, 0, host="127.0.0.1"))
            yield listeners[0].socket.getsockname()[1]
            nursery.cancel_scope.cancel()


async def read_exactly(stream: trio.SocketStream, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = await stream.receive_some(size - len(data))
        if not chunk:
            raise EOFError("the server closed the connection")
        data += chunk
    return data


async def measure(url: str, samples: int) -> list[float]:
    async with front_end(url) as a, front_end(url) as b:
        sub = await trio.open_tcp_stream("127.0.0.1", b)
        pusher = await trio.open_tcp_stream("127.0.0.1", a)
        await sub.send_all(b"\x73" + struct.pack(">H", 4) + b"wake" + SYNC)
        await read_exactly(sub, 2)
        frame = b"\x70" + struct.pack(">HHBHH", 4, 0, 1, 1, 1) + b"kp" + b"wake"
        tune_garbage_collector()
        took = []
        for _ in range(samples):
            await sub.send_all(READY + SYNC)
            await read_exactly(sub, 2)
            started = time.perf_counter()
            await pusher.send_all(frame)
            await read_exactly(sub, 2 + 4 + 2)  # one packet: count, lengths, key, payload
            took.append((time.perf_counter() - started) * 1000)
            await trio.sleep(0.002)
        await sub.aclose()
        await pusher.aclose()
    return sorted(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        redis = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", directory,
             "--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            time.sleep(0.5)
            took = trio.run(measure, f"redis://127.0.0.1:{port}/0", args.samples)
        finally:
            redis.kill()
            redis.wait()
    n = len(took)
    print(
        f"push through front end A -> delivery on front end B, {n} samples: median "
        f"{statistics.median(took):.2f} ms, p90 {took[int(n * 0.9)]:.2f} ms, "
        f"p99 {took[int(n * 0.99)]:.2f} ms, max {took[-1]:.2f} ms"
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


if __name__ == "__main__":
    main()
