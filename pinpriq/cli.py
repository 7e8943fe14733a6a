"""Command-line front ends: ``pinpriq-server`` and the ``pinpriq`` client.

Argument errors, startup failures and connection errors print one line and exit non-zero; no
traceback reaches the user. The client command is a thin shell over ``BlockingPinpriqClient``:
it parses, calls the library, and prints; it knows no byte layout.
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import logging
import math
import os
import resource
import signal
import sys
from collections.abc import Callable, Iterable
from typing import NoReturn, TextIO
from urllib.parse import urlsplit

import trio

from pinpriq import __version__
from pinpriq.blocking import BlockingPinpriqClient
from pinpriq.client import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_TIMEOUT,
    MAX_PREFETCH,
    PinpriqConnectionError,
)
from pinpriq.server import DEFAULT_MAX_CONNECTIONS, PinpriqServer
from pinpriq.store import PACKET_OVERHEAD
from pinpriq.wire import MAX_PRIO, MAX_TTL_MS, Packet

LOG_LEVELS = ("debug", "info", "warning", "error")


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``prog: error: message (see --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0..65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: not a number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {port}: must be 0..65535")
    return port


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "k": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tib": 1024**4,
}


def byte_size(text: str) -> int:
    """An argparse type: a size in bytes, such as ``512MiB``, ``2GB`` or ``65536``.

    KiB/MiB/GiB/TiB (and K/M/G/T) are powers of 1024; kB/MB/GB/TB powers of 1000; case does not
    matter; a fraction is allowed (``1.5GiB``).
    """
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number) :].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use e.g. 512MiB, 2GB or 65536")
    return int(value * _SIZE_UNITS[unit])


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``low..high`` (no upper bound if ``high`` is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
        if high is None and value < low:
            raise argparse.ArgumentTypeError(f"{value} is less than {low}")
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low}..{high}")
        return value

    return parse


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
        default=7000,
        help="TCP port to listen on, 0 for any free port (default: %(default)s)",
    )
    parser.add_argument(
        "--max-memory",
        type=byte_size,
        default="1GiB",
        metavar="SIZE",
        help="cap on the memory queued packets may hold (keys, payloads and about "
        f"{PACKET_OVERHEAD} bytes of bookkeeping each), e.g. 512MiB or 2GB; when reached, "
        "pushes wait until pops or expiry free room. 0 for no cap (default: 1GiB)",
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
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="least severe messages to log (default: %(default)s)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


#: Exit status when a second signal cuts a graceful shutdown short.
FORCED_EXIT = 1


async def run_server(server: PinpriqServer, host: str, port: int) -> int | str:
    """Serve until a signal. Returns the exit status, or why the server could not start."""
    log = logging.getLogger("pinpriq.server")
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def serve_then_stop(task_status: trio.TaskStatus[object]) -> None:
                await server.serve(port, host=host, task_status=task_status)
                nursery.cancel_scope.cancel()  # serving ended: stop watching for signals

            try:
                await nursery.start(serve_then_stop)
            except OSError as error:
                return f"cannot listen on {host} port {port}: {error.strerror or error}"
            async for signum in signals:
                name = signal.Signals(signum).name
                if nursery.cancel_scope.cancel_called or server.stopping:
                    log.warning("received %s again; exiting now", name)
                    nursery.cancel_scope.cancel()
                    return FORCED_EXIT
                log.info("received %s; shutting down", name)
                server.shutdown()
    return 0


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


def server_main(argv: list[str] | None = None) -> None:
    """Entry point of ``pinpriq-server``."""
    args = server_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    raise_open_file_limit(args.max_connections + 64)
    tune_garbage_collector()
    server = PinpriqServer(max_memory=args.max_memory, max_connections=args.max_connections)
    try:
        outcome = trio.run(run_server, server, args.host, args.port)
    except KeyboardInterrupt:
        outcome = 0  # Ctrl-C before the signal handler was installed
    if isinstance(outcome, str):
        sys.exit(f"pinpriq-server: {outcome}")
    sys.exit(outcome)


# -- the pinpriq client -----------------------------------------------------------------------

URL_VARIABLE = "PINPRIQ_URL"
#: Exit status after Ctrl-C, as shells report a process ended by SIGINT.
INTERRUPTED = 130

CLIENT_EPILOG = f"""\
The server is --host and --port if given, else the {URL_VARIABLE} environment variable
(pinpriq://HOST:PORT, the port defaulting to {DEFAULT_PORT}), else {DEFAULT_HOST}:{DEFAULT_PORT}.

Output is one line per packet, KEY<tab>PAYLOAD, with backslash escapes for bytes that are not
printable text. With --json, each line is a JSON object {{"key": ..., "payload": ...}} whose
values are strings when the bytes are UTF-8, else {{"base64": "..."}}. Popping an empty queue
prints nothing and exits 0. Exit status: 0 done, 1 server unreachable or connection lost,
2 bad arguments, {INTERRUPTED} interrupted (Ctrl-C)."""


def seconds(text: str) -> float:
    """An argparse type: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def parse_url(text: str) -> tuple[str, int]:
    """``pinpriq://host:port`` (port optional; IPv6 hosts in brackets) as ``(host, port)``."""
    usage = f"{URL_VARIABLE} must look like pinpriq://HOST:PORT, not {text!r}"
    parts = urlsplit(text)
    extra = parts.path.strip("/") or parts.query or parts.fragment or parts.username
    if parts.scheme != "pinpriq" or not parts.hostname or extra:
        raise ValueError(usage)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(usage) from None
    return parts.hostname, DEFAULT_PORT if port is None else port


def client_parser() -> argparse.ArgumentParser:
    # The connection options are accepted before and after the command (pinpriq --json pop q,
    # pinpriq pop q --json); SUPPRESS keeps a subcommand from resetting what the main parser got.
    common = OneLineParser(add_help=False)
    connection = common.add_argument_group("connection and output")
    connection.add_argument("--host", default=argparse.SUPPRESS, help="server host name or address")
    connection.add_argument(
        "--port", type=port_number, default=argparse.SUPPRESS, help="server TCP port"
    )
    connection.add_argument(
        "--timeout",
        type=seconds,
        default=argparse.SUPPRESS,
        help=f"seconds to wait for the server to connect or answer (default: {DEFAULT_TIMEOUT:g})",
    )
    connection.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="one JSON object per line"
    )
    parser = OneLineParser(
        prog="pinpriq",
        description="Push to, pop from and subscribe to the queues of a pinpriq server.",
        epilog=CLIENT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    push = commands.add_parser("push", parents=[common], help="queue a packet")
    push.add_argument("queue", metavar="QUEUE")
    push.add_argument("key", metavar="KEY")
    push.add_argument("payload", metavar="PAYLOAD")
    push.add_argument(
        "--ttl",
        type=int_in(0, MAX_TTL_MS),
        default=0,
        metavar="MS",
        help="milliseconds to live; 0, the default, never expires",
    )
    push.add_argument(
        "--prio",
        type=int_in(0, MAX_PRIO),
        default=1,
        metavar="N",
        help="priority, 1 (highest, the default) to 255; 0 only leaves with its key",
    )

    pop = commands.add_parser(
        "pop", parents=[common], help="take the best packet and the others with its key"
    )
    pop.add_argument("queue", metavar="QUEUE")

    subscribe = commands.add_parser(
        "subscribe", parents=[common], help="print packets as they arrive, until Ctrl-C"
    )
    subscribe.add_argument("queues", nargs="+", metavar="QUEUE")
    subscribe.add_argument(
        "--count",
        type=int_in(1),
        metavar="N",
        help="exit after N deliveries, taking no more than that from the server",
    )
    subscribe.add_argument(
        "--prefetch",
        type=int_in(1, MAX_PREFETCH),
        default=1,
        metavar="N",
        help="deliveries to have on their way at once (default: %(default)s)",
    )
    return parser


def server_address(args: argparse.Namespace) -> tuple[str, int]:
    """--host and --port, falling back to PINPRIQ_URL, then to the defaults."""
    host, port = DEFAULT_HOST, DEFAULT_PORT
    url = os.environ.get(URL_VARIABLE)
    if url:
        host, port = parse_url(url)
    return getattr(args, "host", host), getattr(args, "port", port)


def escape(data: bytes) -> str:
    """``data`` as one line of text: UTF-8 shown as text, anything else as backslash escapes."""
    out = []
    for char in data.decode("utf-8", "surrogateescape"):
        code = ord(char)
        if char == "\\":
            out.append("\\\\")
        elif 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8, smuggled by surrogateescape
            out.append(f"\\x{code - 0xDC00:02x}")
        elif char.isprintable():
            out.append(char)
        else:
            out.append(char.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def json_value(data: bytes) -> str | dict[str, str]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}


def print_packets(packets: Iterable[Packet], as_json: bool, out: TextIO) -> None:
    for packet in packets:
        if as_json:
            line = json.dumps(
                {"key": json_value(packet.key), "payload": json_value(packet.payload)}
            )
        else:
            line = f"{escape(packet.key)}\t{escape(packet.payload)}"
        out.write(line + "\n")
    out.flush()  # a subscriber's reader sees each delivery as it comes


def run_client(args: argparse.Namespace, host: str, port: int, out: TextIO) -> None:
    timeout = getattr(args, "timeout", DEFAULT_TIMEOUT)
    as_json = getattr(args, "json", False)
    with BlockingPinpriqClient.connect(host, port, timeout=timeout) as client:
        if args.command == "push":
            queue, key, payload = (os.fsencode(arg) for arg in (args.queue, args.key, args.payload))
            client.push(queue, key, payload, ttl_ms=args.ttl, prio=args.prio)
        elif args.command == "pop":
            print_packets(client.pop(os.fsencode(args.queue)), as_json, out)
        else:
            queues = [os.fsencode(queue) for queue in args.queues]
            subscription = client.subscribe(*queues, prefetch=args.prefetch, limit=args.count)
            client.close()  # the subscription has a connection of its own
            with subscription as deliveries:
                for packets in deliveries:
                    print_packets(packets, as_json, out)


def client_main(argv: list[str] | None = None) -> None:
    """Entry point of ``pinpriq``."""
    parser = client_parser()
    try:
        args = parser.parse_args(argv)
        try:
            host, port = server_address(args)
        except ValueError as error:
            parser.error(str(error))
        run_client(args, host, port, sys.stdout)
    except (PinpriqConnectionError, TimeoutError) as error:
        sys.exit(f"pinpriq: {error}")
    except ValueError as error:  # a field longer than the protocol allows
        parser.exit(2, f"pinpriq: error: {error}\n")
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED)
    except BrokenPipeError:
        # The reader went away (pinpriq subscribe q | head -1). Point stdout at /dev/null so
        # the interpreter's final flush does not complain a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    server_main()
