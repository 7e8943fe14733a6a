"""Instructions the server spends per operation, counted by callgrind: a figure that does not
depend on what else the machine is doing.

    python benchmarks/server_instructions.py                        # this checkout: push, pop
    python benchmarks/server_instructions.py --compare ../baseline  # and another, side by side
    python benchmarks/server_instructions.py -t push -n 64000 --runs 3
    python benchmarks/server_instructions.py --fsync everysec      # with --data-dir (a log)
    python benchmarks/server_instructions.py -t pop --fsync everysec --log-segment-size 1MiB
    python benchmarks/server_instructions.py -P 1 -n 8000          # a round trip per request
    python benchmarks/server_instructions.py -t push --ttl 65536   # pushes as 71 frames
    python benchmarks/server_instructions.py -P 1 --trio-null      # and the Trio null server
    python benchmarks/server_instructions.py -P 1 -c 1             # one client: every request waits
    python benchmarks/server_instructions.py -t pop --group 10     # pops of key groups of 10

Each measurement starts ``pinpriq-server`` under ``valgrind --tool=callgrind``, drives it with
``pinpriq-bench`` (4 client processes or ``-c``, pipeline 64 or ``-P``, 8-byte keys, 16-byte
payloads, prio 1..255, as ``compare_redis.py``), stops it with SIGTERM and reads the
instruction total valgrind prints. It does so for N and for 2N operations and divides the
difference by N, so start-up, imports and shutdown cancel out. Pop scenarios push their packets
first, so "pop" is a push and a pop.

With ``--ttl MS`` every push carries that TTL. A TTL above 65,535 ms does not fit a ``70``, so
the bench sends each push as a ``71`` with delay 0 (protocol 1.2): ``--ttl 65536`` against
``--ttl 65535`` is what a ``71`` costs against a ``70``, the TTL's own cost being the same.

With ``--group G`` (pop only) the queue holds N key groups of G packets (``--keys N
--prefill (G-1)N``, as ``compare_redis.py``'s ``pop-grouped``), so each of the N pops takes a
whole group: an operation is one grouped pop and the G pushes that filled it.

With ``--fsync POLICY`` each server runs with ``--data-dir`` on a fresh temporary directory and
that policy, so the figure includes logging every push and pop (fsyncs themselves are the
kernel's, and not counted). ``--log-segment-size`` passes its size to those servers: a log of
many segments at a depth valgrind can reach, where removals are counted across segments and
compaction runs (a drain of 64,000 packets in 1 MiB segments goes as one of 2,000,000 in 32 MiB
ones).

With ``--trio-null`` each checkout's ``benchmarks/trio_null_server.py`` (pinpriq's socket loop
and codec, no store) is measured the same way after it: the ceiling a request's instructions
are compared with, "null" in the output.

At ``-P 1`` how often a read finds the next request already there (and so how often the
server waits in trio) depends on the timing of the 4 clients, and the figure moves by up to
10% from run to run; with ``-c 1`` every request is one wait, read, reply, the same path each
time, which is the figure to compare two versions of the socket loop by.

Valgrind runs the server about 50 times slower than usual, so a run of the default 64,000
operations takes about a minute. The figure moves by about 1% from run to run (the garbage
collector and the batching of frames differ a little); ``--runs`` repeats and gives the median.
Needs ``valgrind`` (Debian's package); the other checkout needs its own ``.venv``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(sys.executable).parent / "pinpriq-bench"
WORKLOAD = ["--key-size", "8", "--payload-size", "16", "--prio-levels", "255"]
TOTAL = re.compile(rb"Collected : (\d+)")
LISTENING = re.compile(rb"listening on \S+ port (\d+)")
#: Seconds a server under valgrind may take to start listening: 120 was too few at a load
#: average of 10 on 2 cores (its imports run about 50 times slower under valgrind).
START_TIMEOUT = 600


def server_instructions(
    checkout: Path,
    scenario: str,
    ops: int,
    fsync: str | None = None,
    pipeline: int = 64,
    ttl_ms: int = 0,
    null: bool = False,
    clients: int = 4,
    group: int = 1,
    segment_size: str | None = None,
) -> int:
    """Instructions of one server process serving ``ops`` operations of ``scenario`` at
    ``pipeline`` requests in flight per connection, pushes with TTL ``ttl_ms``, pops of key
    groups of ``group``; with a log on a fresh directory if ``fsync`` names a policy; of the
    checkout's Trio null server instead of ``pinpriq-server`` if ``null``; driven by
    ``clients`` connections."""
    valgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    with tempfile.TemporaryFile() as log, tempfile.TemporaryDirectory() as data:
        if null:
            python = str(checkout / ".venv" / "bin" / "python")
            command = [python, str(checkout / "benchmarks" / "trio_null_server.py"), "--port", "0"]
        else:
            command = [str(checkout / ".venv" / "bin" / "pinpriq-server"), "--port", "0"]
            command += ["--data-dir", data, "--fsync", fsync] if fsync else []
            command += ["--log-segment-size", segment_size] if fsync and segment_size else []
            command += _admin_options(command[0])
        server = subprocess.Popen(
            [*valgrind, *command],
            stderr=log,
            stdout=subprocess.DEVNULL,
        )
        try:
            port = _port(log, server)
            bench = [str(BENCH), "--port", str(port), "-q", "--json", "-t", scenario]
            bench += ["--ttl", str(ttl_ms)] if ttl_ms else []
            bench += ["--keys", str(ops), "--prefill", str((group - 1) * ops)] if group > 1 else []
            subprocess.run(
                [
                    *bench,
                    "-n",
                    str(ops),
                    "--timeout",
                    "600",
                    "-P",
                    str(pipeline),
                    "-c",
                    str(clients),
                    *WORKLOAD,
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                timeout=3600,
            )
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        log.seek(0)
        match = TOTAL.search(log.read())
    if match is None:
        raise SystemExit(f"no instruction total from valgrind for {checkout}")
    return int(match.group(1))


def _admin_options(server: str) -> list[str]:
    """``--http-port 0`` for a server with an admin listener (so it is measured running, on a
    free port); nothing for one from before it."""
    usage = subprocess.run([server, "--help"], capture_output=True, text=True, check=True)
    return ["--http-port", "0"] if "--http-port" in usage.stdout else []


def _port(log: IO[bytes], server: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        log.seek(0)
        if match := LISTENING.search(log.read()):
            return int(match.group(1))
        if server.poll() is not None:
            raise SystemExit("the server exited at start under valgrind")
        time.sleep(0.2)
    raise SystemExit(f"the server did not listen within {START_TIMEOUT} s under valgrind")


def per_op(
    checkout: Path,
    scenario: str,
    ops: int,
    fsync: str | None = None,
    pipeline: int = 64,
    ttl_ms: int = 0,
    null: bool = False,
    clients: int = 4,
    group: int = 1,
    segment_size: str | None = None,
) -> float:
    """Instructions per operation: the difference between 2N and N operations, over N."""
    options = (fsync, pipeline, ttl_ms, null, clients, group, segment_size)
    return (
        server_instructions(checkout, scenario, 2 * ops, *options)
        - server_instructions(checkout, scenario, ops, *options)
    ) / ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-t", dest="scenarios", default="push,pop", help="(default: push,pop)")
    parser.add_argument("-n", dest="ops", type=int, default=64_000, help="N (default: 64000)")
    parser.add_argument(
        "-P", dest="pipeline", type=int, default=64, help="requests in flight (default: 64)"
    )
    parser.add_argument(
        "-c", dest="clients", type=int, default=4, help="client connections (default: 4)"
    )
    parser.add_argument("--runs", type=int, default=1, help="repeat, report the median")
    parser.add_argument("--compare", type=Path, help="another checkout, with its own .venv")
    parser.add_argument(
        "--ttl",
        type=int,
        default=0,
        metavar="MS",
        help="every push's TTL; above 65535 pushes are 71 frames (default: 0, 70 frames)",
    )
    parser.add_argument(
        "--fsync",
        choices=["always", "everysec", "no"],
        help="run the servers with --data-dir (fresh) and this policy (default: memory only)",
    )
    parser.add_argument(
        "--log-segment-size",
        metavar="SIZE",
        help="with --fsync: the servers' --log-segment-size (default: theirs, 32MiB)",
    )
    parser.add_argument(
        "--trio-null",
        action="store_true",
        help="measure each checkout's benchmarks/trio_null_server.py too",
    )
    parser.add_argument(
        "--group",
        type=int,
        default=1,
        metavar="G",
        help="pop scenario: each pop takes a key group of G packets (default: 1)",
    )
    args = parser.parse_args()
    if args.group < 1 or (args.group > 1 and args.scenarios != "pop"):
        parser.error("--group takes a G of 1 or more, with -t pop alone")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    checkouts = [ROOT] + ([args.compare.resolve()] if args.compare else [])
    servers = [False, True] if args.trio_null else [False]
    for scenario in args.scenarios.split(","):
        for null in servers:
            figures = []
            name = "null " if null else ""
            for checkout in checkouts:
                runs = [
                    per_op(
                        checkout,
                        scenario,
                        args.ops,
                        args.fsync,
                        args.pipeline,
                        args.ttl,
                        null,
                        args.clients,
                        args.group,
                        args.log_segment_size,
                    )
                    for _ in range(args.runs)
                ]
                figures.append(statistics.median(runs))
                print(f"{scenario:5} {name}{checkout}: {figures[-1]:,.0f} per op", flush=True)
            if len(figures) == 2:
                print(
                    f"{scenario:5} {name}this checkout / the other: {figures[0] / figures[1]:.3f}"
                )


if __name__ == "__main__":
    main()
