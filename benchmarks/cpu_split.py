"""User and system CPU a request at pipeline 1: pinpriq-server against the Trio null server.

``compare_redis.py`` gives each server's CPU a request as one figure; at -P 1 more than half of
it is the kernel's (a ``read`` and a ``write`` a request), and callgrind counts only user-space
instructions. This script splits the two: it starts each server in turn on a free loopback
port, drives it with ``pinpriq-bench -t push|pop -P 1 -c 4`` and reads the server's user and
system time from ``/proc/PID/stat`` before and after, alternating the servers for ``--rounds``
rounds, and prints the medians a request. Pair it with ``strace -c -f -p PID`` to count the
system calls themselves.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def start(server: str, port: int) -> subprocess.Popen[bytes]:
    if server == "pinpriq":
        command = [str(BIN / "pinpriq-server"), "--port", str(port), "--http-port", "0"]
    else:
        command = [sys.executable, str(ROOT / "benchmarks" / "trio_null_server.py")]
        command += ["--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit(f"cpu_split: {server} did not listen on port {port} within 10 s")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """Process ``pid``'s user and system time so far (fields 14 and 15 of its stat line)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICKS_PER_SECOND, int(fields[12]) / TICKS_PER_SECOND


def measure(server: str, kind: str, ops: int) -> tuple[float, float]:
    """Microseconds of user and system time the server spent a request."""
    port = free_port()
    process = start(server, port)
    try:
        user_before, system_before = cpu_seconds(process.pid)
        bench = [str(BIN / "pinpriq-bench"), "--port", str(port), "-t", kind, "-P", "1"]
        bench += ["-c", "4", "-n", str(ops), "--key-size", "8", "--payload-size", "16"]
        bench += ["--prio-levels", "255", "-q"]
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        user_after, system_after = cpu_seconds(process.pid)
    finally:
        process.terminate()
        process.wait()
    return (user_after - user_before) / ops * 1e6, (system_after - system_before) / ops * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-n", "--ops", type=int, default=40000, help="requests a measurement")
    args = parser.parse_args()
    if args.rounds < 1 or args.ops < 100:
        parser.error("--rounds must be at least 1 and -n at least 100")
    figures: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for server in ("pinpriq", "null"):
            for kind in ("push", "pop"):
                figures.setdefault((server, kind), []).append(measure(server, kind, args.ops))
    for kind in ("push", "pop"):
        totals = {}
        for server in ("pinpriq", "null"):
            runs = figures[server, kind]
            user = statistics.median(run[0] for run in runs)
            system = statistics.median(run[1] for run in runs)
            totals[server] = user + system
            print(f"{kind:4} {server:7} user {user:6.2f} us  system {system:6.2f} us a request")
        print(f"{kind:4} pinpriq / null: {totals['pinpriq'] / totals['null']:.2f}x")


if __name__ == "__main__":
    main()
