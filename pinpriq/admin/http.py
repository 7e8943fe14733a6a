"""A small HTTP/1.1 server on Trio, with h11 doing all the parsing.

Why h11 rather than hypercorn: the admin listener answers a handful of small requests with
bodies it builds in memory, inside the server's own Trio run. h11 is one pure-Python dependency
(hypercorn is built on it, and adds h2, wsproto, its configuration and its logging); it is
sans-I/O like pinpriq's own codec, so this module is only the loop that moves bytes between a
socket and ``h11.Connection``, with the limits a server exposed to a network needs: a cap on a
request's head and body, a time limit on each request and on sending each answer, keep-alive, a
cap on connections that still leaves room for health probes, and one bad connection never taking
the listener down.

Handlers are synchronous (``Handler``): they read the broker and answer without yielding, so
what they report is one consistent moment.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from http import HTTPStatus

import attrs
import h11
import trio

from pinpriq.server import peer_name
from pinpriq.tls import describe_tls_error

__all__ = ["MAX_BODY", "Handler", "Request", "Response", "serve_http"]

log = logging.getLogger("pinpriq.admin")

#: Largest request head accepted: room for the longest queue name, percent-encoded (3 x 65,535
#: bytes). And the largest body: the admin API's requests carry none to speak of.
MAX_HEAD = 256 * 1024
MAX_BODY = 64 * 1024
#: Seconds a client may take to send one request, and an idle keep-alive connection may last.
REQUEST_TIMEOUT = 30.0
RECEIVE_SIZE = 16 * 1024
#: Seconds an answer may take to be sent: a client that sends requests and does not read the
#: answers (pipelining them) would otherwise hold its connection for as long as it likes.
SEND_TIMEOUT = 10.0
#: Admin connections served at once, so that a flood of them cannot take the file descriptors the
#: data port needs. Beyond them, ``MAX_PROBE_CONNECTIONS`` more get one request each, answered
#: only if it is a probe (a health check must get through while the slots are full); more than
#: that are closed on arrival.
MAX_CONNECTIONS = 64
MAX_PROBE_CONNECTIONS = 16
#: Seconds such an extra connection has to send its request, and then to take its answer.
PROBE_TIMEOUT = 2.0


@attrs.frozen
class Request:
    method: str
    target: bytes  # as sent: path and query, percent-encoded
    headers: dict[bytes, bytes]  # names lower-cased; a repeated header keeps its last value
    body: bytes
    peer: str = "unknown peer"  # HOST:PORT, for the log


@attrs.frozen
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()
    #: For an answer that needs a wait (a store in another process): the listener awaits this
    #: and sends what it returns instead.
    later: Callable[[], Awaitable[Response]] | None = None


Handler = Callable[[Request], Response]


@attrs.define
class _Slots:
    """Connections open: served in full, and beyond those, answering only probes."""

    probes: frozenset[bytes]  # the paths an extra connection may ask for
    serving: int = 0
    probing: int = 0


async def serve_http(
    handler: Handler,
    listeners: list[trio.abc.Listener[trio.abc.Stream]],
    *,
    probes: frozenset[bytes] = frozenset(),
) -> None:
    """Answer HTTP requests on ``listeners`` with ``handler`` until cancelled. The paths in
    ``probes`` are answered even while ``MAX_CONNECTIONS`` connections are open."""
    await trio.serve_listeners(partial(_connection, handler, _Slots(probes)), listeners)


async def _connection(handler: Handler, slots: _Slots, stream: trio.abc.Stream) -> None:
    peer = _peer(stream)
    if slots.serving < MAX_CONNECTIONS:
        slots.serving += 1
        try:
            await _serve(handler, stream, peer, REQUEST_TIMEOUT, None)
        finally:
            slots.serving -= 1
    elif slots.probing < MAX_PROBE_CONNECTIONS:
        slots.probing += 1
        try:
            await _serve(handler, stream, peer, PROBE_TIMEOUT, slots.probes)
        finally:
            slots.probing -= 1
    else:
        log.warning(
            "refusing an admin connection from %s: %d already open",
            peer,
            slots.serving + slots.probing,
        )
        await trio.aclose_forcefully(stream)


async def _serve(
    handler: Handler,
    stream: trio.abc.Stream,
    peer: str,
    wait_seconds: float,
    only: frozenset[bytes] | None,
) -> None:
    """Answer the requests of one connection, each within ``wait_seconds`` of the last answer;
    with ``only``, one request, and none but those paths (503 for the rest)."""
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    send_seconds = SEND_TIMEOUT if only is None else wait_seconds
    try:
        if isinstance(stream, trio.SSLStream) and not await _shake_hands(
            stream, peer, wait_seconds
        ):
            return
        while True:
            request = None
            with trio.move_on_after(wait_seconds):
                request = await _read_request(connection, stream, peer)
            if request is None:
                return  # closed between requests, or too slow: nothing more to say
            response = await _response(handler, request, only)
            with_body = request.method != "HEAD"
            if not await _send(connection, stream, response, with_body, send_seconds, peer):
                return
            if connection.our_state is h11.MUST_CLOSE:
                return
            connection.start_next_cycle()
    except h11.RemoteProtocolError as error:
        if connection.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = f'{{"error": "bad request: {error}"}}'.encode()
            response = Response(error.error_status_hint, body)
            await _send(connection, stream, response, True, send_seconds, peer)
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
        pass  # the client went away mid-answer
    finally:
        await trio.aclose_forcefully(stream)


async def _send(
    connection: h11.Connection,
    stream: trio.abc.Stream,
    response: Response,
    with_body: bool,
    seconds: float,
    peer: str,
) -> bool:
    """Whether ``response`` was sent within ``seconds``: a client that does not read its answers
    (pipelining requests) must not hold its connection for as long as it likes."""
    with trio.move_on_after(seconds):
        await _respond(connection, stream, response, with_body=with_body)
        return True
    log.warning(
        "closing the admin connection from %s: it did not take its answer within %g s",
        peer,
        seconds,
    )
    return False


async def _shake_hands(stream: trio.SSLStream[trio.abc.Stream], peer: str, seconds: float) -> bool:
    """Whether the TLS handshake succeeded within ``seconds``; logs why not, as the data port
    does (a plain HTTP client on the HTTPS port, a client that does not trust the certificate)."""
    failure = f"no TLS handshake within {seconds:g} s"
    with trio.move_on_after(seconds):
        try:
            await stream.do_handshake()
            return True
        except trio.BrokenResourceError as error:
            failure = f"TLS handshake failed: {describe_tls_error(error)}"
    log.warning("closing the admin connection from %s: %s", peer, failure)
    return False


async def _response(handler: Handler, request: Request, only: frozenset[bytes] | None) -> Response:
    """The handler's answer, awaited if it needs a wait; with ``only``, a 503 for any path not
    in it, and every answer closes the connection."""
    if only is None:
        response = _answer(handler, request)
        if response.later is not None:
            response = await _answer_later(response.later, request)
        return response
    path = request.target.partition(b"?")[0]
    if path in only:
        response = _answer(handler, request)
    else:
        reason = f"too many admin connections ({MAX_CONNECTIONS}); try again later"
        shown = path.decode("ascii", "replace")
        log.warning("refusing %s %s from %s: %s", request.method, shown, request.peer, reason)
        response = Response(
            503, f'{{"error": "{reason}"}}'.encode(), headers=(("retry-after", "1"),)
        )
    return attrs.evolve(response, headers=(*response.headers, ("connection", "close")))


def _peer(stream: trio.abc.Stream) -> str:
    """HOST:PORT of the client, for the log."""
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    return peer_name(stream) if isinstance(stream, trio.SocketStream) else "unknown peer"


async def _read_request(
    connection: h11.Connection, stream: trio.abc.Stream, peer: str
) -> Request | None:
    """The next whole request, or ``None`` when the client closed between requests."""
    head: h11.Request | None = None
    body = bytearray()
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(RECEIVE_SIZE)
            connection.receive_data(bytes(data))  # an SSL stream's may be a bytearray
            continue
        if isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_BODY:
                raise h11.RemoteProtocolError("request body too large", error_status_hint=413)
        elif isinstance(event, h11.EndOfMessage) and head is not None:
            headers = {name.lower(): value for name, value in head.headers}
            method = head.method.decode("ascii")
            return Request(method, head.target, headers, bytes(body), peer)
        elif isinstance(event, h11.ConnectionClosed):
            return None


def _answer(handler: Handler, request: Request) -> Response:
    try:
        return handler(request)
    except Exception:
        # A bug answering one request must not take the listener down, nor hide.
        log.exception("error answering %s %r", request.method, request.target)
        return Response(500, b'{"error": "internal error; see the server log"}')


async def _answer_later(later: Callable[[], Awaitable[Response]], request: Request) -> Response:
    try:
        return await later()
    except Exception:
        log.exception("error answering %s %r", request.method, request.target)
        return Response(500, b'{"error": "internal error; see the server log"}')


async def _respond(
    connection: h11.Connection,
    stream: trio.abc.Stream,
    response: Response,
    *,
    with_body: bool = True,
) -> None:
    headers = [
        ("content-type", response.content_type),
        ("content-length", str(len(response.body))),
        ("cache-control", "no-store"),
        *response.headers,
    ]
    reason = HTTPStatus(response.status).phrase.encode("ascii")
    data = connection.send(
        h11.Response(status_code=response.status, headers=headers, reason=reason)
    )
    if with_body:  # a HEAD request is answered with the head alone
        data += connection.send(h11.Data(data=response.body)) or b""
    data += connection.send(h11.EndOfMessage()) or b""
    await stream.send_all(data)
