"""Shared fixtures: a live server on an ephemeral loopback port, and virtual time."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import pytest
import trio
import trio.testing

from pinpriq.server import PinpriqServer
from tests.rawpeer import Peer


class LiveServer:
    def __init__(self, server: PinpriqServer, port: int, nursery: trio.Nursery) -> None:
        self.server = server
        self.port = port
        self._nursery = nursery
        self.broker = server.broker
        self.store = server.broker.store
        self.peers: list[Peer] = []

    async def connect(self) -> Peer:
        peer = Peer(await trio.open_tcp_stream("127.0.0.1", self.port))
        self.peers.append(peer)
        return peer


StartServer = Callable[[PinpriqServer], Awaitable[LiveServer]]


@pytest.fixture
async def start_server(nursery: trio.Nursery) -> AsyncIterator[StartServer]:
    """Starts a given ``PinpriqServer`` (limits of the test's choosing) on 127.0.0.1 and an
    ephemeral port, in this test's event loop; closes its peers after the test."""
    started: list[LiveServer] = []

    async def start(server: PinpriqServer) -> LiveServer:
        listeners = await nursery.start(partial(server.serve, 0, host="127.0.0.1"))
        live = LiveServer(server, listeners[0].socket.getsockname()[1], nursery)
        started.append(live)
        return live

    yield start
    for live in started:
        for peer in live.peers:
            await trio.aclose_forcefully(peer.stream)


@pytest.fixture
async def live(start_server: StartServer) -> LiveServer:
    """A pinpriq server with default limits on 127.0.0.1 and an ephemeral port."""
    return await start_server(PinpriqServer())


@pytest.fixture
def mock_clock() -> trio.testing.MockClock:
    """Virtual time for TTL tests over real sockets.

    Like pytest-trio's ``autojump_clock``, time jumps forward whenever every task is idle, so a
    one-minute TTL takes no real time. The jump waits for 5 ms of real idleness rather than none,
    so bytes still in flight on the loopback land before the clock moves.
    """
    return trio.testing.MockClock(autojump_threshold=0.005)
