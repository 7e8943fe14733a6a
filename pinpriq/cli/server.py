"""``pinpriq-server``: parse the options, set up the process, run the Trio server until a
signal.

Argument errors and startup failures print one line and exit non-zero; no traceback reaches the
user. ``python -m pinpriq.cli.server`` runs it too.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import trio

from pinpriq import __version__
from pinpriq._build import build_name
from pinpriq.admin import serve_admin
from pinpriq.admin.stats import DEFAULT_MAX_QUEUES
from pinpriq.auth import TOKEN_VARIABLE, TokenError, is_loopback, load_token
from pinpriq.cli.args import (
    OneLineParser,
    byte_size,
    http_port,
    int_in,
    port_number,
    seconds,
    seconds_at_most,
)
from pinpriq.cli.logs import LOG_FORMATS, configure_logging
from pinpriq.client_memory import MIN_DEFAULT_BUDGET
from pinpriq.leases import DEAD_SUFFIX, DEFAULT_LEASE_MS, DEFAULT_MAX_DELIVERIES
from pinpriq.packed import DEFAULT_STORE_OVERHEAD
from pinpriq.persistence.journal import (
    DEFAULT_SEGMENT_SIZE,
    MIN_SEGMENT_SIZE,
    FsyncPolicy,
    Journal,
)
from pinpriq.persistence.keeper import LogFailure
from pinpriq.persistence.packed_store import LogBacked, logged_store
from pinpriq.persistence.recovery import report, scan
from pinpriq.persistence.segments import DataDir, DataDirError
from pinpriq.redis.spec import StoreError, StoreSpec, parse_store
from pinpriq.server import DEFAULT_FRAME_TIMEOUT, DEFAULT_MAX_CONNECTIONS, PinpriqServer
from pinpriq.tls import TlsError, server_context
from pinpriq.wire import DEFAULT_PORT, MAX_LEASE_MS

__all__ = ["main", "server_parser"]

LOG_LEVELS = ("debug", "info", "warning", "error")
#: The admin listener's default port: the data port's neighbour.
DEFAULT_HTTP_PORT = 7001


def server_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="pinpriq-server",
        description="Run a pinpriq priority-queue server.",
        epilog="SIGINT or SIGTERM stops the server gracefully: it stops accepting, flushes the "
        "replies it owes (for up to a second), closes every connection and exits 0. A second "
        "signal exits at once with status 1.",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: %(default)s; 0.0.0.0 for every interface)",
    )
    parser.add_argument(
        "--port",
        type=port_number,
        default=DEFAULT_PORT,
        help="TCP port to listen on, 0 for any free port (default: %(default)s)",
    )
    parser.add_argument(
        "--store",
        type=store_spec,
        default="memory",
        metavar="STORE",
        help="where queues live: memory (this process; the default), redis://HOST:PORT/DB, "
        "rediss://HOST:PORT/DB (TLS), or redis-cluster://HOST:PORT[,HOST:PORT...]; on Redis, "
        "any number of servers share the queues (README: Scaling out)",
    )
    parser.add_argument(
        "--max-memory",
        type=byte_size,
        default="1GiB",
        metavar="SIZE",
        help="cap on the memory queued packets may hold (keys, payloads and about "
        f"{DEFAULT_STORE_OVERHEAD} bytes of bookkeeping each), "
        "e.g. 512MiB or 2GB; when reached, "
        "pushes wait until pops or expiry free room. 0 for no cap (default: 1GiB). With a "
        "Redis store, Redis's maxmemory is the cap instead",
    )
    parser.add_argument(
        "--max-connections",
        type=int_in(1),
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="most concurrent connections; further ones are accepted and closed at once "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--frame-timeout",
        type=seconds,
        default=DEFAULT_FRAME_TIMEOUT,
        metavar="SECONDS",
        help="close a connection that has held an incomplete frame for this many seconds of "
        "reading (time the server itself makes it wait does not count; default: %(default)g)",
    )
    parser.add_argument(
        "--max-client-memory",
        type=byte_size,
        metavar="SIZE",
        help="cap on what all connections together make the server hold in incomplete frames "
        "and unsent replies; past it, the connections holding the largest incomplete frames "
        "are closed, and those owed replies stop being read. 0 for no cap (default: a quarter "
        f"of --max-memory, at least {MIN_DEFAULT_BUDGET // 1024**2}MiB)",
    )
    parser.add_argument(
        "--lease-default",
        type=seconds_at_most(MAX_LEASE_MS / 1000),
        default=DEFAULT_LEASE_MS / 1000,
        metavar="SECONDS",
        help="lease time of a reserve or leased subscribe that asks for 0, at most 86400 "
        "(default: %(default)g)",
    )
    parser.add_argument(
        "--max-deliveries",
        type=int_in(0),
        default=DEFAULT_MAX_DELIVERIES,
        metavar="N",
        help=f"attempts after which a leased group that comes back goes to its queue's "
        f"dead-letter queue, the name plus {DEAD_SUFFIX.decode()}; 0 for no limit "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help=f"the token clients must present (one trailing newline stripped); or set "
        f"{TOKEN_VARIABLE}. Never a command-line value: ps would show it",
    )
    durability = parser.add_argument_group(
        "durability", "Without --data-dir the server keeps packets in memory only."
    )
    durability.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="keep packets in a log in DIR (created if missing) and recover them at start",
    )
    durability.add_argument(
        "--fsync",
        choices=[policy.value for policy in FsyncPolicy],
        help="when the log is fsynced: 'always' before any reply that follows the logged "
        "frames (a sync's reply then means on disk); 'everysec' about once a second (a power "
        "failure may lose about the last second); 'no' only when a segment is full. A crash "
        "of the process loses nothing acknowledged under any of them (default: everysec)",
    )
    durability.add_argument(
        "--log-segment-size",
        type=byte_size,
        metavar="SIZE",
        help="size of each log segment file, its space reserved when it is created "
        f"(default: {DEFAULT_SEGMENT_SIZE // 1024**2}MiB; at least "
        f"{MIN_SEGMENT_SIZE // 1024}KiB)",
    )
    durability.add_argument(
        "--log-writes",
        choices=["mapped", "pwrite"],
        help="how blocks reach the log's files: 'mapped' copies them into a shared mapping of "
        "the segment where its space is reserved on disk, 'pwrite' writes each with a system "
        "call; either way a block is in the kernel's page cache before its replies go out "
        "(default: mapped, but pwrite under --fsync always, whose fsync of every batch makes "
        "the next write into the same page fault again)",
    )
    durability.add_argument(
        "--check-log",
        action="store_true",
        help="check the log in --data-dir and report what a start would recover, then exit "
        "(0: a start would succeed; 1: it would refuse); changes nothing",
    )
    durability.add_argument(
        "--truncate-damaged-log",
        action="store_true",
        help="if the log is damaged before its end, cut it at the damage (dropping the rest "
        "of that segment and every later one, as --check-log reports) and start, instead of "
        "refusing to start",
    )
    parser.add_argument(
        "--http-port",
        type=http_port,
        default=DEFAULT_HTTP_PORT,
        metavar="PORT",
        help="port of the admin listener (dashboard, /metrics, /stats, peek, purge, health "
        "checks); 0 for any free port, off for none (default: %(default)s)",
    )
    parser.add_argument(
        "--http-host",
        default="127.0.0.1",
        help="address of the admin listener, whatever --host is (default: %(default)s). "
        "Anything but loopback needs a token (--auth-token-file)",
    )
    parser.add_argument(
        "--metrics-max-queues",
        type=int_in(0),
        default=DEFAULT_MAX_QUEUES,
        metavar="N",
        help="most queues given their own series in /metrics and listed by /stats, the deepest "
        "first (default: %(default)s)",
    )
    parser.add_argument(
        "--no-protected-mode",
        dest="protected_mode",
        action="store_false",
        help="without a token, accept clients from other hosts too (by default a server with "
        "no token refuses every connection that does not come from loopback)",
    )
    tls = parser.add_argument_group(
        "TLS", "With --tls-cert and --tls-key every connection must speak TLS."
    )
    tls.add_argument("--tls-cert", metavar="FILE", help="the server's certificate chain (PEM)")
    tls.add_argument("--tls-key", metavar="FILE", help="the certificate's private key (PEM)")
    tls.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="CA certificates (PEM): clients must present a certificate signed by one of them",
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="least severe messages to log; debug adds each connection's end, its reason and "
        "the frames it sent (default: %(default)s)",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text lines, or one JSON object per line (default: %(default)s)",
    )
    # Says which build runs (issue 14): the hot modules compiled by mypyc, or plain Python.
    version = f"%(prog)s {__version__}, {build_name()}"
    parser.add_argument("--version", action="version", version=version)
    return parser


#: Exit status when a second signal cuts a graceful shutdown short.
FORCED_EXIT = 1


class AdminOptions(NamedTuple):
    port: int
    host: str
    max_queues: int


async def run_server(
    server: PinpriqServer, host: str, port: int, admin: AdminOptions | None = None
) -> int | str:
    """Serve until a signal. Returns the exit status, or why the server could not start or
    had to stop (its log failed)."""
    failure = ""
    try:
        return await _run_server(server, host, port, admin)
    except* LogFailure as failures:
        failure = str(failures.exceptions[0])
        while isinstance(failure, BaseExceptionGroup):  # pragma: no cover - nesting varies
            failure = str(failure.exceptions[0])
    return failure


async def _run_server(
    server: PinpriqServer, host: str, port: int, admin: AdminOptions | None
) -> int | str:
    log = logging.getLogger("pinpriq.server")
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            if admin is not None:  # first, so that /readyz answers 503 while starting
                try:
                    await nursery.start(
                        partial(
                            serve_admin,
                            server,
                            admin.port,
                            host=admin.host,
                            max_queues=admin.max_queues,
                            tls=server.tls,
                        )
                    )
                except OSError as error:
                    return (
                        f"cannot listen on {admin.host} port {admin.port} (--http-port): "
                        f"{error.strerror or error}"
                    )

            async def serve_then_stop(task_status: trio.TaskStatus[object]) -> None:
                await server.serve(port, host=host, task_status=task_status)
                nursery.cancel_scope.cancel()  # serving ended: stop watching for signals

            try:
                await nursery.start(serve_then_stop)
            except DataDirError as error:
                nursery.cancel_scope.cancel()  # the admin listener, if it started
                return str(error)
            except OSError as error:
                nursery.cancel_scope.cancel()  # the admin listener, if it started
                return f"cannot listen on {host} port {port}: {error.strerror or error}"
            # Which build serves (issue 14); after the listening line, which harnesses wait for.
            log.info("pinpriq %s, %s; store: %s", __version__, build_name(), _store_name(server))
            async for signum in signals:
                name = signal.Signals(signum).name
                if nursery.cancel_scope.cancel_called or server.stopping:
                    log.warning("received %s again; exiting now", name)
                    nursery.cancel_scope.cancel()
                    return FORCED_EXIT
                log.info("received %s; shutting down", name)
                server.shutdown()
    return 0


def store_spec(text: str) -> StoreSpec:
    """``--store``'s value, or the one-line reason it is not one."""
    try:
        return parse_store(text)
    except StoreError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--store ")) from None


async def run_on_store(
    spec: StoreSpec,
    make_server: Callable[..., PinpriqServer],
    host: str,
    port: int,
    admin: AdminOptions | None,
) -> int | str:
    """Open the store ``spec`` names, then serve on it until a signal (``run_server``).
    Returns the exit status, or why the server could not start."""
    if spec.scheme == "memory":
        return await run_server(make_server(), host, port, admin)
    # Imported here: the built-in store's start does not load the Redis client.
    from pinpriq.redis.connect import open_store as open_redis_store

    try:
        async with open_redis_store(spec) as (store, deliveries):
            server = make_server(store=store, deliveries=deliveries, max_memory=0)
            return await run_server(server, host, port, admin)
    except StoreError as error:
        return str(error)


def raise_open_file_limit(wanted: int) -> None:
    """Let the process hold ``wanted`` descriptors if the hard limit allows; soft limits are
    often 1024, below a server's connection limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def tune_garbage_collector() -> None:
    """Run the cyclic garbage collector rarely, not never.

    A queue server allocates a container per queued packet, and the collector's passes over
    millions of them cost more than the work itself (store pushes measured at 4.1 us with the
    default thresholds, 1.8 us with these). The store's structures hold no reference cycles, but
    each connection leaves ~17 objects in cycles (trio's tasks, scopes and exceptions) that only
    the collector frees: the older generations keep their default ratios, so a 10-minute soak
    with 10,000 connections still levels off (it did not with ratios of 50 and 100).
    """
    gc.freeze()  # what exists after start-up lives as long as the process
    gc.set_threshold(100_000, 10, 10)


def _only_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False  # the listener will fail to start and say why
    return bool(infos) and all(is_loopback(str(info[4][0])) for info in infos)


def check_log(path: Path) -> int:
    """``--check-log``: print what a start would recover from ``path``; the exit status."""
    try:
        data_dir = DataDir.open(path, write=False)
        result = scan(data_dir, now_ms=time.time_ns() // 10**6)
        try:
            data_dir.check_startable()
            refusal = None
        except DataDirError as error:
            refusal = str(error)
        lines, would_start = report(data_dir, result, refusal)
    except (DataDirError, OSError) as error:
        print(f"pinpriq-server: {error}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0 if would_start else 1


def open_store(args: argparse.Namespace) -> LogBacked | None:
    """The log-backed store ``--data-dir`` asks for, its directory checked and locked; exits
    with one line if it cannot be used."""
    if args.data_dir is None:
        return None
    try:
        data_dir = DataDir.open(args.data_dir, write=True)
    except DataDirError as error:
        sys.exit(f"pinpriq-server: {error}")
    journal = Journal(
        data_dir,
        policy=FsyncPolicy(args.fsync or FsyncPolicy.EVERYSEC.value),
        segment_size=args.log_segment_size or DEFAULT_SEGMENT_SIZE,
        mapped=None if args.log_writes is None else args.log_writes == "mapped",
    )
    return logged_store(trio.current_time, journal, truncate_damaged=args.truncate_damaged_log)


def _check_durability_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.data_dir is None:
        for option, value in (
            ("--fsync", args.fsync),
            ("--log-segment-size", args.log_segment_size),
            ("--log-writes", args.log_writes),
            ("--check-log", args.check_log),
            ("--truncate-damaged-log", args.truncate_damaged_log),
        ):
            if value:
                parser.error(f"{option} needs --data-dir")
    size = args.log_segment_size
    if size is not None and size < MIN_SEGMENT_SIZE:
        parser.error(f"argument --log-segment-size: {size} bytes is below {MIN_SEGMENT_SIZE}")


def _store_name(server: PinpriqServer) -> str:
    """Which store serves, in a few words: the build says what is installed, not what a
    ``--data-dir`` or ``--store`` server runs on."""
    store = server.broker.store
    describe = getattr(store, "describe", None)  # a store in another process says what it is
    if describe is not None:
        return str(describe()["kind"])
    where = "in memory" if server.journal is None else "logged (--data-dir)"
    return f"{type(store).__name__} {where}"


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pinpriq-server``."""
    parser = server_parser()
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_ca is not None and args.tls_cert is None:
        parser.error("--tls-ca needs --tls-cert and --tls-key")
    _check_durability_args(parser, args)
    if args.data_dir is not None and args.store.scheme != "memory":
        parser.error("--data-dir logs the built-in store; with --store redis, Redis persists")
    if args.check_log:
        sys.exit(check_log(args.data_dir))
    configure_logging(args.log_level, args.log_format)
    # A fatal signal says where it struck on stderr before the process dies: SIGBUS is what a
    # log page the disk cannot read back gives a write into a mapped segment (journal.py).
    faulthandler.enable()
    try:
        token = load_token(args.auth_token_file)
    except TokenError as error:
        sys.exit(f"pinpriq-server: {error}")
    tls = None
    if args.tls_cert is not None:
        try:
            tls = server_context(args.tls_cert, args.tls_key, args.tls_ca)
        except TlsError as error:
            sys.exit(f"pinpriq-server: {error}")
    admin = None
    if args.http_port is not None:
        if token is None and not _only_loopback(args.http_host):
            sys.exit(
                f"pinpriq-server: refusing an admin listener on {args.http_host} without a "
                "token: give one (--auth-token-file), use a loopback --http-host, or "
                "--http-port off"
            )
        admin = AdminOptions(args.http_port, args.http_host, args.metrics_max_queues)
    raise_open_file_limit(args.max_connections + 64)
    tune_garbage_collector()
    options: dict[str, Any] = {
        "max_memory": args.max_memory,
        "max_connections": args.max_connections,
        "frame_timeout": args.frame_timeout,
        "token": token,
        "protected_mode": args.protected_mode,
        "tls": tls,
        "max_client_memory": args.max_client_memory,
        "lease_default_ms": max(1, round(args.lease_default * 1000)),
        "max_deliveries": args.max_deliveries,
    }
    logged = open_store(args)  # None without --data-dir

    def make_server(**store: Any) -> PinpriqServer:
        return PinpriqServer(**{"store": logged, **options, **store})

    try:
        outcome = trio.run(run_on_store, args.store, make_server, args.host, args.port, admin)
    except KeyboardInterrupt:
        outcome = 0  # Ctrl-C before the signal handler was installed
    if isinstance(outcome, str):
        sys.exit(f"pinpriq-server: {outcome}")
    sys.exit(outcome)


if __name__ == "__main__":
    main()
