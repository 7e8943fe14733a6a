"""The ``pinpriq-bench`` command line: arguments, the workloads they describe, the table or
JSON printed, and ``main``. Measuring is ``runner``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
from collections.abc import Iterator
from typing import Any

from pinpriq import __version__
from pinpriq.auth import TOKEN_VARIABLE
from pinpriq.bench.runner import run_scenario
from pinpriq.bench.workload import (
    REDIS_PORT,
    SCENARIO_HELP,
    SCENARIOS,
    BenchError,
    Workload,
)
from pinpriq.cli.args import OneLineParser, int_in, port_number, positive, seconds
from pinpriq.wire import DEFAULT_PORT, MAX_PRIO, MAX_TTL_MS


def _scenarios(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown scenario {', '.join(unknown) or text!r}; choose from {', '.join(SCENARIOS)}"
        )
    return names


def bench_parser() -> argparse.ArgumentParser:
    scenarios = "\n".join(f"  {name:12} {text}" for name, text in SCENARIO_HELP.items())
    parser = OneLineParser(
        prog="pinpriq-bench",
        description="Measure a pinpriq server (or, with --redis, a Redis server as ZADD/ZPOPMIN) "
        "under load from several client processes.",
        epilog=f"scenarios:\n{scenarios}\n\nLatency is the round trip of a batch (one op at "
        "-P 1), or push-to-delivery for subscribe. Speak only to servers you own: the bench "
        "leaves its pushed packets queued.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="server address (default: %(default)s)")
    add("--port", type=port_number, help=f"(default: {DEFAULT_PORT}, or {REDIS_PORT} with --redis)")
    add("--redis", action="store_true", help="the server is Redis: ZADD to push, ZPOPMIN to pop")
    add("-c", dest="clients", type=int_in(1, 1024), default=4, metavar="N",
        help="client connections, each in its own process (default: %(default)s)")  # fmt: skip
    add("-n", dest="ops", type=int_in(1), default=100_000, metavar="N",
        help="operations in all, per scenario (default: %(default)s)")  # fmt: skip
    add("-P", dest="pipeline", type=int_in(1, 65535), default=1, metavar="N",
        help="requests per round trip (default: %(default)s)")  # fmt: skip
    add("-t", dest="scenarios", type=_scenarios, default=list(SCENARIOS), metavar="LIST",
        help=f"comma-separated scenarios (default: {','.join(SCENARIOS)})")  # fmt: skip
    add("--key-size", type=int_in(1, 0xFFFF), default=8, metavar="B", help="(default: 8)")
    add("--payload-size", type=int_in(0, 0xFFFF), default=16, metavar="B", help="(default: 16)")
    add("--prio-levels", type=int_in(1, MAX_PRIO), default=MAX_PRIO, metavar="L",
        help="priorities drawn uniformly from 1..L (default: %(default)s)")  # fmt: skip
    add("--keys", type=int_in(1), default=0, metavar="K",
        help="distinct keys, cycled, so pops take groups (default: all unique)")  # fmt: skip
    add("--ttl", type=int_in(0, MAX_TTL_MS), default=0, metavar="MS",
        help="TTL of every push, 0 for none (default: 0)")  # fmt: skip
    add("--prefill", type=int_in(0), default=0, metavar="N",
        help="packets queued before the clock starts; pop adds N more (default: 0)")  # fmt: skip
    add("--subscribers", type=int_in(1, 10_000), default=1, metavar="S", help="(default: 1)")
    add("--prefetch", type=int_in(1, 0xFFFF), default=1, metavar="K",
        help="credits each subscriber keeps outstanding (default: 1)")  # fmt: skip
    add("--rate", type=positive("ops per second"), default=0.0, metavar="R",
        help="paced ops (subscribe: pushes) per second in all (default: unpaced)")  # fmt: skip
    add("--queue", default="bench", metavar="PREFIX", help="queue name prefix (default: bench)")
    add("--seed", type=int, default=1, help="seed of the priorities (default: 1)")
    add("--timeout", type=seconds, default=30.0, metavar="S",
        help="longest wait for any one reply (default: 30)")  # fmt: skip
    add("--server-pid", type=int_in(1), metavar="PID",
        help="also report the server process's CPU time per op (Linux)")  # fmt: skip
    add("--tls", action="store_true",
        help="connect over TLS, trusting the system's CAs")  # fmt: skip
    add("--tls-ca", metavar="FILE",
        help="connect over TLS, trusting the CA certificates in FILE")  # fmt: skip
    add("--json", action="store_true", help="print one JSON object instead of a table")
    add("-q", "--quiet", action="store_true", help="no progress line")
    add("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def workloads(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Iterator[Workload]:
    """One workload per scenario; a combination that cannot work is a usage error."""
    _check(args, parser)
    port = args.port if args.port is not None else (REDIS_PORT if args.redis else DEFAULT_PORT)
    names = "host redis clients ops pipeline key_size payload_size prio_levels keys prefill"
    names += " subscribers prefetch rate seed timeout"
    fields = {name: getattr(args, name) for name in names.split()}
    token = os.environ.get(TOKEN_VARIABLE)
    for scenario in args.scenarios:
        yield Workload(
            scenario=scenario,
            port=port,
            ttl_ms=args.ttl,
            queue=os.fsencode(args.queue),
            tls=args.tls or args.tls_ca is not None,
            tls_ca=args.tls_ca,
            token=os.fsencode(token) if token and not args.redis else None,
            **fields,
        )


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.redis and args.ttl:
        parser.error("--ttl has no Redis counterpart (a sorted set has no per-member TTL)")
    if (args.tls or args.tls_ca) and (args.redis or "subscribe" in args.scenarios):
        parser.error("--tls is for pinpriq's throughput scenarios; drop --redis and subscribe")
    if args.redis and "subscribe" in args.scenarios:
        parser.error("the subscribe scenario has no Redis counterpart; drop it from -t")
    if "subscribe" in args.scenarios and args.payload_size < 8:
        parser.error("subscribe needs --payload-size of at least 8 for the send timestamp")
    if not args.keys and 256**args.key_size < args.prefill + 2 * args.ops:
        parser.error(f"--key-size {args.key_size} is too small for unique keys; add --keys")
    if args.keys and 256**args.key_size < args.keys:
        parser.error(f"--key-size {args.key_size} is too small for --keys {args.keys}")
    if args.clients > args.ops:
        parser.error(f"-c {args.clients} is more clients than -n {args.ops} operations")


def format_table(results: list[dict[str, Any]]) -> str:
    head = f"{'scenario':12} {'ops':>10} {'seconds':>8} {'ops/s':>10}  latency us p50/p99/p99.9"
    lines = [head]
    for r in results:
        rate = r.get("deliveries_per_sec") if r["scenario"] == "subscribe" else r["ops_per_sec"]
        lat = r["latency_us"]
        latency = f"{lat['p50']}/{lat['p99']}/{lat['p99.9']} ({r['latency_kind']})" if lat else "-"
        lines.append(
            f"{r['scenario']:12} {r['ops']:>10,} {r['seconds']:>8.3f} {rate or 0:>10,}  {latency}"
        )
        notes = [f"generator {r['generator_cpu_us_per_op']} us CPU/op"]
        if "server_cpu_us_per_op" in r:
            notes.append(f"server {r['server_cpu_us_per_op']} us CPU/op")
        if r.get("empty_pops"):
            notes.append(f"{r['empty_pops']:,} pops found nothing")
        if r.get("missing"):
            notes.append(f"{r['missing']:,} packets never delivered")
        if r["scenario"] == "subscribe":
            notes.append(f"{r['deliveries']:,} deliveries")
        lines.append(f"{'':12} " + "; ".join(notes))
    return "\n".join(lines)


def _describe(w: Workload) -> str:
    keys = f"{w.keys:,} keys" if w.keys else "unique keys"
    server = "redis" if w.redis else "pinpriq"
    return (
        f"{server} at {w.host}:{w.port}: -c {w.clients} -P {w.pipeline}, {w.key_size}-byte keys"
        f" ({keys}), {w.payload_size}-byte payloads, prio 1..{w.prio_levels}"
        + (f", ttl {w.ttl_ms} ms" if w.ttl_ms else "")
    )


def _preflight(w: Workload) -> None:
    """Fail with one line, before starting any process, when nothing listens."""
    try:
        socket.create_connection((w.host, w.port), timeout=w.timeout).close()
    except OSError as error:
        raise BenchError(f"cannot connect to {w.host}:{w.port}: {error}") from None


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pinpriq-bench``."""
    parser = bench_parser()
    args = parser.parse_args(argv)
    runs = list(workloads(args, parser))
    # SIGTERM unwinds like Ctrl-C, so that the client processes are stopped too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    status = None if args.quiet else sys.stderr
    results = []
    try:
        _preflight(runs[0])
        for w in runs:
            results.append(run_scenario(w, server_pid=args.server_pid, status=status))
    except BenchError as error:
        sys.exit(f"pinpriq-bench: {error}")
    except KeyboardInterrupt:
        sys.exit(130)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "quiet")}
        document = {"tool": "pinpriq-bench", "version": __version__, "settings": settings}
        print(json.dumps({**document, "results": results}))
    else:
        print(_describe(runs[0]))
        print(format_table(results))
