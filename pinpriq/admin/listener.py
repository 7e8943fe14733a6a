"""The admin listener inside the server's Trio run: the HTTP server, and the once-a-second
sampler that rates, the chart and packets' ages read."""

from __future__ import annotations

import logging
import ssl
from functools import partial

import trio

from pinpriq.admin.app import PROBES, AdminApp, Observed
from pinpriq.admin.http import serve_http
from pinpriq.admin.stats import DEFAULT_MAX_QUEUES, Sampler

__all__ = ["serve_admin"]

log = logging.getLogger("pinpriq.admin")

#: Seconds between samples.
SAMPLE_INTERVAL = 1.0


async def serve_admin(
    server: Observed,
    port: int,
    *,
    host: str = "127.0.0.1",
    max_queues: int = DEFAULT_MAX_QUEUES,
    tls: ssl.SSLContext | None = None,
    sampler: Sampler | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin API for ``server`` on ``host:port`` (0: a free port) until cancelled,
    over HTTPS with ``tls`` (the data port's context: one certificate, one client CA); reports
    the TCP listeners through ``task_status`` once requests are accepted. A ``sampler`` given
    is not ticked here: its owner (a test) ticks it, so rates and charts are what it chose."""
    ticked = sampler is None
    if sampler is None:
        sampler = Sampler(server.broker, trio.current_time)
    app = AdminApp(server, sampler, max_queues=max_queues)
    # Outside the nursery, so that a port in use is a plain OSError for the caller.
    sockets = await trio.open_tcp_listeners(port, host=host)
    listeners: list[trio.abc.Listener[trio.abc.Stream]] = list(sockets)
    if tls is not None:
        # https_compatible: browsers and urllib close without TLS's close_notify.
        listeners = [trio.SSLListener(each, tls, https_compatible=True) for each in sockets]
    scheme = "http" if tls is None else "https"
    async with trio.open_nursery() as nursery:
        if ticked:
            nursery.start_soon(_sample, sampler)
        nursery.start_soon(partial(serve_http, app.handle, listeners, probes=PROBES))
        for listener in sockets:
            address = listener.socket.getsockname()
            # Not "listening on ... port N": harnesses read the data port from that line.
            log.info(
                "admin listener (dashboard, /metrics, /stats) on %s://%s/", scheme, _name(address)
            )
        task_status.started(sockets)


def _name(address: tuple[str, int]) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _sample(sampler: Sampler) -> None:
    while True:
        sampler.tick()
        await trio.sleep(SAMPLE_INTERVAL)
