"""``pinpriq``: push, pop, subscribe, ping and work from the shell.

A thin shell over ``BlockingPinpriqClient``: it parses, calls the library, and prints; it knows
no byte layout. Argument errors and connection errors print one line and exit non-zero; no
traceback reaches the user.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import NamedTuple, TextIO
from urllib.parse import unquote_to_bytes, urlsplit

from pinpriq import __version__
from pinpriq._client_core import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_TIMEOUT,
    DEFAULT_WORK_LEASE_MS,
    MAX_PREFETCH,
)
from pinpriq.auth import TOKEN_VARIABLE
from pinpriq.blocking import BlockingLease, BlockingPinpriqClient
from pinpriq.cli.admin import ADMIN_COMMANDS, AdminError, add_admin_commands, run_admin
from pinpriq.cli.args import OneLineParser, client_port, duration_ms, int_in, seconds
from pinpriq.display import escape, json_value
from pinpriq.errors import ArgumentError, ArgumentTypeError, PinpriqError, PinpriqTimeoutError
from pinpriq.wire import MAX_DELAY_MS, MAX_LEASE_MS, MAX_PRIO, MAX_TTL_MS, Packet

__all__ = ["client_parser", "main"]

URL_VARIABLE = "PINPRIQ_URL"
#: Exit status after Ctrl-C, as shells report a process ended by SIGINT.
INTERRUPTED = 130
#: Exit status of a worker stopped by SIGTERM, as shells report a process it ended.
TERMINATED = 128 + signal.SIGTERM
#: Seconds a worker's command has to exit after SIGTERM before its process group is killed.
END_GRACE_SECONDS = 5.0

CLIENT_EPILOG = f"""\
The server is --host and --port if given, else the {URL_VARIABLE} environment variable
(pinpriq://HOST:PORT, the port defaulting to {DEFAULT_PORT}), else {DEFAULT_HOST}:{DEFAULT_PORT}.
The token is the one in {URL_VARIABLE} (pinpriq://:TOKEN@HOST:PORT), else {TOKEN_VARIABLE}.
pinpriqs://HOST:PORT, --tls or --tls-ca speak TLS.

`push` waits until the server confirms it has the packet (a protocol 1.1 sync), so exit status
0 means the packet is queued (with --delay: held, and queued when due; a delay, or a --ttl above
65535 ms, needs a protocol 1.2 server). Output is one line per packet, KEY<tab>PAYLOAD, with
backslash escapes for bytes that are not printable text. With --json, each line is a JSON object
{{"key": ..., "payload": ...}} whose values are strings when the bytes are UTF-8, else
{{"base64": "..."}}. Popping an empty queue prints nothing and exits 0. Exit status: 0 done,
1 server unreachable, connection lost, or no answer within --timeout, 2 bad arguments,
{INTERRUPTED} interrupted (Ctrl-C).

`work QUEUE -- COMMAND [ARG...]` takes jobs on a lease, one at a time, and runs COMMAND for
each with the job's payload on stdin (the payloads of every packet of its key group, one after
the other, with nothing between them: PINPRIQ_PAYLOAD_SIZES lists their sizes in bytes, comma-
separated, to split them by; with --json, one JSON object per packet per line) and
PINPRIQ_QUEUE, PINPRIQ_KEY, PINPRIQ_ATTEMPT and PINPRIQ_PACKETS in its environment. Exit
status 0 acks the job; anything else releases it, to be tried again (after the server's
--max-deliveries attempts it goes to QUEUE.dead). The lease is touched while COMMAND runs; a
job whose worker dies comes back. COMMAND runs in a process group of its own: Ctrl-C or
SIGTERM stops the worker after ending that group (SIGTERM, then SIGKILL after
{END_GRACE_SECONDS:g} s), and the job goes back (exit status {INTERRUPTED} or {TERMINATED}).

`stats`, `queues`, `peek`, `purge` and `health` ask the server's admin listener over HTTP
instead: --admin URL, else the PINPRIQ_ADMIN_URL environment variable, else
http://127.0.0.1:7001 (https:// for a server with TLS, trusting --tls-ca), with the token of
PINPRIQ_URL, else PINPRIQ_AUTH_TOKEN, if the server has one. Queue names are shown as keys and
payloads are; `stats`, `peek` and `purge` take a name in that form back with --escaped.
--json prints the admin listener's JSON. `health` exits 0 when the server is serving (with
--ready: ready for clients) and 1 otherwise, for container health checks."""


class ServerUrl(NamedTuple):
    host: str
    port: int
    token: bytes | None  # pinpriq://:TOKEN@HOST
    tls: bool  # pinpriqs://


def parse_url(text: str) -> ServerUrl:
    """``pinpriq://HOST:PORT`` (port optional; IPv6 hosts in brackets), with ``:TOKEN@``
    before the host to give a token (percent-encoded: ``%XX`` is the byte XX, so a token may be
    any bytes), or ``pinpriqs://`` for TLS."""
    usage = f"{URL_VARIABLE} must look like pinpriq://HOST:PORT or pinpriqs://:TOKEN@HOST:PORT"
    parts = urlsplit(text)
    extra = parts.path.strip("/") or parts.query or parts.fragment
    if parts.scheme not in ("pinpriq", "pinpriqs") or not parts.hostname or extra:
        raise ValueError(usage)  # never the URL itself: it may hold a token
    if parts.username:
        raise ValueError(
            f"{URL_VARIABLE}: pinpriq has no user names: write the token after a ':', as in "
            "pinpriq://:TOKEN@HOST:PORT"
        )
    token = None
    if parts.password is not None:
        token = unquote_to_bytes(parts.password)
        if not token:
            raise ValueError(f"{URL_VARIABLE}: the token after ':' is empty")
    tls = parts.scheme == "pinpriqs"
    location = parts.netloc.rpartition("@")[2]
    port = location.rpartition("]")[2].rpartition(":")[2] if ":" in location else ""
    if not port:
        return ServerUrl(parts.hostname, DEFAULT_PORT, token, tls)
    if not port.isdigit():
        raise ValueError(usage)
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"{URL_VARIABLE}: port {port} is out of range (1..65535)")
    return ServerUrl(parts.hostname, int(port), token, tls)


def client_parser() -> argparse.ArgumentParser:
    # The connection options are accepted before and after the command (pinpriq --json pop q,
    # pinpriq pop q --json); SUPPRESS keeps a subcommand from resetting what the main parser got.
    common = OneLineParser(add_help=False)
    connection = common.add_argument_group("connection and output")
    connection.add_argument("--host", default=argparse.SUPPRESS, help="server host name or address")
    connection.add_argument(
        "--port", type=client_port, default=argparse.SUPPRESS, help="server TCP port"
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
    connection.add_argument(
        "--tls",
        action="store_true",
        default=argparse.SUPPRESS,
        help="speak TLS, trusting the system's CAs (as pinpriqs:// does)",
    )
    connection.add_argument(
        "--tls-ca",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="speak TLS, trusting the CA certificates in FILE (PEM)",
    )
    connection.add_argument(
        "--tls-cert",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="speak TLS, presenting this client certificate (PEM; with --tls-key)",
    )
    connection.add_argument(
        "--tls-key", metavar="FILE", default=argparse.SUPPRESS, help="the client certificate's key"
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

    push = commands.add_parser(
        "push", parents=[common], help="queue a packet, and wait until the server has it"
    )
    push.add_argument("queue", metavar="QUEUE")
    push.add_argument("key", metavar="KEY")
    push.add_argument("payload", metavar="PAYLOAD")
    push.add_argument(
        "--ttl",
        type=duration_ms(MAX_TTL_MS, "about 49.7 days"),
        default=0,
        metavar="TIME",
        help="time to live, from when the packet enters its queue: 500ms, 10s, 5m, 2h, 7d, or "
        "a bare number of milliseconds; 0, the default, never expires. Above 65535 ms the push "
        "needs a protocol 1.2 server",
    )
    push.add_argument(
        "--delay",
        type=duration_ms(MAX_DELAY_MS, "30 days"),
        default=0,
        metavar="TIME",
        help="keep the packet out of its queue this long (at most 30d; units as --ttl); 0, the "
        "default, queues it at once. Needs a protocol 1.2 server",
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

    commands.add_parser(
        "ping",
        parents=[common],
        help="check that the server answers (a sync): prints the round trip, exits 0 if it does",
    )

    work = commands.add_parser(
        "work",
        parents=[common],
        help="run a command for each job of a queue, taken on a lease: ack if it exits 0",
        usage="pinpriq work [options] QUEUE -- COMMAND [ARG ...]",
    )
    work.add_argument("queue", metavar="QUEUE")
    work.add_argument("program", nargs="*", metavar="-- COMMAND [ARG ...]")
    work.add_argument(
        "--count", type=int_in(1), metavar="N", help="exit after N jobs (default: run until Ctrl-C)"
    )
    work.add_argument(
        "--lease",
        type=duration_ms(MAX_LEASE_MS, "24 hours", least=1),
        default=DEFAULT_WORK_LEASE_MS,
        metavar="TIME",
        help="lease time, renewed at half of it while COMMAND runs (units as --ttl: 30s, 5m, "
        "or milliseconds; at most 24h; default: %(default)s ms)",
    )
    work.add_argument(
        "--retry-delay",
        type=duration_ms(MAX_LEASE_MS, "24 hours"),
        default=0,
        metavar="TIME",
        help="how long a failed job waits before it comes back (units as --ttl; at most 24h; "
        "default: 0)",
    )
    add_admin_commands(parser, commands, common)
    return parser


def server_url(args: argparse.Namespace) -> ServerUrl:
    """--host and --port, falling back to PINPRIQ_URL, then to the defaults; the token from
    PINPRIQ_URL, else PINPRIQ_AUTH_TOKEN (``BlockingPinpriqClient`` reads it when the token is
    ``None``); TLS from pinpriqs:// or any --tls option."""
    url = ServerUrl(DEFAULT_HOST, DEFAULT_PORT, None, False)
    text = os.environ.get(URL_VARIABLE)
    if text:
        url = parse_url(text)
    tls = url.tls or any(hasattr(args, name) for name in ("tls", "tls_ca", "tls_cert"))
    return ServerUrl(
        getattr(args, "host", url.host), getattr(args, "port", url.port), url.token, tls
    )


def tls_context(args: argparse.Namespace) -> ssl.SSLContext:
    """The client's TLS context from --tls-ca, --tls-cert and --tls-key (``ValueError`` with
    one line if a file cannot be used)."""
    ca, cert, key = (getattr(args, name, None) for name in ("tls_ca", "tls_cert", "tls_key"))
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    try:
        context = ssl.create_default_context(cafile=ca)
        if cert is not None:
            context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as error:
        raise ValueError(f"cannot use the TLS files: {error.strerror or error}") from None
    return context


def packet_json(packet: Packet) -> dict[str, str | dict[str, str]]:
    return {"key": json_value(packet.key), "payload": json_value(packet.payload)}


def print_packets(packets: Iterable[Packet], as_json: bool, out: TextIO) -> None:
    for packet in packets:
        if as_json:
            line = json.dumps(packet_json(packet))
        else:
            line = f"{escape(packet.key)}\t{escape(packet.payload)}"
        out.write(line + "\n")
    out.flush()  # a subscriber's reader sees each delivery as it comes


def run_client(
    args: argparse.Namespace, url: ServerUrl, tls: ssl.SSLContext | None, out: TextIO
) -> None:
    timeout = getattr(args, "timeout", DEFAULT_TIMEOUT)
    as_json = getattr(args, "json", False)
    with BlockingPinpriqClient.connect(
        url.host, url.port, timeout=timeout, token=url.token, tls=tls or False
    ) as client:
        if args.command == "push":
            queue, key, payload = (os.fsencode(arg) for arg in (args.queue, args.key, args.payload))
            try:
                client.push(
                    queue,
                    key,
                    payload,
                    ttl_ms=args.ttl,
                    prio=args.prio,
                    delay_ms=args.delay,
                    confirm=True,
                )
            except PinpriqTimeoutError as error:
                raise PinpriqTimeoutError(f"{error}: {why_unconfirmed(url, tls)}") from None
        elif args.command == "pop":
            print_packets(client.pop(os.fsencode(args.queue)), as_json, out)
        elif args.command == "work":
            run_worker(client, args, as_json)
        elif args.command == "ping":
            started = time.perf_counter()
            try:
                client.sync()
            except PinpriqTimeoutError as error:
                raise PinpriqTimeoutError(f"{error}: {NOT_PINPRIQ}") from None
            elapsed_ms = (time.perf_counter() - started) * 1000
            out.write(f"pong from {client.address} in {elapsed_ms:.1f} ms\n")
        else:
            queues = [os.fsencode(queue) for queue in args.queues]
            subscription = client.subscribe(queues, prefetch=args.prefetch, limit=args.count)
            client.close()  # the subscription has a connection of its own
            with subscription as deliveries:
                for packets in deliveries:
                    print_packets(packets, as_json, out)


#: Why a server that takes connections would not answer a sync, which every 1.1 server answers.
NOT_PINPRIQ = "it may not be a pinpriq server (it took the connection and answered nothing)"
#: Seconds a second connection waits for its ping when a push was not confirmed.
PROBE_SECONDS = 1.0


def why_unconfirmed(url: ServerUrl, tls: ssl.SSLContext | None) -> str:
    """Why a push was not confirmed in time, judged by a ping on a connection of its own: a
    server at its memory cap holds the push (and the sync after it) but answers a lone sync."""
    try:
        with BlockingPinpriqClient.connect(
            url.host, url.port, timeout=PROBE_SECONDS, token=url.token, tls=tls or False
        ) as probe:
            probe.sync()
    except PinpriqError:
        return NOT_PINPRIQ
    return (
        "the server answers a ping, so it holds the push: it is most likely at its memory cap "
        "(--max-memory), where pushes wait until pops or expiry free room"
    )


class JobFailed(Exception):
    """COMMAND exited with a status other than 0: the job is released."""


def _without_traceback(record: logging.LogRecord) -> bool:
    """A failed COMMAND is one line on stderr, not a traceback."""
    record.exc_info = record.exc_text = None
    return True


class Terminated(BaseException):
    """SIGTERM: the worker stops as on Ctrl-C, ending its command first."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


def run_in_own_group(command: list[str], stdin: bytes, environment: dict[str, str]) -> int:
    """Run ``command`` with ``stdin``; its exit status (negative: the signal that killed it).

    It runs in a process group of its own, so that a worker stopped by Ctrl-C or SIGTERM can
    end it and whatever it started: left running, it would do the job while the job, given
    back, runs again elsewhere."""
    process = subprocess.Popen(command, stdin=subprocess.PIPE, env=environment, process_group=0)
    try:
        process.communicate(stdin)
    except BaseException:
        _end_group(process)
        raise
    return process.returncode


def _end_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the command's process group; SIGKILL to what is left of it once the command
    has exited, or after ``END_GRACE_SECONDS``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(END_GRACE_SECONDS)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_worker(client: BlockingPinpriqClient, args: argparse.Namespace, as_json: bool) -> None:
    """``pinpriq work``: COMMAND for each job, on a lease kept alive while it runs."""
    command = args.program
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("pinpriq: %(message)s"))
    handler.addFilter(_without_traceback)
    log = logging.getLogger("pinpriq.client")
    log.addHandler(handler)
    log.propagate = False

    def run(job: BlockingLease) -> None:
        if as_json:
            lines = (json.dumps(packet_json(packet)) + "\n" for packet in job.packets)
            stdin = "".join(lines).encode()
        else:
            stdin = b"".join(packet.payload for packet in job.packets)
        environment = os.environ | {
            "PINPRIQ_QUEUE": args.queue,
            "PINPRIQ_KEY": os.fsdecode(job.packets[0].key),
            "PINPRIQ_ATTEMPT": str(job.attempt),
            "PINPRIQ_PACKETS": str(len(job.packets)),
            # Where one payload ends and the next begins on stdin: any bytes may be in them.
            "PINPRIQ_PAYLOAD_SIZES": ",".join(str(len(p.payload)) for p in job.packets),
        }
        status = run_in_own_group(command, stdin, environment)
        if status < 0:
            raise JobFailed(f"{shlex.quote(command[0])} was killed by {signal.strsignal(-status)}")
        if status:
            raise JobFailed(f"{shlex.quote(command[0])} exited with status {status}")

    client.work(
        os.fsencode(args.queue),
        run,
        lease_ms=args.lease,
        limit=args.count,
        retry_delay_ms=args.retry_delay,
    )


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The arguments; for ``work``, everything after the first ``--`` is COMMAND and its
    arguments, whatever options come before (argparse alone cannot take options after QUEUE
    and a command line after them)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    if "work" in argv[:cut]:
        args = parser.parse_args(argv[:cut])
        if args.command == "work":
            args.program += argv[cut + 1 :]
            return args
    return parser.parse_args(argv)


def check_work_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``-- COMMAND`` is there and can be run: a worker that cannot start its command would
    only burn its jobs' attempts."""
    if not args.program:
        parser.error("work needs a command to run: pinpriq work QUEUE -- COMMAND [ARG ...]")
    if shutil.which(args.program[0]) is None:
        parser.error(f"work: cannot run {args.program[0]!r}: not found, or not executable")


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pinpriq``."""
    parser = client_parser()
    try:
        args = parse(parser, sys.argv[1:] if argv is None else argv)
        try:
            url = server_url(args)
            tls = tls_context(args) if url.tls else None
        except ValueError as error:
            parser.error(str(error))
        if args.command in ADMIN_COMMANDS:  # HTTP to the admin listener, not the data port
            run_admin(args, sys.stdout, tls, url.token)
            return
        if args.command == "work":
            check_work_command(parser, args)
            signal.signal(signal.SIGTERM, _terminated)
        run_client(args, url, tls, sys.stdout)
    except (ArgumentError, ArgumentTypeError) as error:  # a field longer than the protocol allows
        parser.exit(2, f"pinpriq: error: {error}\n")
    except PinpriqError as error:  # unreachable, lost, timed out, not a pinpriq 1.1 server
        sys.exit(f"pinpriq: {error}")
    except AdminError as error:  # the admin listener unreachable, or it said no
        sys.exit(f"pinpriq: {error}")
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED)
    except Terminated:
        sys.exit(TERMINATED)
    except BrokenPipeError:
        # The reader went away (pinpriq subscribe q | head -1). Point stdout at /dev/null so
        # the interpreter's final flush does not complain a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main()
