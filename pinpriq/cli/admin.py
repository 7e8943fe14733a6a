"""``pinpriq stats``, ``queues``, ``peek``, ``purge``, ``move`` and ``health``: the admin
listener from the shell.

They speak HTTP to the server's admin listener (``--admin URL``, else ``PINPRIQ_ADMIN_URL``,
else http://127.0.0.1:7001; https:// for a server with TLS, trusting ``--tls-ca``), with the
standard library's ``urllib``: a handful of small JSON requests needs no other client. The
token, if the server has one, comes from ``PINPRIQ_URL`` (``pinpriq://:TOKEN@HOST``, as for the
data port's commands), else ``PINPRIQ_AUTH_TOKEN`` (never from the command line, which ``ps``
shows) and goes as ``Authorization: Bearer``. A purge or a move carries ``X-Pinpriq-Action``,
which the listener requires of every change. Output is aligned tables for people, JSON with
``--json``; errors are one line and exit 1.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, TextIO
from urllib.parse import quote_from_bytes, urlsplit

from pinpriq._client_core import DEFAULT_TIMEOUT
from pinpriq.admin.app import ACTION_HEADER, DEFAULT_PEEK, MAX_MOVE, MAX_PEEK
from pinpriq.auth import TOKEN_VARIABLE
from pinpriq.cli.args import int_in
from pinpriq.display import escape, unescape
from pinpriq.tls import describe_tls_error

__all__ = ["ADMIN_COMMANDS", "ADMIN_URL_VARIABLE", "AdminError", "add_admin_commands", "run_admin"]

ADMIN_URL_VARIABLE = "PINPRIQ_ADMIN_URL"
DEFAULT_ADMIN_URL = "http://127.0.0.1:7001"
ADMIN_COMMANDS = frozenset({"stats", "queues", "peek", "purge", "move", "health"})


class AdminError(Exception):
    """The admin listener could not be asked, or said no: the message says which, in a line."""


def admin_url(text: str) -> str:
    """An argparse type: the admin listener's base URL, http(s)://HOST[:PORT][/PREFIX]."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise argparse.ArgumentTypeError(f"must look like http://HOST:PORT, not {text!r}")
    return text.rstrip("/")


def add_admin_commands(
    parser: argparse.ArgumentParser, commands: Any, common: argparse.ArgumentParser
) -> None:
    """Add the admin commands to the ``pinpriq`` parser: its subcommands (``commands``, what
    ``add_subparsers`` returned) and ``--admin``, accepted before the command and after it as
    the ``common`` options are."""
    options = argparse.ArgumentParser(add_help=False)
    for holder in (parser, options):
        holder.add_argument_group("admin listener (stats, queues, peek, purge, move)").add_argument(
            "--admin",
            type=admin_url,
            default=argparse.SUPPRESS,
            metavar="URL",
            help=f"the server's admin listener (default: {ADMIN_URL_VARIABLE}, else "
            f"{DEFAULT_ADMIN_URL}); a token is read from PINPRIQ_URL, else {TOKEN_VARIABLE}",
        )
    parents = [common, options]
    # A name as the tables show it (escape()), for the names that are not plain text.
    escaped = argparse.ArgumentParser(add_help=False)
    escaped.add_argument(
        "--escaped",
        action="store_true",
        help="QUEUE (and OTHER) is written as `queues` shows names: \\\\, \\t, \\n, \\r "
        "and \\xNN stand for bytes",
    )
    stats = commands.add_parser(
        "stats",
        parents=[*parents, escaped],
        help="the server's figures and its queues', or one queue's",
    )
    stats.add_argument("queue", nargs="?", metavar="QUEUE")
    commands.add_parser("queues", parents=parents, help="the queues, deepest first")
    peek = commands.add_parser(
        "peek",
        parents=[*parents, escaped],
        help="show the next packets pops would return; removes nothing",
    )
    peek.add_argument("queue", metavar="QUEUE")
    peek.add_argument(
        "-n",
        type=int_in(1, MAX_PEEK),
        default=DEFAULT_PEEK,
        metavar="N",
        help="how many packets (default: %(default)s)",
    )
    purge = commands.add_parser(
        "purge", parents=[*parents, escaped], help="remove every packet of a queue, prio 0 included"
    )
    purge.add_argument("queue", metavar="QUEUE")
    move = commands.add_parser(
        "move",
        parents=[*parents, escaped],
        help="move a queue's packets to another queue, as pushes made now (leased and delayed "
        "ones stay): how dead letters go back, `pinpriq move jobs.dead jobs`",
    )
    move.add_argument("queue", metavar="QUEUE")
    move.add_argument("to", metavar="OTHER", help="the queue to move them to")
    move.add_argument(
        "-n",
        type=int_in(1, MAX_MOVE),
        default=None,
        metavar="N",
        help="move whole key groups, in the order pops would take them, while fewer than N "
        "packets have moved (default: every packet, prio 0 included)",
    )
    health = commands.add_parser(
        "health",
        parents=parents,
        help="exit 0 if the server is serving (/healthz), 1 otherwise: for health checks",
    )
    health.add_argument(
        "--ready",
        action="store_true",
        help="ask whether it is ready for clients instead (/readyz: not while starting or "
        "shutting down)",
    )


def run_admin(
    args: argparse.Namespace,
    out: TextIO,
    tls: ssl.SSLContext | None = None,
    token: bytes | None = None,
) -> None:
    """Carry out an admin command; raises ``AdminError`` if it cannot. ``tls`` is the context
    for an https:// admin listener (default: the system's CAs); ``token`` the server's (default:
    ``PINPRIQ_AUTH_TOKEN``'s)."""
    base = getattr(args, "admin", None) or os.environ.get(ADMIN_URL_VARIABLE) or DEFAULT_ADMIN_URL
    if "admin" not in args:
        try:
            base = admin_url(base)
        except argparse.ArgumentTypeError as error:
            raise AdminError(f"{ADMIN_URL_VARIABLE}: {error}") from None
    if token is None and (variable := os.environ.get(TOKEN_VARIABLE)):
        token = os.fsencode(variable)
    client = _Client(base, getattr(args, "timeout", DEFAULT_TIMEOUT), tls, token)
    as_json = getattr(args, "json", False)
    given = getattr(args, "queue", None)
    queue = None if given is None else quote_from_bytes(_name(args, given), safe="")
    if args.command == "stats" and queue is not None:
        _print_queue(client.get(f"/queues/{queue}"), as_json, out)
    elif args.command == "stats":
        _print_server(client.get("/stats"), as_json, out)
    elif args.command == "queues":
        _print_queues(client.get("/stats")["queues"], as_json, out)
    elif args.command == "peek":
        _print_peek(client.get(f"/queues/{queue}/peek?n={args.n}"), as_json, out)
    elif args.command == "move":
        target = quote_from_bytes(_name(args, args.to), safe="")
        limit = "" if args.n is None else f"&n={args.n}"
        moved = client.request("POST", f"/queues/{queue}/move?to={target}{limit}")
        if as_json:
            out.write(json.dumps(moved, ensure_ascii=False) + "\n")
        else:
            out.write(f"moved {moved['moved']:,} packets from {moved['queue']} to {moved['to']}\n")
    elif args.command == "health":
        path = "/readyz" if args.ready else "/healthz"
        answer = client.get(path)  # anything but 200 raises: the exit status says it
        out.write(json.dumps(answer) + "\n" if as_json else f"ok: {base}{path}\n")
    else:
        purged = client.request("POST", f"/queues/{queue}/purge")
        if as_json:
            out.write(json.dumps(purged, ensure_ascii=False) + "\n")
        else:
            out.write(f"purged {purged['purged']:,} packets from {purged['queue']}\n")


def _name(args: argparse.Namespace, given: str) -> bytes:
    """A queue name's bytes: as the shell passed them, or read back from the escaped form."""
    return unescape(given) if args.escaped else os.fsencode(given)


class _Client:
    def __init__(
        self, base: str, timeout: float, tls: ssl.SSLContext | None, token: bytes | None
    ) -> None:
        self.base = base
        self.timeout = timeout
        self.tls = tls
        # latin-1: http.client sends header values as bytes in it, so any token goes as it is.
        self.headers = {"Authorization": f"Bearer {token.decode('latin-1')}"} if token else {}

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def request(self, method: str, path: str) -> Any:
        headers = dict(self.headers)
        if method != "GET":  # the listener refuses a change without it (no cross-site forms)
            headers[ACTION_HEADER] = "1"
        request = urllib.request.Request(self.base + path, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.tls) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as error:
            message = f"the admin listener at {self.base} said {error.code}: {_reason(error)}"
            raise AdminError(message) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            if isinstance(reason, ssl.SSLError):
                raise AdminError(self._tls_failed(reason)) from None
            raise AdminError(
                f"cannot reach the admin listener at {self.base} ({reason}); is the server "
                f"running with its admin listener on (--http-port)? Set --admin or "
                f"{ADMIN_URL_VARIABLE} to its URL"
            ) from None
        except ValueError:
            raise AdminError(f"{self.base} answered something that is not JSON") from None

    def _tls_failed(self, error: ssl.SSLError) -> str:
        message = f"cannot reach the admin listener at {self.base}: TLS handshake failed: "
        message += describe_tls_error(error)
        if isinstance(error, ssl.SSLCertVerificationError):
            message += "; if the server's certificate comes from a private CA, trust it with "
            message += "--tls-ca FILE"
        return message


def _reason(error: urllib.error.HTTPError) -> str:
    try:
        reason = str(json.loads(error.read())["error"])
    except (ValueError, KeyError, TypeError, OSError):
        reason = error.reason or "no reason given"
    if error.code == 401:
        reason += f" (set {TOKEN_VARIABLE} to the server's token)"
    return reason


def _table(rows: Sequence[Sequence[str]], numbers: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell: numbers (those columns) right-aligned, the rest
    left-aligned. The first row is usually a header."""
    widths = [max(len(cell) for cell in column) for column in zip(*rows, strict=True)]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(width) if index in numbers else cell.ljust(width)
            for index, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def _count(count: int | None) -> str:
    """A count the server may not know (``None``, or absent from an older server's JSON)."""
    return "-" if count is None else f"{count:,}"


def _duration(ms: int | None) -> str:
    if ms is None:
        return "-"
    seconds = ms / 1000
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def _size(count: int | None) -> str:
    if count is None:
        return "no cap"
    if count < 1024:
        return f"{count} B"
    value = count / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _priorities(by_priority: dict[str, int]) -> str:
    return ", ".join(f"{prio}: {count:,}" for prio, count in by_priority.items()) or "-"


def _print_queues(queues: list[dict[str, Any]], as_json: bool, out: TextIO) -> None:
    if as_json:
        out.writelines(json.dumps(queue, ensure_ascii=False) + "\n" for queue in queues)
        return
    header = (
        "QUEUE",
        "PACKETS",
        "LEASED",
        "DELAYED",
        "BYTES",
        "SUBSCRIBERS",
        "OLDEST",
        "NEXT EXPIRY",
        "BY PRIORITY",
    )
    rows = [
        (
            q["name"],
            f"{q['packets']:,}",
            _count(q.get("leased")),
            _count(q.get("delayed")),
            f"{q['bytes']:,}",
            f"{q['subscribers']:,}",
            _duration(q["oldest_age_ms"]),
            _duration(q["next_expiry_ms"]),
            _priorities(q["by_priority"]),
        )
        for q in queues
    ]
    if rows:
        out.write(_table([header, *rows], numbers=(1, 2, 3, 4, 5, 6, 7)))
    else:
        out.write("no queue holds packets or has subscribers\n")


def _print_queue(queue: dict[str, Any], as_json: bool, out: TextIO) -> None:
    if as_json:
        out.write(json.dumps(queue, ensure_ascii=False) + "\n")
        return
    rows = [
        ("queue", queue["name"]),
        ("packets", f"{queue['packets']:,}"),
        ("leased", _count(queue.get("leased"))),
        ("delayed", _count(queue.get("delayed"))),
        ("bytes", f"{queue['bytes']:,}"),
        ("by priority", _priorities(queue["by_priority"])),
        ("subscribers", f"{queue['subscribers']:,}"),
        ("oldest packet", _duration(queue["oldest_age_ms"])),
        ("next expiry", _duration(queue["next_expiry_ms"])),
    ]
    out.write(_table(rows))


def _print_server(stats: dict[str, Any], as_json: bool, out: TextIO) -> None:
    if as_json:
        out.write(json.dumps(stats, ensure_ascii=False) + "\n")
        return
    memory, rates, totals = stats["memory"], stats["rates_per_s"], stats["totals"]
    held = f"{_size(memory['held_bytes'])} of {_size(memory['cap_bytes'])}"
    if memory.get("delayed_bytes"):
        held += f" ({_size(memory['delayed_bytes'])} delayed)"
    if memory["full"]:
        held += ": FULL, pushes wait"
    rows = [
        (
            "server",
            f"pinpriq {stats['version']}, up {_duration(round(stats['uptime_s'] * 1000))}"
            + ("" if stats["ready"] else ", NOT READY"),
        ),
        ("connections", f"{stats['connections']:,}"),
        ("subscribers", f"{stats['subscribers']:,}"),
        ("packets", f"{stats['packets']:,} in {stats['queues_total']:,} queues"),
        ("memory", held),
        (
            "per second",
            "  ".join(f"{name} {rate:,.1f}" for name, rate in rates.items()) + " (last 10 s)",
        ),
        ("in all", "  ".join(f"{name} {count:,}" for name, count in totals.items())),
        ("leases", "  ".join(f"{name} {count:,}" for name, count in stats["leases"].items())),
    ]
    out.write(_table(rows) + "\n")
    _print_queues(stats["queues"], False, out)


def _print_peek(peeked: dict[str, Any], as_json: bool, out: TextIO) -> None:
    packets = peeked["packets"]
    if as_json:
        out.writelines(json.dumps(packet, ensure_ascii=False) + "\n" for packet in packets)
        return
    rows = [(str(p["prio"]), _text(p["key"]), _text(p["payload"])) for p in packets]
    if rows:
        out.write(_table([("PRIO", "KEY", "PAYLOAD"), *rows], numbers=(0,)))


def _text(value: str | dict[str, str]) -> str:
    """A key or payload from the JSON (text, or base64 when not UTF-8) shown as ``escape`` does."""
    if isinstance(value, dict):
        return escape(base64.b64decode(value["base64"]))
    return escape(value.encode())
