"""System calls and CPU time per operation of one front end on Redis, for several checkouts
interleaved: the figures the machine's load moves least (a front end's throughput on 2 shared
cores moves by 2x with the load; its system calls per operation hardly at all).

Each round, for each checkout in turn: a fresh ``redis-server`` (noeviction, no persistence)
and a fresh front end of that checkout (``PYTHONPATH=CHECKOUT``, this interpreter, so a
checkout's compiled modules must be built for it), then for each case ``pinpriq-bench`` (this
checkout's, 4 connections, 8-byte keys, 16-byte payloads, prio 1..255, ``--server-pid``) while
``perf stat -e raw_syscalls:sys_enter`` counts the front end's system calls. Prints each
measurement, then medians over rounds.

    python benchmarks/redis_front_end_syscalls.py --checkout base=/tmp/base-a9f \\
        --checkout new=. --rounds 3 push:64:50000 pop:64:50000 push:1:10000 pop:1:10000

Needs ``perf`` allowed to read tracepoints (``kernel.perf_event_paranoid`` <= 2 as root).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_redis_store import BIN, WORKLOAD, free_port, redis_server, started

#: Starts a checkout's server with this interpreter (its console script would import ours).
SERVER = (
    "import sys; from pinpriq.cli.server import main; sys.argv[0] = 'pinpriq-server'; "
    "sys.exit(main())"
)


@contextlib.contextmanager
def front_end(checkout: str, redis_port: int) -> Iterator[tuple[int, int]]:
    """A front end of ``checkout`` on that Redis: its port and process id."""
    port = free_port()
    # -P: the current directory (a checkout, perhaps) must not come before PYTHONPATH.
    command = [sys.executable, "-P", "-c", SERVER, "--port", str(port), "--http-port", "off",
               "--log-level", "error", "--store", f"redis://127.0.0.1:{redis_port}/0"]  # fmt: skip
    with contextlib.ExitStack() as stack:
        os.environ["PYTHONPATH"] = checkout  # the server's only: not the load generator's
        try:
            process = stack.enter_context(started(command, port))
        finally:
            del os.environ["PYTHONPATH"]
        yield port, process.pid


def measure(port: int, pid: int, scenario: str, depth: int, n: int) -> tuple[float, float, float]:
    """System calls per operation, operations per second, front-end CPU us per operation."""
    perf = subprocess.Popen(
        ["perf", "stat", "-x,", "-e", "raw_syscalls:sys_enter", "-p", str(pid)],
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.3)  # perf attached
    bench = [str(BIN / "pinpriq-bench"), "--port", str(port), "--json", "-q", "-t", scenario,
             "-n", str(n), "-c", "4", "-P", str(depth), *WORKLOAD,
             "--server-pid", str(pid)]  # fmt: skip
    done = subprocess.run(bench, capture_output=True, text=True, timeout=900, check=True)
    perf.send_signal(2)
    report = perf.communicate(timeout=30)[1]
    line = next(line for line in report.splitlines() if "sys_enter" in line)
    result = json.loads(done.stdout)["results"][0]
    rate = result.get("ops_per_sec", result.get("deliveries_per_sec"))  # subscribe: deliveries
    return int(line.split(",")[0]) / n, rate, result["server_cpu_us_per_op"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", action="append", required=True, metavar="NAME=PATH")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("cases", nargs="+", metavar="SCENARIO:DEPTH:OPS")
    args = parser.parse_args(argv)
    checkouts = dict(item.split("=", 1) for item in args.checkout)
    cases = [(s, int(d), int(n)) for s, d, n in (case.split(":") for case in args.cases)]
    figures: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for round_number in range(args.rounds):
        for name, checkout in checkouts.items():
            with redis_server() as redis_port, front_end(checkout, redis_port) as (port, pid):
                for scenario, depth, n in cases:
                    case = f"{scenario} P{depth}"
                    figure = measure(port, pid, scenario, depth, n)
                    figures.setdefault((case, name), []).append(figure)
                    print(f"round {round_number + 1} {name:>8} {case:>9}: {figure[0]:.3f} "
                          f"syscalls/op, {figure[1]:,.0f} ops/s, {figure[2]:.1f} us CPU/op",
                          flush=True)  # fmt: skip
    print("medians:")
    for (case, name), rounds in figures.items():
        syscalls, rate, cpu = (statistics.median(r[i] for r in rounds) for i in range(3))
        print(f"{case:>9} {name:>8}: {syscalls:.3f} syscalls/op, {rate:,.0f} ops/s, "
              f"{cpu:.1f} us CPU/op")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
