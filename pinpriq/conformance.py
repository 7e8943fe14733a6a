"""Replays the language-neutral wire fixtures against any pinpriq server.

Owns the fixture format (described for humans in wire-fixtures/README.md): its parser and a
player that opens connections, sends bytes and compares what comes back, byte for byte. It must
not know pinpriq's own codec or server: it never decodes a frame, so a fixture checks a server
written in any language exactly as it checks ours, and a bug in ``pinpriq.wire`` cannot hide
the same bug here.

    python -m pinpriq.conformance HOST:PORT [--fixtures DIR] [--timeout SECONDS]
        [--token TOKEN] [--tls] [--tls-ca FILE] [NAME ...]

A fixture may require a server with a token, or one without (a ``requires`` line); the runner
runs it only against such a server (``--token`` says the server has one) and reports it as not
run otherwise. With a token, the runner authenticates every connection of the other fixtures
first, so they run unchanged against a server that has one.

Exit status: 0 when every fixture passes, 1 when any fails, 2 when the suite cannot run (bad
arguments, an unreadable fixture, or no server at the address).
"""

from __future__ import annotations

import argparse
import enum
import os
import re
import ssl
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NoReturn

import attrs
import trio

__all__ = [
    "DEFAULT_FIXTURES",
    "Action",
    "Fixture",
    "FixtureError",
    "Requires",
    "Result",
    "Step",
    "Token",
    "load_fixtures",
    "main",
    "parse_address",
    "parse_bytes",
    "parse_fixture",
    "run_fixture",
    "run_suite",
]


def _default_fixtures() -> Path:
    """The fixtures installed with this module: ``pinpriq/fixtures/``, where a regular install
    (a wheel, ``pip install .``, the Docker image) puts wire-fixtures/ as package data; or, in a
    checkout or an editable install, which install no copy, the checkout's ``wire-fixtures/``."""
    package = Path(__file__).resolve().parent
    installed = package / "fixtures"
    return installed if installed.is_dir() else package.parent / "wire-fixtures"


#: Where ``pinpriq-conformance`` reads the fixtures unless given ``--fixtures``.
DEFAULT_FIXTURES = _default_fixtures()
#: Seconds an ``expect``, ``expect-closed`` or ``send`` step (or opening a connection) may take.
DEFAULT_TIMEOUT = 2.0
#: Pause between the writes of ``send-bytewise``, so each byte normally reaches the server in
#: a read of its own (TCP may still merge them, which only weakens the step, never fails it).
BYTEWISE_PAUSE = 0.002
RECEIVE_SIZE = 1 << 16
#: Bytes shown of what was expected and what came, from a little before the first difference.
EXCERPT = 12


class FixtureError(ValueError):
    """A fixture file that does not follow the format; names the file and line."""


class Action(enum.Enum):
    SEND = "send"
    SEND_BYTEWISE = "send-bytewise"
    EXPECT = "expect"
    EXPECT_NOTHING = "expect-nothing"
    EXPECT_CLOSED = "expect-closed"
    CLOSE = "close"
    WAIT = "wait"


_BYTE_ACTIONS = {Action.SEND, Action.SEND_BYTEWISE, Action.EXPECT}
_ENDING_ACTIONS = {Action.CLOSE, Action.EXPECT_CLOSED}


@attrs.frozen
class Step:
    """One line of a fixture (with its continuation lines). ``conn`` is empty for ``wait``."""

    line: int
    action: Action
    conn: str = ""
    data: bytes = b""
    ms: int = 0

    def describe(self) -> str:
        if self.action is Action.WAIT:
            return f"wait {self.ms}ms"
        if self.action in _BYTE_ACTIONS:
            return f"{self.conn} {self.action.value} ({len(self.data)} bytes)"
        if self.action is Action.EXPECT_NOTHING:
            return f"{self.conn} expect-nothing {self.ms}ms"
        return f"{self.conn} {self.action.value}"


class Requires(enum.Enum):
    """What kind of server a fixture needs, from its ``requires`` line."""

    TOKEN = "token"  # a server with a token, given to the runner with --token
    NO_TOKEN = "no-token"  # a server without one


@attrs.frozen
class Fixture:
    name: str
    description: str
    steps: tuple[Step, ...]
    requires: Requires | None = None


# -- the parser -------------------------------------------------------------------------------

_CONN_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
_MS = re.compile(r"(\d+)ms")
# One item of a byte list: hex digits or a string literal, optionally repeated with *N.
# Strings hold printable ASCII other than space, '"', '#' and '\', so they need no escapes and
# a comment can be cut at the first '#' without looking at quotes.
_ITEM = re.compile(r'(?:"(?P<text>[!$-\[\]-~]*)"|(?P<hex>[0-9A-Fa-f]+))(?:\*(?P<count>\d+))?')
_GROUP_END = re.compile(r"\)(?:\*(?P<count>\d+))?")


def _parse_ms(text: str, line: int) -> int:
    match = _MS.fullmatch(text)
    if match is None:
        raise FixtureError(f"line {line}: expected a duration like 100ms, not {text!r}")
    return int(match.group(1))


#: A word of a fixture with the number of the line it is on.
Token = tuple[int, str]


#: Stand for the token given to the runner: its bytes, and their count as a u16.
TOKEN_ITEM = "$token"
TOKEN_LENGTH_ITEM = "$token-length"


def _parse_item(line: int, token: str, secret: bytes | None = None) -> tuple[bytes, int]:
    if token in (TOKEN_ITEM, TOKEN_LENGTH_ITEM):
        if secret is None:
            raise FixtureError(f"line {line}: {token} is only for fixtures that require a token")
        return (secret if token == TOKEN_ITEM else len(secret).to_bytes(2, "big")), 1
    match = _ITEM.fullmatch(token)
    if match is None:
        raise FixtureError(f'line {line}: {token!r} is neither hex bytes nor a "string"')
    count = int(match["count"]) if match["count"] is not None else 1
    if match["hex"] is not None:
        if len(match["hex"]) % 2:
            raise FixtureError(f"line {line}: odd number of hex digits in {token!r}")
        return bytes.fromhex(match["hex"]), count
    return match["text"].encode("ascii"), count


def parse_bytes(tokens: Sequence[Token], secret: bytes | None = None) -> bytes:
    """The bytes a list of tokens stands for: hex, "strings", X*N repeats, ( ... )*N groups,
    and ``$token`` and ``$token-length`` for ``secret``, the token."""
    out = bytearray()
    group: bytearray | None = None
    line = 0
    for line, token in tokens:
        if token == "(":
            if group is not None:
                raise FixtureError(f"line {line}: groups do not nest")
            group = bytearray()
            continue
        end = _GROUP_END.fullmatch(token)
        if end is not None:
            if group is None:
                raise FixtureError(f"line {line}: ')' without '('")
            out += bytes(group) * int(end["count"] or 1)
            group = None
            continue
        data, count = _parse_item(line, token, secret)
        (out if group is None else group).extend(data * count)
    if group is not None:
        raise FixtureError(f"line {line}: '(' is never closed")
    return bytes(out)


def _parse_step(tokens: list[Token], secret: bytes | None) -> Step:
    """A step from the tokens of its line and continuation lines."""
    words = [word for _, word in tokens]
    line = tokens[0][0]
    if words[0] == "wait":
        if len(words) != 2:
            raise FixtureError(f"line {line}: expected 'wait <N>ms'")
        return Step(line, Action.WAIT, ms=_parse_ms(words[1], line))
    if len(words) < 2:
        raise FixtureError(f"line {line}: expected '<connection> <action> ...'")
    conn, verb, rest = words[0], words[1], words[2:]
    if not _CONN_NAME.fullmatch(conn):
        raise FixtureError(f"line {line}: bad connection name {conn!r}")
    try:
        action = Action(verb)
    except ValueError:
        raise FixtureError(f"line {line}: unknown action {verb!r}") from None
    if action in _BYTE_ACTIONS:
        data = parse_bytes(tokens[2:], secret)
        if not data:
            raise FixtureError(f"line {line}: {verb} needs at least one byte")
        return Step(line, action, conn, data=data)
    if action is Action.EXPECT_NOTHING:
        if len(rest) != 1:
            raise FixtureError(f"line {line}: expected '{conn} expect-nothing <N>ms'")
        return Step(line, action, conn, ms=_parse_ms(rest[0], line))
    if action is Action.EXPECT_CLOSED and rest:  # a longer wait than the step timeout
        if len(rest) != 1:
            raise FixtureError(f"line {line}: expected '{conn} expect-closed [<N>ms]'")
        return Step(line, action, conn, ms=_parse_ms(rest[0], line))
    if rest:
        raise FixtureError(f"line {line}: {verb} takes nothing after it")
    return Step(line, action, conn)


def _logical_lines(text: str) -> Iterable[list[Token]]:
    """The tokens of each step: an indented line continues the step before it; lines holding
    only a comment or nothing are skipped."""
    current: list[Token] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        tokens = [(number, word) for word in raw.partition("#")[0].split()]
        if not tokens:
            continue
        if raw[0] in " \t":
            if not current:
                raise FixtureError(f"line {number}: an indented line continues nothing")
            current.extend(tokens)
            continue
        if current:
            yield current
        current = tokens
    if current:
        yield current


def _description(text: str) -> str:
    """The comment lines before the first step, joined: what the fixture is about."""
    words = []
    for raw in text.splitlines():
        code, _, comment = raw.partition("#")
        if code.strip():
            break
        words.append(comment.strip())
    return " ".join(word for word in words if word)


#: A placeholder for the token while parsing a fixture that requires one without a token: the
#: fixture is not run then, but is still checked against the format.
_NO_SECRET = b"\x00"


def parse_fixture(text: str, name: str, token: bytes | None = None) -> Fixture:
    """Parse one fixture file's text, with ``token`` for its ``$token`` items. Raises
    ``FixtureError`` for anything off the format."""
    steps: list[Step] = []
    ended: set[str] = set()
    requires = None
    for tokens in _logical_lines(text):
        if tokens[0][1] == "requires":
            if steps or requires is not None or len(tokens) != 2:
                raise FixtureError(
                    f"line {tokens[0][0]}: one 'requires token' or 'requires no-token' line, "
                    "before the first step"
                )
            try:
                requires = Requires(tokens[1][1])
            except ValueError:
                raise FixtureError(
                    f"line {tokens[0][0]}: requires 'token' or 'no-token', not {tokens[1][1]!r}"
                ) from None
            continue
        secret = (token or _NO_SECRET) if requires is Requires.TOKEN else None
        step = _parse_step(tokens, secret)
        if step.conn in ended:
            raise FixtureError(f"line {step.line}: connection {step.conn} was already closed")
        if step.action in _ENDING_ACTIONS:
            ended.add(step.conn)
        steps.append(step)
    if not steps:
        raise FixtureError("the fixture has no steps")
    return Fixture(name, _description(text), tuple(steps), requires)


def load_fixtures(
    directory: Path, names: Sequence[str] = (), token: bytes | None = None
) -> list[Fixture]:
    """The fixtures of a directory (every ``*.txt``, by name), or only those named; ``token``
    for the ``$token`` items of those that require one."""
    paths = {path.stem: path for path in directory.glob("*.txt")}
    if not paths:
        raise FixtureError(f"no fixtures (*.txt) in {directory}")
    missing = [name for name in names if name not in paths]
    if missing:
        raise FixtureError(f"no fixture named {', '.join(missing)} in {directory}")
    fixtures = []
    for name in names or sorted(paths):
        try:
            text = paths[name].read_text(encoding="ascii")
            fixtures.append(parse_fixture(text, name, token))
        except (FixtureError, UnicodeDecodeError) as error:
            raise FixtureError(f"{paths[name]}: {error}") from None
    return fixtures


# -- the player -------------------------------------------------------------------------------


class StepFailed(Exception):
    """The server did not do what a step expects; the message says what happened instead."""


@attrs.frozen
class Result:
    name: str
    passed: bool
    message: str
    seconds: float
    #: Not run, because the server is not of the kind the fixture requires: ``message`` says.
    skipped: bool = False

    def line(self) -> str:
        timing = f"({self.seconds * 1000:.0f} ms)"
        if self.skipped:
            return f"NOT RUN {self.name}: {self.message}"
        if self.passed:
            return f"PASS {self.name} {timing}"
        return f"FAIL {self.name} {timing}: {self.message}"


def _reason(error: OSError) -> str:
    """The most specific words for a failed connect: trio wraps the per-address errors."""
    causes = getattr(error.__cause__, "exceptions", ())
    for cause in causes:
        if isinstance(cause, OSError) and cause.errno:
            return os.strerror(cause.errno)
    return error.strerror or str(error)


def _hex(data: bytes | bytearray, start: int, *, limit: int = EXCERPT) -> str:
    """Up to ``limit`` bytes from ``start`` as spaced hex, with ellipses where cut."""
    part = bytes(data[start : start + limit]).hex(" ")
    before = "... " if start else ""
    after = " ..." if start + limit < len(data) else ""
    return f"{before}{part}{after}" if part else "(nothing)"


class _Link:
    """One connection of a fixture, with the bytes received but not yet matched."""

    def __init__(self, name: str, stream: trio.abc.Stream) -> None:
        self.name = name
        self.stream = stream
        self.buffer = bytearray()

    async def receive(self) -> bytes:
        """The next bytes from the server; ``b""`` once it has closed (a reset counts)."""
        try:
            return bytes(await self.stream.receive_some(RECEIVE_SIZE))
        except trio.BrokenResourceError:
            return b""

    async def send(self, data: bytes, step_timeout: float) -> None:
        # Bounded too: a server that stops reading would otherwise hang the runner.
        with trio.move_on_after(step_timeout):
            try:
                await self.stream.send_all(data)
            except trio.BrokenResourceError:
                raise StepFailed("could not send: the server has closed the connection") from None
            return
        raise StepFailed(f"could not send within {step_timeout:g} s: the server is not reading")

    async def expect(self, expected: bytes, step_timeout: float) -> None:
        checked = 0  # bytes of the buffer already matched against ``expected``
        with trio.move_on_after(step_timeout):
            while True:
                have = min(len(self.buffer), len(expected))
                if self.buffer[checked:have] != expected[checked:have]:
                    offset = next(i for i in range(checked, have) if self.buffer[i] != expected[i])
                    raise StepFailed(_mismatch(expected, self.buffer, offset))
                checked = have
                if have == len(expected):
                    del self.buffer[:have]
                    return
                data = await self.receive()
                if not data:
                    raise StepFailed(
                        f"the server closed the connection after {have} of {len(expected)} "
                        f"bytes; next expected: {_hex(expected, have)}"
                    )
                self.buffer += data
        raise StepFailed(
            f"received {len(self.buffer)} of {len(expected)} bytes within {step_timeout:g} s; "
            f"next expected: {_hex(expected, len(self.buffer))}"
        )

    async def expect_nothing(self, seconds: float) -> None:
        if self.buffer:
            raise StepFailed(f"expected nothing, received {_hex(self.buffer, 0)}")
        with trio.move_on_after(seconds):
            data = await self.receive()
            if data:
                raise StepFailed(f"expected nothing, received {_hex(data, 0)}")
            raise StepFailed("expected nothing, but the server closed the connection")

    async def expect_closed(self, step_timeout: float) -> None:
        """The server closes the connection, within ``step_timeout`` seconds."""
        if self.buffer:
            raise StepFailed(f"expected a close, received {_hex(self.buffer, 0)}")
        with trio.move_on_after(step_timeout):
            data = await self.receive()
            if data:
                raise StepFailed(f"expected a close, received {_hex(data, 0)}")
            return
        raise StepFailed(f"the connection is still open after {step_timeout:g} s")


def _mismatch(expected: bytes, received: bytearray, offset: int) -> str:
    start = max(0, offset - 4)
    return (
        f"differs at byte {offset} of {len(expected)}: expected {_hex(expected, start)}, "
        f"received {_hex(received, start)}"
    )


class _Player:
    """Carries out one fixture's steps, opening each connection when its name first appears:
    over TLS if given a context, and authenticated first if given a token."""

    def __init__(
        self,
        host: str,
        port: int,
        step_timeout: float,
        tls: ssl.SSLContext | None = None,
        token: bytes | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.step_timeout = step_timeout
        self.tls = tls
        self.token = token
        self.connections: dict[str, _Link] = {}

    async def connection(self, name: str) -> _Link:
        conn = self.connections.get(name)
        if conn is None:
            with trio.move_on_after(self.step_timeout):
                conn = self.connections[name] = _Link(name, await self._open())
                if self.token is not None:
                    # The fixture itself knows nothing of auth: authenticate for it.
                    frame = b"\x61" + len(self.token).to_bytes(2, "big") + self.token
                    try:
                        await conn.send(frame, self.step_timeout)
                        await conn.expect(b"\x00\x00", self.step_timeout)
                    except StepFailed as failure:
                        raise StepFailed(f"authenticating {name} with --token: {failure}") from None
                return conn
            raise StepFailed(f"cannot connect within {self.step_timeout:g} s")
        return conn

    async def _open(self) -> trio.abc.Stream:
        try:
            stream = await trio.open_tcp_stream(self.host, self.port)
        except OSError as error:
            raise StepFailed(f"cannot connect: {_reason(error)}") from None
        if self.tls is None:
            return stream
        tls = trio.SSLStream(stream, self.tls, server_hostname=self.host)
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError as error:
            await trio.aclose_forcefully(stream)
            raise StepFailed(f"TLS handshake failed: {error.__cause__ or error}") from None
        return tls

    async def play(self, step: Step) -> None:
        if step.action is Action.WAIT:
            await trio.sleep(step.ms / 1000)
            return
        conn = await self.connection(step.conn)
        match step.action:
            case Action.SEND:
                await conn.send(step.data, self.step_timeout)
            case Action.SEND_BYTEWISE:
                for byte in step.data:
                    await conn.send(bytes([byte]), self.step_timeout)
                    await trio.sleep(BYTEWISE_PAUSE)
            case Action.EXPECT:
                await conn.expect(step.data, self.step_timeout)
            case Action.EXPECT_NOTHING:
                await conn.expect_nothing(step.ms / 1000)
            case Action.EXPECT_CLOSED:
                await conn.expect_closed(step.ms / 1000 if step.ms else self.step_timeout)
                await self.close(conn)
            case Action.CLOSE:
                await self.close(conn)

    async def close(self, conn: _Link) -> None:
        del self.connections[conn.name]
        await trio.aclose_forcefully(conn.stream)

    def check_leftovers(self) -> None:
        """Bytes already received but never expected fail the fixture."""
        for conn in self.connections.values():
            if conn.buffer:
                raise StepFailed(
                    f"{conn.name} received {len(conn.buffer)} bytes no step expected: "
                    f"{_hex(conn.buffer, 0)}"
                )

    async def close_all(self) -> None:
        for conn in list(self.connections.values()):
            await self.close(conn)


async def run_fixture(
    fixture: Fixture,
    host: str,
    port: int,
    *,
    step_timeout: float = DEFAULT_TIMEOUT,
    token: bytes | None = None,
    tls: ssl.SSLContext | None = None,
) -> Result:
    """Play one fixture on fresh connections, and close them all whatever happens. ``token``:
    the server has this token (``None``: it has none); ``tls``: connect over TLS with it.

    A fixture that requires another kind of server is not run (``Result.skipped``)."""
    if fixture.requires is Requires.TOKEN and token is None:
        return Result(fixture.name, True, "needs a server with a token (give --token)", 0, True)
    if fixture.requires is Requires.NO_TOKEN and token is not None:
        return Result(fixture.name, True, "needs a server without a token", 0, True)
    auto_auth = token if fixture.requires is None else None
    player = _Player(host, port, step_timeout, tls, auto_auth)
    start = trio.current_time()
    message = ""
    try:
        for step in fixture.steps:
            try:
                await player.play(step)
            except StepFailed as failure:
                message = f"line {step.line}, {step.describe()}: {failure}"
                break
        else:
            try:
                player.check_leftovers()
            except StepFailed as failure:
                message = f"at the end: {failure}"
    finally:
        await player.close_all()
    return Result(fixture.name, not message, message, trio.current_time() - start)


async def run_suite(
    fixtures: Sequence[Fixture],
    host: str,
    port: int,
    *,
    step_timeout: float = DEFAULT_TIMEOUT,
    report: Callable[[Result], None] | None = None,
    token: bytes | None = None,
    tls: ssl.SSLContext | None = None,
) -> list[Result]:
    """Play fixtures one after another (they share the server, never a connection)."""
    results = []
    for fixture in fixtures:
        result = await run_fixture(
            fixture, host, port, step_timeout=step_timeout, token=token, tls=tls
        )
        if report is not None:
            report(result)
        results.append(result)
    return results


# -- the command line -------------------------------------------------------------------------

PROG = "pinpriq-conformance"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) as ``(host, port)``; ``ValueError`` if not."""
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad address {text!r}: expected HOST:PORT, e.g. 127.0.0.1:7000")
    return host, int(port_text)


def _argument_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Replay pinpriq's wire fixtures against a server and report each one.",
        epilog="Exit status: 0 all passed, 1 some failed, 2 the suite could not run.",
    )
    parser.add_argument("address", help="the server, as HOST:PORT (e.g. 127.0.0.1:7000)")
    parser.add_argument(
        "names", nargs="*", default=[], metavar="NAME", help="fixtures to run (default: all)"
    )
    parser.add_argument(
        "--fixtures",
        type=Path,
        default=DEFAULT_FIXTURES,
        metavar="DIR",
        help="directory of *.txt fixtures (default: those installed with pinpriq, %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        dest="step_timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help="how long one expect, expect-closed or send step may take (default: %(default)s)",
    )
    parser.add_argument(
        "--token",
        help="the server's token: run the fixtures that require one, and authenticate every "
        "connection of the others first (default: PINPRIQ_AUTH_TOKEN, if set)",
    )
    parser.add_argument(
        "--tls", action="store_true", help="connect over TLS, trusting the system's CAs"
    )
    parser.add_argument(
        "--tls-ca", metavar="FILE", help="connect over TLS, trusting the CA certificates in FILE"
    )
    return parser


async def _check_reachable(
    host: str, port: int, step_timeout: float, tls: ssl.SSLContext | None
) -> str | None:
    """Why the server cannot be reached, or ``None``: one clear line beats N failed fixtures."""
    player = _Player(host, port, step_timeout, tls)
    with trio.move_on_after(step_timeout):
        try:
            stream = await player._open()
        except StepFailed as failure:
            return (
                f"cannot connect to {host}:{port}: {str(failure).removeprefix('cannot connect: ')}"
            )
        await trio.aclose_forcefully(stream)
        return None
    return f"cannot connect to {host}:{port}: no answer within {step_timeout:g} s"


#: The hint for a server that closed the probe's connection unanswered, the runner having no token.
TOKEN_HINT = (
    "the server closed the connection without answering a sync (21): does it need --token? "
    "(or PINPRIQ_AUTH_TOKEN; a protocol 1.0 server, which has no sync, closes it too)"
)


async def _closes_a_sync(
    host: str, port: int, step_timeout: float, tls: ssl.SSLContext | None
) -> bool:
    """Whether the server closes a connection whose first frame is a lone sync (``21``)
    without answering it, as a server with a token does with anything but auth first."""
    with trio.move_on_after(step_timeout):
        try:
            conn = _Link("probe", await _Player(host, port, step_timeout, tls)._open())
        except StepFailed:
            return False  # the fixtures meet the same failure and report it
        try:
            await conn.send(b"\x21", step_timeout)
            return not await conn.receive()
        except StepFailed:
            return True  # closed before it could even take the byte
        finally:
            await trio.aclose_forcefully(conn.stream)
    return False


def _print(result: Result) -> None:
    print(result.line(), flush=True)


async def _main(
    fixtures: list[Fixture],
    host: str,
    port: int,
    step_timeout: float,
    token: bytes | None,
    tls: ssl.SSLContext | None,
) -> int:
    problem = await _check_reachable(host, port, step_timeout, tls)
    if problem:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    closes_a_sync = token is None and await _closes_a_sync(host, port, step_timeout, tls)
    start = trio.current_time()
    results = await run_suite(
        fixtures, host, port, step_timeout=step_timeout, report=_print, token=token, tls=tls
    )
    failed = sum(not r.passed for r in results)
    skipped = sum(r.skipped for r in results)
    seconds = trio.current_time() - start
    total = len(results)
    noun = "fixture" if total == 1 else "fixtures"
    passed = total - failed - skipped
    not_run = f", {skipped} not run" if skipped else ""
    print(f"{total} {noun}: {passed} passed, {failed} failed{not_run} ({seconds:.2f} s)")
    if failed and closes_a_sync:  # after the failures it explains, where a reader looks
        print(f"{PROG}: {TOKEN_HINT}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pinpriq-conformance`` and ``python -m pinpriq.conformance``."""
    parser = _argument_parser()
    args = parser.parse_args(argv)
    try:
        host, port = parse_address(args.address)
    except ValueError as error:
        parser.error(str(error))
    if args.step_timeout <= 0:
        parser.error("--timeout must be positive")
    text = args.token if args.token is not None else os.environ.get("PINPRIQ_AUTH_TOKEN")
    token = os.fsencode(text) if text else None
    tls = None
    if args.tls or args.tls_ca:
        try:
            tls = ssl.create_default_context(cafile=args.tls_ca)
        except OSError as error:
            parser.error(f"cannot use --tls-ca {args.tls_ca}: {error.strerror or error}")
    try:
        fixtures = load_fixtures(args.fixtures, args.names, token)
    except (FixtureError, OSError) as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    try:
        return trio.run(_main, fixtures, host, port, args.step_timeout, token, tls)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
