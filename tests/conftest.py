"""Shared fixtures: a live server on an ephemeral loopback port, virtual time, and a throwaway
certificate authority for TLS."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial

import pytest
import trio
import trio.testing
import trustme

from pinpriq.server import PinpriqServer
from tests import logtools
from tests.rawpeer import Peer, auth
from tests.redis_servers import RedisServer, need_redis

#: The token of the servers that have one, in tests.
TOKEN = b"t0ken for tests only"


class LiveServer:
    def __init__(
        self,
        server: PinpriqServer,
        port: int,
        nursery: trio.Nursery,
        client_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.server = server
        self.port = port
        self._nursery = nursery
        self.broker = server.broker
        self.store = server.broker.store
        self.peers: list[Peer] = []
        #: How clients connect: over TLS with this context (trusting the server's CA), or not.
        self.client_tls = client_tls

    async def connect(self, *, authenticate: bool = True) -> Peer:
        """A connection to the server, over TLS if it speaks TLS, and authenticated first
        (auth answered ``00 00``) if it has a token, unless ``authenticate`` is false."""
        stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        if self.client_tls is None:
            peer = Peer(stream)
        else:
            tls = trio.SSLStream(stream, self.client_tls, server_hostname="127.0.0.1")
            peer = Peer(tls)
        self.peers.append(peer)
        if authenticate and self.server.token is not None:
            assert await peer.request(auth(self.server.token)) == []
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


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    """A throwaway certificate authority, made for the test run."""
    return trustme.CA()


@pytest.fixture(scope="session")
def server_tls(ca: trustme.CA) -> ssl.SSLContext:
    """A server context with a certificate for 127.0.0.1 and localhost, issued by ``ca``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    return context


@pytest.fixture(scope="session")
def client_tls(ca: trustme.CA) -> ssl.SSLContext:
    """A client context that trusts ``ca`` and checks host names."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


@pytest.fixture(params=["plain", "auth+tls"])
async def hardened(
    request: pytest.FixtureRequest,
    start_server: StartServer,
    server_tls: ssl.SSLContext,
    client_tls: ssl.SSLContext,
) -> LiveServer:
    """A server with default limits twice: as it is, and with a token and TLS on (the peers
    ``connect`` gives then speak TLS and authenticate first). For the hostile-client tests:
    nothing that gets through the plain server may get through the hardened one differently."""
    if request.param == "plain":
        return await start_server(PinpriqServer())
    live = await start_server(PinpriqServer(token=TOKEN, tls=server_tls))
    live.client_tls = client_tls
    return live


@pytest.fixture
def mock_clock() -> trio.testing.MockClock:
    """Virtual time for TTL tests over real sockets.

    Like pytest-trio's ``autojump_clock``, time jumps forward whenever every task is idle, so a
    one-minute TTL takes no real time. The jump waits for 5 ms of real idleness rather than none,
    so bytes still in flight on the loopback land before the clock moves.
    """
    return trio.testing.MockClock(autojump_threshold=0.005)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One standalone redis-server for the session; tests flush it (``redis_url``)."""
    need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"), "--appendonly", "no").start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's Redis, emptied for this test."""
    redis_server.cli("FLUSHALL")
    return redis_server.url


@pytest.fixture(params=logtools.LOGGED_STORES, ids=lambda store_class: store_class.__name__)
def logged_store(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> type[logtools.LoggedStore]:
    """Run a test on each log-backed store (``LoggedStore``, and ``LoggedPackedStore`` where the
    packed store is built): ``logtools.open_store`` opens this one."""
    monkeypatch.setattr(logtools, "default_store_class", request.param)
    return request.param  # type: ignore[no-any-return]
