"""Who gets in, over real TCP: token auth (decision 12), protected mode, TLS, and the limits
that hold before a client has authenticated. Clients speak raw bytes (``tests.rawpeer``); the
Python clients' own token and TLS options are tested in their files."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import ssl
from functools import partial

import pytest
import trio
import trio.testing
import trustme

from pinpriq.auth import is_loopback
from pinpriq.broker import REJECT_DELAY
from pinpriq.server import RECEIVE_SIZE, PinpriqServer
from pinpriq.tls import TlsError, server_context
from tests.conftest import TOKEN, LiveServer, StartServer
from tests.rawpeer import SYNC, Peer, auth, pop, push

HOLD = 65535 + 3  # the largest auth frame: what an unauthenticated client may make us hold


def with_token(**options: float) -> PinpriqServer:
    return PinpriqServer(token=TOKEN, **options)  # type: ignore[arg-type]


def warnings_about(caplog: pytest.LogCaptureFixture, peer: Peer) -> list[str]:
    name = f"127.0.0.1:{peer.local_port}"
    return [r.getMessage() for r in caplog.records if name in r.getMessage()]


async def logged(caplog: pytest.LogCaptureFixture, text: str, seconds: float = 5) -> None:
    """Wait until the server has logged ``text``: what it sees of a closed socket reaches it
    through the kernel, so waiting for idle tasks is not enough."""
    with trio.move_on_after(seconds):
        while text not in caplog.text:  # noqa: ASYNC110
            await trio.sleep(0.01)
    assert text in caplog.text


async def closed_after(peer: Peer) -> float:
    """Seconds (on trio's clock) until the server closes ``peer``."""
    started = trio.current_time()
    await peer.expect_closed()
    return trio.current_time() - started


# -- auth -------------------------------------------------------------------------------------


async def test_the_right_token_is_answered_and_frames_sent_with_it_are_applied(
    start_server: StartServer,
) -> None:
    live = await start_server(with_token())
    client = await live.connect(authenticate=False)
    await client.send(auth(TOKEN) + push(b"q", b"k", b"v") + pop(b"q"))
    assert await client.reply() == []  # the auth's 00 00
    assert await client.reply() == [(b"k", b"v")]


@pytest.mark.parametrize(
    ("opening", "reason"),
    [
        (auth(b"not the token") + push(b"q", b"k", b"v"), "a wrong token"),
        (auth(b"") + push(b"q", b"k", b"v"), "a wrong token"),
        (auth(TOKEN[:-1]) + push(b"q", b"k", b"v"), "a wrong token"),
        (push(b"q", b"k", b"v") + auth(TOKEN), "a push before auth"),
        (pop(b"q"), "a pop before auth"),
        (SYNC, "a sync before auth"),
        (b"\xff" + auth(TOKEN), "byte 0xff, not an opcode, before auth"),
    ],
)
async def test_anything_else_first_is_closed_after_the_delay_with_nothing_applied(
    start_server: StartServer,
    mock_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    opening: bytes,
    reason: str,
) -> None:
    live = await start_server(with_token())
    intruder, bystander = await live.connect(authenticate=False), await live.connect()
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        await intruder.send(opening)
        assert REJECT_DELAY <= await closed_after(intruder) < REJECT_DELAY + 0.1
    assert len(live.store) == 0
    [message] = warnings_about(caplog, intruder)
    assert message.endswith(f"in {REJECT_DELAY:g} s: {reason}")
    assert TOKEN.decode() not in caplog.text
    assert await bystander.request(pop(b"q")) == []  # the others carry on


async def test_a_frame_before_auth_is_refused_at_its_first_byte(
    start_server: StartServer, mock_clock: trio.testing.MockClock
) -> None:
    live = await start_server(with_token())
    intruder = await live.connect(authenticate=False)
    await intruder.send(push(b"q", b"k", b"x" * 65535)[:7])  # a push's start, far from its end
    await intruder.expect_closed()


async def test_no_auth_within_the_frame_timeout_is_closed_even_when_idle(
    start_server: StartServer,
    mock_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    live = await start_server(with_token(frame_timeout=5))
    silent, slow = await live.connect(authenticate=False), await live.connect(authenticate=False)
    await slow.send(auth(TOKEN)[:4])
    authenticated = await live.connect()
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        waited = await closed_after(silent)
        await slow.expect_closed()
    assert 5 <= waited <= 5 + REJECT_DELAY + 0.1
    assert warnings_about(caplog, silent)[0].endswith("no auth within 5 s")
    await trio.sleep(60)  # an authenticated connection may be idle between frames for ever
    assert await authenticated.request(pop(b"q")) == []


async def test_a_second_auth_is_answered_if_right_and_closes_if_wrong(
    start_server: StartServer, mock_clock: trio.testing.MockClock
) -> None:
    live = await start_server(with_token())
    client = await live.connect()
    await client.send(push(b"q", b"k1", b"v") + auth(TOKEN) + pop(b"q"))
    assert await client.reply() == []
    assert await client.reply() == [(b"k1", b"v")]
    await client.send(push(b"q", b"k2", b"v") + pop(b"q") + auth(b"guess") + push(b"q", b"k3", b""))
    assert await client.reply() == [(b"k2", b"v")]  # owed before the wrong auth: flushed
    await client.expect_closed()
    assert len(live.store) == 0  # the push after the wrong auth was not applied


async def test_a_server_without_a_token_answers_any_auth(live: LiveServer) -> None:
    client = await live.connect()
    await client.send(auth(b"anything") + auth(b"") + push(b"q", b"k", b"v") + pop(b"q"))
    assert [await client.reply() for _ in range(3)] == [[], [], [(b"k", b"v")]]


async def test_before_auth_the_server_holds_at_most_one_auth_frame_and_one_read(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    server = with_token()
    live = await start_server(server)
    client = await live.connect(authenticate=False)

    async def flood() -> None:  # an auth frame claiming 65,535 bytes, and far more after it
        with contextlib.suppress(trio.BrokenResourceError):  # reset once the server closes
            await client.send(b"\x61\xff\xff" + b"x" * 3_000_000)

    nursery.start_soon(flood)
    await trio.testing.wait_all_tasks_blocked()  # the server holds it for the delay, unread
    assert 0 < server.client_memory.input <= HOLD + RECEIVE_SIZE
    await client.expect_closed()  # a wrong token, once the frame is whole


async def test_the_connection_limit_counts_connections_that_have_not_authenticated(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    live = await start_server(with_token(max_connections=2))
    await live.connect(authenticate=False)
    await live.connect(authenticate=False)
    await trio.testing.wait_all_tasks_blocked()
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        third = await live.connect(authenticate=False)
        await third.expect_closed()
    assert "at the connection limit" in caplog.text


# -- protected mode ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),  # what a dual-stack socket reports for an IPv4 client
        ("192.0.2.2", False),
        ("10.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("fe80::1%eth0", False),
        ("0.0.0.0", False),
        ("not an address", False),
    ],
)
def test_only_loopback_addresses_are_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def other_address() -> str | None:
    """An address of this host that is not loopback, if it has one: the source address of its
    default route. (A UDP connect sends nothing.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address: str = probe.getsockname()[0]
    return None if is_loopback(address) else address


@pytest.fixture
def outside() -> str:
    """A non-loopback address of this host: connections to it come from it, which is the
    closest a single host gets to a client on another machine."""
    address = other_address()
    if address is None:
        if os.environ.get("CI") == "true":
            pytest.fail("this machine has no address but loopback: protected mode is untested")
        pytest.skip("this machine has no address but loopback (the unit test above remains)")
    return address


async def serve_on(nursery: trio.Nursery, server: PinpriqServer, host: str) -> int:
    listeners = await nursery.start(partial(server.serve, 0, host=host))
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def test_protected_mode_refuses_other_hosts_and_says_how_to_let_them_in(
    nursery: trio.Nursery, outside: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        port = await serve_on(nursery, PinpriqServer(), outside)
        assert "protected mode: this server has no token" in caplog.text  # said at start
        caplog.clear()
        stream = await trio.open_tcp_stream(outside, port)
        peer = Peer(stream)
        await peer.send(push(b"q", b"k", b"v"))
        await peer.expect_closed()
        await peer.aclose()
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"refusing a connection from {outside}:")
    assert "protected mode" in message
    assert "--auth-token-file" in message
    assert "PINPRIQ_AUTH_TOKEN" in message
    assert "--no-protected-mode" in message


@pytest.mark.parametrize("server", ["token", "no protected mode"])
async def test_other_hosts_get_in_with_a_token_or_without_protected_mode(
    nursery: trio.Nursery, outside: str, server: str
) -> None:
    token = TOKEN if server == "token" else None
    port = await serve_on(nursery, PinpriqServer(token=token, protected_mode=False), outside)
    peer = Peer(await trio.open_tcp_stream(outside, port))
    await peer.send((auth(TOKEN) if token else b"") + push(b"q", b"k", b"v") + pop(b"q"))
    if token:
        assert await peer.reply() == []
    assert await peer.reply() == [(b"k", b"v")]
    await peer.aclose()


# -- TLS --------------------------------------------------------------------------------------


async def tls_server(
    start_server: StartServer, context: ssl.SSLContext, **options: object
) -> LiveServer:
    return await start_server(PinpriqServer(tls=context, **options))  # type: ignore[arg-type]


async def tls_peer(live: LiveServer, context: ssl.SSLContext) -> Peer:
    """A TLS connection to ``live`` (closed after the test), without auth."""
    stream = await trio.open_tcp_stream("127.0.0.1", live.port)
    peer = Peer(trio.SSLStream(stream, context, server_hostname="127.0.0.1"))
    live.peers.append(peer)
    return peer


async def test_frames_go_both_ways_over_tls_with_a_token(
    start_server: StartServer, server_tls: ssl.SSLContext, client_tls: ssl.SSLContext
) -> None:
    live = await tls_server(start_server, server_tls, token=TOKEN)
    live.client_tls = client_tls
    pusher, subscriber = await live.connect(), await live.connect()
    await subscriber.send(b"\x73\x00\x01s" + b"\x41")
    big = b"x" * 60_000
    pushes = b"".join(push(b"q", b"%d" % i, big) for i in range(100))
    await pusher.send(pushes + push(b"s", b"k", b"d"))
    assert await subscriber.reply() == [(b"k", b"d")]
    await pusher.send(pop(b"q") * 100)
    replies = [await pusher.reply() for _ in range(100)]
    assert [r[0][0] for r in replies] == [b"%d" % i for i in reversed(range(100))]


def issue(ca: trustme.CA, *names: str, **dates: datetime.datetime) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names, **dates).configure_cert(context)
    return context


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        ("expired", "certificate has expired"),
        ("wrong host name", "IP address mismatch"),
        ("untrusted CA", "unable to get local issuer certificate"),
    ],
)
async def test_a_client_refuses_a_server_certificate_it_should_not_trust(
    start_server: StartServer,
    ca: trustme.CA,
    client_tls: ssl.SSLContext,
    caplog: pytest.LogCaptureFixture,
    problem: str,
    message: str,
) -> None:
    if problem == "expired":
        past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=2)
        context = issue(ca, "127.0.0.1", not_before=past, not_after=past)
    elif problem == "wrong host name":
        context = issue(ca, "pinpriq.example")
    else:
        context = issue(trustme.CA(), "127.0.0.1")
    live = await tls_server(start_server, context)
    peer = await tls_peer(live, client_tls)
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        with pytest.raises(trio.BrokenResourceError) as failed:
            await peer.send(pop(b"q"))
        assert isinstance(failed.value.__cause__, ssl.SSLCertVerificationError)
        assert message in str(failed.value.__cause__)
        await trio.aclose_forcefully(peer.stream)
        await logged(caplog, "TLS handshake failed")  # the server logs it and carries on
    good = await tls_server(start_server, server_tls_for(ca))
    assert await (await tls_peer(good, client_tls)).request(pop(b"q")) == []


def server_tls_for(ca: trustme.CA) -> ssl.SSLContext:
    return issue(ca, "127.0.0.1")


async def test_client_certificates_are_required_and_checked_with_tls_ca(
    start_server: StartServer,
    ca: trustme.CA,
    tmp_path: os.PathLike[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The server's context comes from files, as pinpriq-server --tls-cert/--tls-key/--tls-ca
    # builds it; the clients' CA is a CA of its own.
    client_ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    cert, key, ca_file = (os.path.join(tmp_path, name) for name in ("cert", "key", "ca"))
    leaf.private_key_and_cert_chain_pem.write_to_path(cert)
    leaf.private_key_pem.write_to_path(key)
    client_ca.cert_pem.write_to_path(ca_file)
    live = await tls_server(start_server, server_context(cert, key, ca_file))

    def client(issuer: trustme.CA | None) -> ssl.SSLContext:
        context = ssl.create_default_context()
        ca.configure_trust(context)
        if issuer is not None:
            issuer.issue_cert("client.example").configure_cert(context)
        return context

    trusted = await tls_peer(live, client(client_ca))
    assert await trusted.request(pop(b"q")) == []
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        for issuer in (None, trustme.CA()):  # no certificate; one the server does not trust
            stranger = await tls_peer(live, client(issuer))
            with pytest.raises(trio.BrokenResourceError):  # TLS 1.3: at the first read
                await stranger.request(pop(b"q"))
            await trio.aclose_forcefully(stranger.stream)
        await logged(caplog, "TLS handshake failed")
    failures = [r.getMessage() for r in caplog.records if "TLS handshake failed" in r.getMessage()]
    assert len(failures) == 2, caplog.text
    assert "certificate" in failures[0]
    assert await trusted.request(pop(b"q")) == []  # the trusted client carries on


async def test_a_plain_client_on_a_tls_port_is_told_off_in_one_line(
    start_server: StartServer, server_tls: ssl.SSLContext, caplog: pytest.LogCaptureFixture
) -> None:
    live = await tls_server(start_server, server_tls)
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        plain = await live.connect()
        await plain.send(pop(b"q"))  # 4 bytes: less than a TLS record header
        await plain.expect_closed()
    [message] = [r.getMessage() for r in caplog.records]
    assert "the client does not speak TLS (its first byte is 0x50" in message
    assert live.server.connections == 0


async def test_a_tls_client_on_a_plain_port_is_told_off_in_one_line(
    start_server: StartServer, client_tls: ssl.SSLContext, caplog: pytest.LogCaptureFixture
) -> None:
    live = await start_server(PinpriqServer())
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        peer = await tls_peer(live, client_tls)
        with pytest.raises(trio.BrokenResourceError):
            await peer.send(pop(b"q"))
        await trio.testing.wait_all_tasks_blocked()
    [message] = [r.getMessage() for r in caplog.records]
    assert "unknown opcode 0x16 at stream offset 0 (a TLS handshake?" in message
    other = await live.connect()
    assert await other.request(pop(b"q")) == []


async def test_a_tls_client_that_never_finishes_its_handshake_times_out(
    start_server: StartServer,
    server_tls: ssl.SSLContext,
    mock_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    live = await tls_server(start_server, server_tls, frame_timeout=3)
    stalled = await live.connect()
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        await stalled.send(b"\x16\x03\x01")  # the start of a ClientHello, and no more
        assert 3 <= await closed_after(stalled) < 3.1
    assert "no TLS handshake within 3 s" in caplog.text


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (("missing-cert", "key"), "cannot read"),
        (("cert", "cert"), "cannot use the certificate"),
    ],
)
def test_bad_tls_files_are_one_clear_error(
    ca: trustme.CA, tmp_path: os.PathLike[str], files: tuple[str, str], message: str
) -> None:
    leaf = ca.issue_cert("127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(os.path.join(tmp_path, "cert"))
    leaf.private_key_pem.write_to_path(os.path.join(tmp_path, "key"))
    with pytest.raises(TlsError, match=message):
        server_context(*(os.path.join(tmp_path, name) for name in files))
