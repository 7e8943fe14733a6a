"""Throughput of this checkout's server against another checkout's, interleaved.

    python benchmarks/ab_throughput.py --other ../baseline              # push and pop, 5 rounds
    python benchmarks/ab_throughput.py --other ../baseline -t push --rounds 9
    python benchmarks/ab_throughput.py --other ../baseline -P 1 -n 20000   # one request a wait
    python benchmarks/ab_throughput.py --other ../baseline --fsync always   # with a log

Each round starts a fresh ``pinpriq-server`` from each checkout (its own ``.venv``), in
alternating order, drives each with this checkout's ``pinpriq-bench`` (4 client processes,
pipeline 64 and 400,000 operations unless told, 8-byte keys, 16-byte payloads, priorities 1..255, as
``server_instructions.py``) and stops it. A ratio is taken within each round, so the two
servers of a round see the same machine load; the figure is the median of those ratios. On a
shared machine the spread is wide: ``server_instructions.py`` gives the load-independent view.

With ``--fsync POLICY`` each server runs with ``--data-dir`` on a fresh directory (under
``--dir``, the system's temporary directory unless told: choose the disk to measure) and that
policy, and is stopped before the directory is removed.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(sys.executable).parent / "pinpriq-bench"
WORKLOAD = ["-c", "4", "--key-size", "8", "--payload-size", "16", "--prio-levels", "255"]
LISTENING = re.compile(rb"listening on \S+ port (\d+)")


def throughput(
    checkout: Path, scenario: str, shape: list[str], log_options: list[str]
) -> tuple[float, float]:
    """Operations per second of one fresh server of ``checkout``, and its CPU microseconds per
    operation (less sensitive than the rate to what else the machine runs). ``shape`` is the
    load generator's pipeline and count options; ``log_options`` the server's (``--data-dir``,
    ``--fsync``), or none."""
    server = str(checkout / ".venv" / "bin" / "pinpriq-server")
    usage = subprocess.run([server, "--help"], capture_output=True, text=True, check=True).stdout
    admin = ["--http-port", "0"] if "--http-port" in usage else []
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen([server, "--port", "0", *admin, *log_options], stderr=log)
        try:
            port = _port(log, process)
            bench = [str(BENCH), "--port", str(port), "--server-pid", str(process.pid)]
            done = subprocess.run(
                [*bench, "-q", "--json", "-t", scenario, *WORKLOAD, *shape],
                check=True,
                capture_output=True,
                text=True,
                timeout=600,
            )
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
    result = next(r for r in json.loads(done.stdout)["results"] if r["scenario"] == scenario)
    return float(result["ops_per_sec"]), float(result["server_cpu_us_per_op"])


def _measure(
    checkout: Path, scenario: str, shape: list[str], fsync: str | None, parent: Path | None
) -> tuple[float, float]:
    """``throughput``, on a fresh data directory with ``fsync`` if given."""
    if fsync is None:
        return throughput(checkout, scenario, shape, [])
    with tempfile.TemporaryDirectory(dir=parent, prefix="ab-throughput-") as data_dir:
        return throughput(checkout, scenario, shape, ["--data-dir", data_dir, "--fsync", fsync])


def _port(log: object, process: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        log.seek(0)  # type: ignore[attr-defined]
        if match := LISTENING.search(log.read()):  # type: ignore[attr-defined]
            return int(match.group(1))
        if process.poll() is not None:
            raise SystemExit("a server exited at start")
        time.sleep(0.1)
    raise SystemExit("a server did not listen within 30 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", type=Path, required=True, help="a checkout with its .venv")
    parser.add_argument("-t", dest="scenarios", default="push,pop", help="(default: push,pop)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-P", dest="pipeline", type=int, default=64, help="(default: 64)")
    parser.add_argument("-n", dest="count", type=int, default=400_000, help="(default: 400,000)")
    parser.add_argument(
        "--fsync",
        choices=["always", "everysec", "no"],
        help="run the servers with --data-dir (fresh each time) and this policy",
    )
    parser.add_argument(
        "--dir", type=Path, help="where the data directories are made (default: the temp dir)"
    )
    args = parser.parse_args()
    shape = ["-P", str(args.pipeline), "-n", str(args.count)]
    checkouts = [ROOT, args.other.resolve()]
    policy = f" --fsync {args.fsync}" if args.fsync else ""
    for scenario in args.scenarios.split(","):
        ratios, cpu_ratios = [], []
        for round_number in range(args.rounds):
            order = checkouts if round_number % 2 == 0 else checkouts[::-1]
            figures = {
                checkout: _measure(checkout, scenario, shape, args.fsync, args.dir)
                for checkout in order
            }
            (ours, our_cpu), (theirs, their_cpu) = figures[ROOT], figures[checkouts[1]]
            ratios.append(ours / theirs)
            cpu_ratios.append(our_cpu / their_cpu)
            print(
                f"{scenario} -P {args.pipeline}{policy} round {round_number + 1}: "
                f"this {ours:,.0f}/s ({our_cpu} us/op), "
                f"other {theirs:,.0f}/s ({their_cpu} us/op), ratio {ratios[-1]:.3f}",
                flush=True,
            )
        print(
            f"{scenario} -P {args.pipeline}{policy}: "
            f"median throughput ratio {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}-{max(ratios):.3f}, {args.rounds} rounds); server CPU "
            f"per op, this / other: {statistics.median(cpu_ratios):.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
