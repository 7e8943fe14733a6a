"""A small HTTP/1.1 server on Trio, with h11 doing all the parsing.

Why h11 rather than hypercorn: the admin listener answers a handful of small requests with
bodies it builds in memory, inside the server's own Trio run. h11 is one pure-Python dependency
(hypercorn is built on it, and adds h2, wsproto, its configuration and its logging); it is
sans-I/O like pinpriq's own codec, so this module is only the loop that moves bytes between a
socket and ``h11.Connection``, with the limits a server exposed to a network needs: a cap on a
request's head and body, a time limit on each request, keep-alive, and one bad connection never
taking the listener down.

Handlers are synchronous (``Handler``): they read the broker and answer without yielding, so
what they report is one consistent moment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from http import HTTPStatus

import attrs
import h11
import trio

__all__ = ["MAX_BODY", "Handler", "Request", "Response", "serve_http"]

log = logging.getLogger("pinpriq.admin")

#: Largest request head accepted: room for the longest queue name, percent-encoded (3 x 65,535
#: bytes). And the largest body: the admin API's requests carry none to speak of.
MAX_HEAD = 256 * 1024
MAX_BODY = 64 * 1024
#: Seconds a client may take to send one request, and an idle keep-alive connection may last.
REQUEST_TIMEOUT = 30.0
RECEIVE_SIZE = 16 * 1024
#: Admin connections served at once; more are closed on arrival, so that a flood of them cannot
#: take the file descriptors the data port needs.
MAX_CONNECTIONS = 64


@attrs.frozen
class Request:
    method: str
    target: bytes  # as sent: path and query, percent-encoded
    headers: dict[bytes, bytes]  # names lower-cased; a repeated header keeps its last value
    body: bytes


@attrs.frozen
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


Handler = Callable[[Request], Response]


async def serve_http(handler: Handler, listeners: list[trio.abc.Listener[trio.abc.Stream]]) -> None:
    """Answer HTTP requests on ``listeners`` with ``handler`` until cancelled."""
    await trio.serve_listeners(partial(_connection, handler, [0]), listeners)


async def _connection(handler: Handler, open_count: list[int], stream: trio.abc.Stream) -> None:
    if open_count[0] >= MAX_CONNECTIONS:
        log.warning("refusing an admin connection: %d already open", open_count[0])
        await trio.aclose_forcefully(stream)
        return
    open_count[0] += 1
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    try:
        while True:
            request = None
            with trio.move_on_after(REQUEST_TIMEOUT):
                request = await _read_request(connection, stream)
            if request is None:
                return  # closed between requests, or too slow: nothing more to say
            response = _answer(handler, request)
            await _respond(connection, stream, response, with_body=request.method != "HEAD")
            if connection.our_state is h11.MUST_CLOSE:
                return
            connection.start_next_cycle()
    except h11.RemoteProtocolError as error:
        if connection.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            status = error.error_status_hint
            body = f'{{"error": "bad request: {error}"}}'.encode()
            await _respond(connection, stream, Response(status, body))
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
        pass  # the client went away mid-answer
    finally:
        open_count[0] -= 1
        await trio.aclose_forcefully(stream)


async def _read_request(connection: h11.Connection, stream: trio.abc.Stream) -> Request | None:
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
            return Request(head.method.decode("ascii"), head.target, headers, bytes(body))
        elif isinstance(event, h11.ConnectionClosed):
            return None


def _answer(handler: Handler, request: Request) -> Response:
    try:
        return handler(request)
    except Exception:
        # A bug answering one request must not take the listener down, nor hide.
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
