"""Both Python clients against a real server with a token and TLS: ``token=`` (and
``PINPRIQ_AUTH_TOKEN``), ``tls=``, and the errors a client gets when it does not belong."""

from __future__ import annotations

import ssl

import pytest
import trio

from pinpriq import BlockingPinpriqClient, PinpriqClient, PinpriqConnectionError
from pinpriq.auth import TOKEN_VARIABLE
from pinpriq.server import PinpriqServer
from tests.conftest import TOKEN, LiveServer, StartServer


@pytest.fixture
async def secured(
    start_server: StartServer, server_tls: ssl.SSLContext, client_tls: ssl.SSLContext
) -> LiveServer:
    live = await start_server(PinpriqServer(token=TOKEN, tls=server_tls))
    live.client_tls = client_tls
    return live


async def test_the_trio_client_with_a_token_over_tls(
    secured: LiveServer, client_tls: ssl.SSLContext
) -> None:
    async with PinpriqClient.connect("127.0.0.1", secured.port, token=TOKEN, tls=client_tls) as c:
        await c.push("q", "k", "v", confirm=True)
        assert [p.key for p in await c.pop("q")] == [b"k"]
        await c.push("s", "k2", "v2")
        async with c.subscribe("s", limit=1) as deliveries:  # a connection of its own
            assert [[p.key for p in d] async for d in deliveries] == [[b"k2"]]


async def test_the_blocking_client_with_a_token_from_the_environment(
    secured: LiveServer, client_tls: ssl.SSLContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_VARIABLE, TOKEN.decode())

    def use() -> None:
        with BlockingPinpriqClient.connect("127.0.0.1", secured.port, tls=client_tls) as c:
            c.push("q", "k", "v", confirm=True)
            assert [p.key for p in c.pop("q")] == [b"k"]
            c.push("s", "k2", "v2")
            with c.subscribe("s", limit=1) as deliveries:
                assert [[p.key for p in d] for d in deliveries] == [[b"k2"]]

    await trio.to_thread.run_sync(use)


async def connect_both(port: int, **options: object) -> list[str]:
    """The messages of the errors each client raises connecting (and popping) with
    ``options``."""
    messages = []
    with pytest.raises(PinpriqConnectionError) as trio_failure:
        async with PinpriqClient.connect("127.0.0.1", port, timeout=5, **options) as c:  # type: ignore[arg-type]
            await c.pop("q")
    messages.append(str(trio_failure.value))

    def use() -> None:
        with BlockingPinpriqClient.connect("127.0.0.1", port, timeout=5, **options) as c:  # type: ignore[arg-type]
            c.pop("q")

    with pytest.raises(PinpriqConnectionError) as blocking_failure:
        await trio.to_thread.run_sync(use)
    messages.append(str(blocking_failure.value))
    return messages


async def test_a_wrong_token_fails_at_connect_saying_so(
    secured: LiveServer, client_tls: ssl.SSLContext
) -> None:
    for message in await connect_both(secured.port, token="wrong", tls=client_tls):
        assert message == (
            f"127.0.0.1:{secured.port} closed the connection in answer to auth: it does not "
            "take this token (or speaks protocol 1.0, which has no auth)"
        )


async def test_no_token_for_a_server_that_wants_one_is_refused_at_once(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_VARIABLE, raising=False)
    live = await start_server(PinpriqServer(token=TOKEN))
    for message in await connect_both(live.port):
        assert "the server closed the connection at once" in message
        assert "want a token or TLS" in message


async def test_a_server_without_a_token_takes_any(live: LiveServer) -> None:
    async with PinpriqClient.connect("127.0.0.1", live.port, token="anything") as client:
        assert await client.pop("q") == []


async def test_tls_to_a_server_whose_ca_is_not_trusted_fails_at_connect(
    secured: LiveServer,
) -> None:
    for message in await connect_both(secured.port, token=TOKEN, tls=True):
        assert message.startswith(f"cannot connect to 127.0.0.1:{secured.port}: TLS handshake")
        assert "certificate verify failed: unable to get local issuer certificate" in message


async def test_tls_to_a_plain_server_fails_at_connect(
    live: LiveServer, client_tls: ssl.SSLContext
) -> None:
    for message in await connect_both(live.port, tls=client_tls):
        assert message.startswith(f"cannot connect to 127.0.0.1:{live.port}: ")
        assert "TLS handshake failed" in message or "reset" in message, message


async def test_plain_to_a_tls_server_fails_at_the_first_call(secured: LiveServer) -> None:
    for message in await connect_both(secured.port):
        assert "the server closed the connection at once" in message
        assert "TLS" in message


async def test_plain_with_the_right_token_to_a_tls_server_is_told_it_may_need_tls(
    secured: LiveServer,
) -> None:
    # Not "it does not take this token": that close comes after about half a second.
    for message in await connect_both(secured.port, token=TOKEN):
        assert message.startswith(
            f"127.0.0.1:{secured.port}: the server closed the connection at once, without "
            "judging the token (it may speak TLS only, which this client did not; "
        )


@pytest.mark.parametrize(("token", "error"), [(3, TypeError), ("x" * 65536, ValueError)])
async def test_a_token_that_cannot_be_sent_is_an_argument_error(
    live: LiveServer, token: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match="token"):
        async with PinpriqClient.connect("127.0.0.1", live.port, token=token):  # type: ignore[arg-type]
            pass
    with pytest.raises(error, match="token"):
        BlockingPinpriqClient.connect("127.0.0.1", live.port, token=token)  # type: ignore[arg-type]


async def test_tls_must_be_a_bool_or_a_context(live: LiveServer) -> None:
    with pytest.raises(TypeError, match="tls must be"):
        BlockingPinpriqClient.connect("127.0.0.1", live.port, tls="yes")  # type: ignore[arg-type]
