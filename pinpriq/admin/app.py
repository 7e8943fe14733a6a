"""The admin API: which request gets which answer. No sockets: ``AdminApp.handle`` takes a
``Request`` and returns a ``Response``, so tests can call it without a listener.

    GET  /                      the live dashboard (a page with no data of its own)
    GET  /healthz               200 while the process serves
    GET  /readyz                200 when ready; 503 while starting or shutting down
    GET  /metrics               Prometheus text exposition
    GET  /stats[?limit=N]       the server's figures and its N deepest queues' (JSON)
    GET  /connections           the data port's connections, per peer address (JSON)
    GET  /queues/NAME           one queue's figures, with its rates over the last minute (JSON)
    GET  /queues/NAME/peek?n=N  the next N packets pops would return, none removed (JSON);
                                with &preview=B, keys and payloads as text cut after B bytes
    POST /queues/NAME/purge     remove every packet of the queue; DELETE is the same (JSON)
    POST /queues/NAME/move?to=OTHER[&n=N]
                                move its queued packets to OTHER: all, or whole key groups
                                in pop order while fewer than N have moved (decision 22);
                                answers how many moved (JSON)

NAME (and OTHER) is the queue's bytes, percent-encoded. When the server has a token, every path but
``/healthz``, ``/readyz`` and the dashboard page needs ``Authorization: Bearer TOKEN``; the
page holds no data and asks for the token itself, so a browser can open it. A request that
changes something (POST, DELETE) must carry ``X-Pinpriq-Action`` (any value) or
``Content-Type: application/json``: a cross-site form can send neither, and a page's script
must ask first (a CORS preflight), which this API refuses, so another web page a browser on the
server's host opens cannot purge. Without a token, a request must name a loopback host
(``Host: localhost``, ``127.0.0.1``, ``[::1]``): a page whose DNS name was re-pointed at
127.0.0.1 names its own. Refusals (401, 403) are logged with the client's address.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from importlib.resources import files
from typing import Any, Protocol, TypeVar
from urllib.parse import parse_qs, unquote_to_bytes

from pinpriq.admin.http import Request, Response
from pinpriq.admin.metrics import CONTENT_TYPE_LATEST, BrokerCollector, exposition, registry_for
from pinpriq.admin.stats import (
    DEFAULT_MAX_QUEUES,
    Sampler,
    connection_stats,
    queue_stats,
    server_stats,
)
from pinpriq.auth import is_loopback, tokens_match
from pinpriq.broker import Broker, Session
from pinpriq.display import escape, json_value
from pinpriq.persistence.journal import Journal
from pinpriq.store_contract import BatchedStore, PeekedPacket
from pinpriq.wire import MAX_FIELD

__all__ = [
    "ACTION_HEADER",
    "DEFAULT_PEEK",
    "MAX_MOVE",
    "MAX_PEEK",
    "PROBES",
    "AdminApp",
    "Observed",
]

log = logging.getLogger("pinpriq.admin")

#: Packets ``peek`` shows unless told otherwise, and at most.
DEFAULT_PEEK = 10
MAX_PEEK = 1000
#: The largest ``n`` a move takes: more than any store holds, in a signed 64-bit integer.
MAX_MOVE = 2**63 - 1
#: Health probes: answered even while the listener's connection slots are full.
PROBES = frozenset({b"/healthz", b"/readyz"})
#: Paths anyone may read: probes carry no secrets, and the page fetches its data with the token.
PUBLIC = frozenset({b"/", *PROBES})
#: Methods that change something: they need ``ACTION_HEADER`` or a JSON content type.
CHANGING = frozenset({"POST", "DELETE"})
ACTION_HEADER = "X-Pinpriq-Action"
#: A ``%`` not followed by two hex digits: a malformed escape.
_MALFORMED_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")
#: Digits a number parameter may have: more is no count this API takes (and ``int`` of a long
#: enough string is slow, or refused).
_MAX_DIGITS = 20
HTML = "text/html; charset=utf-8"


class Observed(Protocol):
    """What the admin API reads from the server (``PinpriqServer`` is one)."""

    broker: Broker
    token: bytes | None
    journal: Journal | None  # the log of a server with --data-dir

    @property
    def connections(self) -> int: ...

    @property
    def ready(self) -> bool: ...

    @property
    def recovering(self) -> bool: ...

    def peers(self) -> list[tuple[str, Session]]:
        """Each connection: its peer (HOST:PORT) and its protocol state, to read only."""

    async def log_stored(self) -> None:
        """Return once the store's changes so far are logged as the fsync policy promises."""

    def after_batch(self) -> None:
        """Write what the broker delivered meanwhile (a move offers packets as a push does)."""


class HTTPError(Exception):
    """An answer other than success: its status and a message for the client."""

    def __init__(self, status: int, message: str, headers: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.status = status
        self.headers = headers


def _json(body: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(body, ensure_ascii=False).encode() + b"\n")


class AdminApp:
    """Answers the admin API's requests for one server."""

    def __init__(
        self, server: Observed, sampler: Sampler, *, max_queues: int = DEFAULT_MAX_QUEUES
    ) -> None:
        self.server = server
        self.broker = server.broker
        self.sampler = sampler
        self.max_queues = max_queues
        self.registry = registry_for(
            BrokerCollector(server.broker, lambda: server.connections, max_queues, server.journal)
        )
        self.dashboard = files("pinpriq.admin").joinpath("dashboard.html").read_bytes()

    def handle(self, request: Request) -> Response:
        path, _, query = request.target.partition(b"?")
        try:
            segments = [_unquote(part) for part in path.split(b"/")[1:]]
            route = self._route(request.method, path, segments, query)
            if path not in PUBLIC:
                self._authorize(request)
                if self.server.token is None:
                    _check_host(request)
            if request.method in CHANGING:
                _check_action(request)
            if path not in PUBLIC and self.server.recovering:
                # The store is being filled in a worker thread.
                raise HTTPError(
                    503, "reading the log back (--data-dir); ready when /readyz says so"
                )
            return route(parse_qs(query.decode("latin-1"), keep_blank_values=True))
        except HTTPError as error:
            if error.status in (401, 403):  # as the data port logs the connections it refuses
                log.warning(
                    "refusing %s %s from %s: %s", request.method, escape(path), request.peer, error
                )
            response = _json({"error": str(error)}, error.status)
            return Response(response.status, response.body, headers=error.headers)

    def _route(
        self, method: str, path: bytes, segments: list[bytes], query: bytes
    ) -> Callable[[dict[str, list[str]]], Response]:
        """The handler of a path and method; raises 404 or 405. ``query`` is the target's,
        still percent-encoded (a move's ``to`` is bytes, read from it)."""
        routes: dict[bytes, Callable[[dict[str, list[str]]], Response]] = {
            b"/": lambda _: Response(200, self.dashboard, HTML),
            b"/healthz": lambda _: _json({"status": "serving"}),
            b"/readyz": self._readyz,
            b"/metrics": lambda _: Response(200, exposition(self.registry), CONTENT_TYPE_LATEST),
            b"/stats": self._stats,
            b"/connections": lambda _: _json(connection_stats(self.server.peers())),
        }
        allowed: tuple[str, ...] = ("GET", "HEAD")
        if path in routes:
            handler = routes[path]
        elif len(segments) == 2 and segments[0] == b"queues":
            handler = self._queue(segments[1])
        elif len(segments) == 3 and segments[0] == b"queues" and segments[2] == b"peek":
            handler = self._peek(segments[1])
        elif len(segments) == 3 and segments[0] == b"queues" and segments[2] == b"purge":
            handler, allowed = self._purge(segments[1]), ("POST", "DELETE")
        elif len(segments) == 3 and segments[0] == b"queues" and segments[2] == b"move":
            handler, allowed = self._move(segments[1], query), ("POST",)
        else:
            raise HTTPError(404, f"no such path: {path.decode('latin-1')} (see GET /)")
        if method not in allowed:
            raise HTTPError(405, f"use {' or '.join(allowed)}", (("allow", ", ".join(allowed)),))
        return handler

    def _authorize(self, request: Request) -> None:
        token = self.server.token
        if token is None:
            return
        presented = request.headers.get(b"authorization", b"")
        scheme, _, credentials = presented.partition(b" ")
        if scheme.lower() != b"bearer" or not tokens_match(credentials.strip(), token):
            challenge = (("www-authenticate", 'Bearer realm="pinpriq"'),)
            raise HTTPError(401, "this server needs Authorization: Bearer TOKEN", challenge)

    def _readyz(self, _: dict[str, list[str]]) -> Response:
        ready = self.server.ready
        return _json({"ready": ready}, 200 if ready else 503)

    def _stats(self, query: dict[str, list[str]]) -> Response:
        limit = _number(query, "limit", self.max_queues, 0, 1_000_000)
        history = query.get("history", ["0"])[-1] not in ("", "0", "false")
        stats = server_stats(
            self.broker,
            self.sampler,
            connections=self.server.connections,
            ready=self.server.ready,
            journal=self.server.journal,
            limit=limit,
            history=history,
        )
        return _json(stats)

    def _queue(self, queue: bytes) -> Callable[[dict[str, list[str]]], Response]:
        _check_name(queue)
        return lambda _: _json(queue_stats(self.broker, queue, self.sampler))

    def _peek(self, queue: bytes) -> Callable[[dict[str, list[str]]], Response]:
        _check_name(queue)

        def answer(found: Sequence[PeekedPacket], preview: int) -> Response:
            if preview:
                packets = [
                    _preview(key, payload, prio, preview) for key, payload, prio, *_ in found
                ]
            else:
                packets = [
                    {"key": json_value(key), "payload": json_value(payload), "prio": prio}
                    for key, payload, prio, *_ in found
                ]
            return _json({"queue": escape(queue), "packets": packets})

        def peek(query: dict[str, list[str]]) -> Response:
            count = _number(query, "n", DEFAULT_PEEK, 1, MAX_PEEK)
            preview = _number(query, "preview", 0, 1, MAX_FIELD)
            store = self.broker.store
            if isinstance(store, BatchedStore):  # in another process: answered after a wait
                return _later(
                    lambda: store.peek_async(queue, count), partial(answer, preview=preview)
                )
            return answer(store.peek(queue, count), preview)

        return peek

    def _purge(self, queue: bytes) -> Callable[[dict[str, list[str]]], Response]:
        _check_name(queue)

        def answer(purged: int) -> Response:
            self.sampler.purged(queue, purged)  # so that the queue's rates do not count them
            return _json({"queue": escape(queue), "purged": purged})

        store = self.broker.store
        if isinstance(store, BatchedStore):
            return lambda _: _later(lambda: store.purge_async(queue), answer)
        if self.server.journal is not None:  # answered once its removals are in the log
            return lambda _: _later(lambda: self._purge_logged(queue), answer)
        return lambda _: answer(self.broker.purge(queue))

    async def _purge_logged(self, queue: bytes) -> int:
        purged = self.broker.purge(queue)
        await self.server.log_stored()
        return purged

    def _move(self, queue: bytes, query: bytes) -> Callable[[dict[str, list[str]]], Response]:
        _check_name(queue)

        def answer(moved: int, target: bytes) -> Response:
            self.sampler.moved(queue, target, moved)
            return _json({"queue": escape(queue), "to": escape(target), "moved": moved})

        def move(parsed: dict[str, list[str]]) -> Response:
            target = _move_target(query, queue)  # after the token is checked, as n is
            limit = _number(parsed, "n", 0, 1, MAX_MOVE)
            done = partial(answer, target=target)
            store = self.broker.store
            if isinstance(store, BatchedStore):
                return _later(lambda: _supported(store.move_async(queue, target, limit)), done)
            if self.server.journal is not None:  # answered once the move is in the log
                return _later(lambda: self._move_logged(queue, target, limit), done)
            return done(self._moved(queue, target, limit))

        return move

    def _moved(self, queue: bytes, target: bytes, limit: int) -> int:
        """Move, and write what the packets' offer to ``target``'s subscribers delivered."""
        try:
            moved = self.broker.move(queue, target, limit)
        except NotImplementedError as missing:
            raise HTTPError(501, f"this server cannot move packets: {missing}") from None
        self.server.after_batch()
        return moved

    async def _move_logged(self, queue: bytes, target: bytes, limit: int) -> int:
        journal = self.server.journal
        if journal is not None and journal.disk_full:
            # A move logs its packets again, as pushes, and pushes wait for disk space: an
            # operator's request cannot wait that long, so it is refused, moving nothing.
            raise HTTPError(503, "the log's disk is full: nothing moved; try again later")
        moved = self._moved(queue, target, limit)
        await self.server.log_stored()
        return moved


_T = TypeVar("_T")


def _later(work: Callable[[], Awaitable[_T]], answer: Callable[[_T], Response]) -> Response:
    """A response the listener sends once ``work`` is done: ``answer`` of its result."""

    async def run() -> Response:
        try:
            return answer(await work())
        except HTTPError as error:
            return _json({"error": str(error)}, error.status)

    return Response(200, later=run)


async def _supported(work: Awaitable[_T]) -> _T:
    """``work``'s result; 501 if the store does not do it (yet)."""
    try:
        return await work
    except NotImplementedError as missing:
        raise HTTPError(501, f"this server cannot do that: {missing}") from None


def _move_target(query: bytes, source: bytes) -> bytes:
    """A move's ``to``: percent-encoded bytes as a path's name is (``+`` is a plus sign, and
    ``to=`` alone the empty name); the last one given. 400 if there is none, it is malformed,
    or it names ``source`` itself (decision 22)."""
    given = [part[3:] for part in query.split(b"&") if part == b"to" or part.startswith(b"to=")]
    if not given:
        raise HTTPError(400, "a move needs to=QUEUE: the queue to move the packets to")
    target = _unquote(given[-1])
    _check_name(target)
    if target == source:
        raise HTTPError(400, f"to= names the queue moved from, {escape(source)}: nothing to move")
    return target


def _preview(key: bytes, payload: bytes, prio: int, size: int) -> dict[str, Any]:
    """A peeked packet for people (``?preview=SIZE``): its key and payload as text, shown as
    ``display.escape`` shows bytes, each cut after ``size`` bytes, with their lengths."""
    return {
        "prio": prio,
        "key_text": escape(key[:size]),
        "key_bytes": len(key),
        "payload_text": escape(payload[:size]),
        "payload_bytes": len(payload),
    }


def _check_host(request: Request) -> None:
    """403 unless a request to a listener with no token names a loopback host. Without a token
    the listener is on loopback only, but a web page whose DNS name is re-pointed at 127.0.0.1
    (DNS rebinding) is the same origin as the API to the browser, custom headers and all: its
    requests still name its own host in ``Host``."""
    host = request.headers.get(b"host")
    if host is None:
        return  # HTTP/1.0 with no Host: no browser sends that
    text = host.decode("latin-1").strip().lower()
    name = text[1:].partition("]")[0] if text.startswith("[") else text.partition(":")[0]
    if name == "localhost" or name.endswith(".localhost") or is_loopback(name):
        return
    raise HTTPError(
        403,
        f"Host {escape(host)} is not this host's loopback: without a token (--auth-token-file) "
        "the admin listener answers only requests addressed to localhost, 127.0.0.1 or [::1]",
    )


def _check_action(request: Request) -> None:
    """403 unless a state-changing request carries what a cross-site form cannot send."""
    if ACTION_HEADER.lower().encode() in request.headers:
        return
    media_type = request.headers.get(b"content-type", b"").partition(b";")[0]
    if media_type.strip().lower() == b"application/json":
        return
    raise HTTPError(
        403,
        f"a {request.method} must carry the header {ACTION_HEADER} (any value) or "
        "Content-Type: application/json, which a cross-site form cannot send",
    )


def _unquote(part: bytes) -> bytes:
    """A path segment's bytes; 400 for a ``%`` not followed by two hex digits."""
    if _MALFORMED_ESCAPE.search(part):
        raise HTTPError(
            400,
            f"a malformed percent escape in {escape(part)}: a % takes two hex digits (%25 is %)",
        )
    return unquote_to_bytes(part)


def _check_name(queue: bytes) -> None:
    if len(queue) > MAX_FIELD:
        raise HTTPError(400, f"a queue name is at most {MAX_FIELD} bytes, not {len(queue)}")


def _number(query: dict[str, list[str]], name: str, default: int, low: int, high: int) -> int:
    """A whole-number query parameter in ``low..high``; 400 with the reason otherwise."""
    if name not in query:
        return default
    text = query[name][-1]
    # ASCII digits only: str.isdigit() takes "²" (which int() refuses) and "٣" (which it reads).
    if text.isascii() and text.isdigit() and len(text) <= _MAX_DIGITS:
        number = int(text)
        if low <= number <= high:
            return number
    shown = text if len(text) <= _MAX_DIGITS else text[:_MAX_DIGITS] + "..."
    raise HTTPError(400, f"{name} must be a whole number in {low}..{high}, not {shown!r}")
