"""The admin listener over real HTTP: a server and its admin listener in the test's Trio run, on
ephemeral loopback ports, driven by raw pinpriq frames (``tests.rawpeer``) and read through
``http.client`` (in a worker thread, as any outside client would)."""

from __future__ import annotations

import http.client
import json
import math
from functools import partial
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from pinpriq.admin import serve_admin
from pinpriq.display import escape
from pinpriq.packed import DEFAULT_STORE_OVERHEAD as PACKET_OVERHEAD  # the live server's store
from pinpriq.server import PinpriqServer
from pinpriq.store import QueuedPacket, QueueStore
from tests.conftest import LiveServer, StartServer
from tests.rawpeer import (
    READY,
    Peer,
    ack,
    lease_reply,
    pop,
    push,
    push_options,
    release,
    reserve,
    status,
    subscribe,
)
from tests.test_load_shapes import wait_until

SYNC = b"\x21"
TOKEN = b"s3cret-token"
#: What a state-changing request must carry (any value), and a cross-site form cannot.
ACTION = {"X-Pinpriq-Action": "1"}


class Admin:
    """A live server, its admin listener's port, and an HTTP client for it."""

    def __init__(self, live: LiveServer, port: int) -> None:
        self.live = live
        self.port = port

    async def request(
        self, method: str, path: str, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        def call() -> tuple[int, dict[str, str], bytes]:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            try:
                connection.request(method, path, headers=headers or {})
                response = connection.getresponse()
                return response.status, dict(response.getheaders()), response.read()
            finally:
                connection.close()

        return await trio.to_thread.run_sync(call)

    async def json(self, path: str, method: str = "GET", **headers: str) -> Any:
        status, _, body = await self.request(method, path, headers)
        assert status == 200, body
        return json.loads(body)

    async def metrics(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """``/metrics`` parsed by prometheus_client: sample name -> labels -> value."""
        status, headers, body = await self.request("GET", "/metrics")
        assert status == 200
        assert headers["content-type"].startswith("text/plain")
        samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                labels = tuple(sorted(sample.labels.items()))
                samples.setdefault(sample.name, {})[labels] = sample.value
        return samples


async def start_admin(
    start_server: StartServer, nursery: trio.Nursery, server: PinpriqServer, **options: Any
) -> Admin:
    live = await start_server(server)
    listeners = await nursery.start(partial(serve_admin, server, 0, **options))
    return Admin(live, listeners[0].socket.getsockname()[1])


@pytest.fixture
async def admin(start_server: StartServer, nursery: trio.Nursery) -> Admin:
    return await start_admin(start_server, nursery, PinpriqServer())


async def applied(peer: Peer, frames: bytes) -> None:
    """Send frames and wait until the server has applied them (a sync's reply)."""
    await peer.send(frames + SYNC)
    assert await peer.receive_exactly(2) == b"\x00\x00"


def value(samples: dict[str, dict[Any, float]], name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


async def test_metrics_count_what_was_pushed_popped_delivered_expired_and_purged(
    admin: Admin,
) -> None:
    producer, subscriber = await admin.live.connect(), await admin.live.connect()
    await applied(producer, b"".join(push(b"jobs", b"k%d" % i, b"p") for i in range(6)))
    await applied(producer, push(b"jobs", b"g", b"a") + push(b"jobs", b"g", b"b", 0, 0))
    await applied(
        producer, push(b"soon", b"t", b"x", ttl_ms=20) + push(b"purge-me", b"k", b"", 0, 0)
    )
    assert await producer.request(pop(b"jobs")) == [(b"g", b"a"), (b"g", b"b")]  # 2 popped
    assert await producer.request(pop(b"jobs")) == [(b"k5", b"p")]
    await subscriber.send(subscribe(b"jobs") + READY)
    assert await subscriber.reply() == [(b"k4", b"p")]  # 1 delivered
    await wait_until(lambda: admin.live.store.expired == 1, "the TTL packet expired")
    assert await admin.json("/queues/purge-me/purge", "POST", **ACTION) == {
        "queue": "purge-me",
        "purged": 1,
    }

    samples = await admin.metrics()
    counted = {
        name: value(samples, f"pinpriq_packets_{name}_total")
        for name in ("pushed", "popped", "delivered", "expired", "purged")
    }
    assert counted == {"pushed": 10, "popped": 3, "delivered": 1, "expired": 1, "purged": 1}
    assert value(samples, "pinpriq_queue_packets", queue="jobs") == 4
    assert value(samples, "pinpriq_queue_bytes", queue="jobs") == 4 * (2 + 1 + PACKET_OVERHEAD)
    assert value(samples, "pinpriq_queue_subscribers", queue="jobs") == 1
    assert value(samples, "pinpriq_connections") == 2
    assert value(samples, "pinpriq_subscribers") == 1
    assert value(samples, "pinpriq_memory_held_bytes") == admin.live.store.bytes_held
    assert value(samples, "pinpriq_memory_cap_bytes") == 1024**3
    assert value(samples, "pinpriq_info", version=__import__("pinpriq").__version__) == 1
    assert "process_resident_memory_bytes" in samples  # prometheus_client's own, beside ours


async def test_metrics_and_stats_count_leases(admin: Admin) -> None:
    worker = await admin.live.connect()
    await applied(worker, b"".join(push(b"jobs", b"k%d" % i, b"p") for i in range(3)))
    # Three leases: one acked, one released (back in the queue), one still held; an ack of a
    # lease that is no more is answered status 0 and counted.
    expected = (
        b"".join(lease_reply(n, 1, (b"k%d" % (3 - n), b"p")) for n in (1, 2, 3))
        + status(1, True)
        + status(2, True)
        + status(1, False)
    )
    await worker.send(reserve(b"jobs") * 3 + ack(1) + release(2) + ack(1))
    assert await worker.receive_exactly(len(expected)) == expected

    samples = await admin.metrics()
    assert value(samples, "pinpriq_packets_leased") == 1
    assert value(samples, "pinpriq_queue_leased", queue="jobs") == 1
    assert value(samples, "pinpriq_queue_packets", queue="jobs") == 1  # the released one
    assert value(samples, "pinpriq_packets_acked_total") == 1
    assert value(samples, "pinpriq_packets_redelivered_total") == 1
    assert value(samples, "pinpriq_packets_dead_lettered_total") == 0
    assert value(samples, "pinpriq_acks_unknown_total") == 1
    assert value(samples, "pinpriq_packets_popped_total") == 0  # leases are not pops
    # Held packets count against the cap whether queued or leased.
    assert value(samples, "pinpriq_memory_held_bytes") == 2 * (2 + 1 + PACKET_OVERHEAD)
    stats = await admin.json("/stats")
    assert stats["leases"] == {
        "leased": 1,
        "acked": 1,
        "redelivered": 1,
        "dead_lettered": 0,
        "dropped": 0,
        "unknown": 1,
    }
    assert (stats["queues"][0]["packets"], stats["queues"][0]["leased"]) == (1, 1)


async def test_metrics_give_series_to_the_deepest_queues_only(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    admin = await start_admin(start_server, nursery, PinpriqServer(max_memory=0), max_queues=2)
    peer = await admin.live.connect()
    frames = [push(b"q%d" % depth, b"k%d" % i, b"") for depth in range(1, 5) for i in range(depth)]
    await applied(peer, b"".join(frames))
    samples = await admin.metrics()
    assert samples["pinpriq_queue_packets"] == {(("queue", "q4"),): 4, (("queue", "q3"),): 3}
    assert value(samples, "pinpriq_queues") == 4
    assert value(samples, "pinpriq_packets") == 10
    assert value(samples, "pinpriq_memory_cap_bytes") == math.inf  # no cap
    stats = await admin.json("/stats")
    assert [q["name"] for q in stats["queues"]] == ["q4", "q3"]
    assert stats["queues_total"] == 4
    stats = await admin.json("/stats?limit=3")
    assert [q["name"] for q in stats["queues"]] == ["q4", "q3", "q2"]


async def test_queue_names_are_shown_one_way_and_addressed_as_percent_encoded_bytes(
    admin: Admin,
) -> None:
    peer = await admin.live.connect()
    name = b'caf\xc3\xa9 a/b\\c"\xff\n'
    await applied(peer, push(name, b"k", b"v", prio=7))
    samples = await admin.metrics()
    assert value(samples, "pinpriq_queue_packets", queue=escape(name)) == 1
    assert escape(name) == 'café a/b\\\\c"\\xff\\n'
    encoded = "".join(f"%{byte:02X}" for byte in name)
    queue = await admin.json(f"/queues/{encoded}")
    assert (queue["name"], queue["packets"], queue["by_priority"]) == (escape(name), 1, {"7": 1})
    peeked = await admin.json(f"/queues/{encoded}/peek")
    assert peeked == {"queue": escape(name), "packets": [{"key": "k", "payload": "v", "prio": 7}]}
    assert (await admin.json("/stats"))["queues"][0]["name"] == escape(name)


async def test_stats_tell_each_queues_packets_bytes_priorities_and_times(admin: Admin) -> None:
    peer, subscriber = await admin.live.connect(), await admin.live.connect()
    await subscriber.send(subscribe(b"idle") + subscribe(b"work"))
    frames = push(b"work", b"a", b"abcd", prio=3) + push(b"work", b"b", b"", 60_000, 0)
    await applied(peer, frames + push(b"work", b"c", b"xy", 30_000, 3))
    await wait_until(lambda: admin.live.broker.subscriptions.subscriber_count == 1, "subscribed")
    stats = await admin.json("/stats")
    work, idle = stats["queues"]
    assert work["name"] == "work"
    assert work["packets"] == 3
    assert work["bytes"] == 1 + 4 + 1 + 0 + 1 + 2 + 3 * PACKET_OVERHEAD
    assert work["by_priority"] == {"0": 1, "3": 2}
    assert work["subscribers"] == 1
    # At most the age: the server notes the time once a second, and packets carry none.
    assert 0 <= work["oldest_age_ms"] <= stats["uptime_s"] * 1000
    assert 28_000 <= work["next_expiry_ms"] <= 30_000
    assert idle == {
        "name": "idle",
        "path_name": "idle",
        "packets": 0,
        "bytes": 0,
        "by_priority": {},
        "subscribers": 1,
        "leased": 0,
        "delayed": 0,
        "oldest_age_ms": None,
        "next_expiry_ms": None,
        # Never pushed to, and first asked about now: nothing sampled yet.
        "rates": {
            "window_s": 0,
            "pushed_per_s": 0.0,
            "popped_per_s": None,
            "history": {"pushed_per_s": [], "popped_per_s": []},
        },
    }
    assert stats["connections"] == 2
    assert stats["subscribers"] == 1
    assert stats["packets"] == 3
    assert stats["ready"] is True
    assert stats["memory"]["held_bytes"] == admin.live.store.bytes_held
    assert stats["memory"]["cap_bytes"] == 1024**3
    assert stats["memory"]["full"] is False
    assert stats["memory"]["prio_0_bytes"] == 1 + PACKET_OVERHEAD
    assert stats["totals"] == {"pushed": 3, "popped": 0, "delivered": 0, "expired": 0, "purged": 0}
    assert set(stats["rates_per_s"]) == set(stats["totals"])
    assert "history" not in stats
    history = (await admin.json("/stats?history=1"))["history"]
    assert history["interval_s"] == 1
    assert len(history["packets"]) == len(history["pushed_per_s"])


async def test_peek_shows_pop_order_and_removes_nothing(admin: Admin) -> None:
    peer = await admin.live.connect()
    frames = [push(b"q", b"k%d" % i, b"p%d" % i, prio=1 + i % 3) for i in range(6)]
    await applied(peer, b"".join(frames))
    peeked = await admin.json("/queues/q/peek?n=4")
    assert [p["payload"] for p in peeked["packets"]] == ["p3", "p0", "p4", "p1"]
    assert len((await admin.json("/queues/q/peek"))["packets"]) == 6
    assert admin.live.store.depth(b"q") == 6
    assert [await peer.request(pop(b"q")) for _ in range(2)] == [[(b"k3", b"p3")], [(b"k0", b"p0")]]
    assert (await admin.json("/queues/nothing/peek"))["packets"] == []


@pytest.mark.parametrize(
    "query",
    [
        "n=0",
        "n=1001",
        "n=ten",
        "n=-1",
        "n=",
        "n=%C2%B2",  # superscript two: str.isdigit() says yes, int() says no
        "n=%D9%A3",  # Arabic-Indic three: int() reads it as 3
        "n=" + "9" * 5000,  # more digits than int() takes from a string
        "n=+5",
        "n=%205",
    ],
)
async def test_peek_refuses_a_bad_count_and_says_why(
    admin: Admin, query: str, caplog: pytest.LogCaptureFixture
) -> None:
    status, _, body = await admin.request("GET", f"/queues/q/peek?{query}")
    assert status == 400
    error = json.loads(body)["error"]
    assert "n must be a whole number in 1..1000" in error
    assert len(error) < 100  # a 5,000-digit number is not echoed whole
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize("limit", ["%C2%B2", "%D9%A3", "1" + "0" * 5000, "1000001"])
async def test_stats_refuses_a_bad_limit(admin: Admin, limit: str) -> None:
    status, _, body = await admin.request("GET", f"/stats?limit={limit}")
    assert status == 400
    assert "limit must be a whole number in 0..1000000" in json.loads(body)["error"]


async def test_purge_removes_prio_zero_packets_and_wakes_pushers_waiting_for_room(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    packet = 3 + 1 + PACKET_OVERHEAD
    admin = await start_admin(start_server, nursery, PinpriqServer(max_memory=4 * packet))
    producer = await admin.live.connect()
    # Four prio-0 packets fill the cap: nothing can pop them, so pushes wait for good.
    await producer.send(b"".join(push(b"stuck", b"k%02d" % i, b"p", 0, 0) for i in range(6)) + SYNC)
    await wait_until(lambda: admin.live.broker.memory_full, "the cap is reached")
    await producer.expect_silence()
    stats = await admin.json("/stats")
    assert stats["memory"]["full"] is True
    assert stats["ready"] is True
    status, _, _ = await admin.request("GET", "/readyz")
    assert status == 200
    for method in ("POST", "DELETE"):
        purged = await admin.json("/queues/stuck/purge", method, **ACTION)
        assert purged["purged"] == (4 if method == "POST" else 2)
        if method == "POST":
            assert await producer.receive_exactly(2) == b"\x00\x00"  # the waiting pushes went on
    assert (len(admin.live.store), admin.live.store.bytes_held) == (0, 0)
    assert value(await admin.metrics(), "pinpriq_packets_purged_total") == 6


async def test_purge_of_a_queue_that_holds_nothing_purges_nothing(admin: Admin) -> None:
    assert await admin.json("/queues/none/purge", "POST", **ACTION) == {
        "queue": "none",
        "purged": 0,
    }


@pytest.mark.parametrize(
    ("method", "path", "status", "error"),
    [
        ("GET", "/nowhere", 404, "no such path"),
        ("GET", "/queues/a/b/c", 404, "no such path"),
        ("GET", "/queues/q/purge", 405, "use POST or DELETE"),
        ("POST", "/stats", 405, "use GET or HEAD"),
        ("DELETE", "/queues/q", 405, "use GET or HEAD"),
        ("GET", "/stats?limit=many", 400, "limit must be a whole number"),
        ("GET", "/queues/q/move?to=r", 405, "use POST"),
        ("POST", "/queues/q/move", 400, "a move needs to=QUEUE"),
        ("POST", "/queues/q/move?n=1", 400, "a move needs to=QUEUE"),
        ("POST", "/queues/q/move?to=q", 400, "to= names the queue moved from"),
        ("POST", "/queues/q/move?to=%71", 400, "to= names the queue moved from"),
        ("POST", "/queues/q/move?to=r&n=0", 400, "n must be a whole number in 1.."),
        ("POST", "/queues/q/move?to=r&n=all", 400, "n must be a whole number in 1.."),
        ("POST", "/queues/q/move?to=" + "x" * 65536, 400, "at most 65535 bytes"),
    ],
)
async def test_wrong_requests_get_a_status_and_a_reason(
    admin: Admin, method: str, path: str, status: int, error: str
) -> None:
    got, headers, body = await admin.request(method, path, ACTION)
    assert got == status
    assert error in json.loads(body)["error"]
    if status == 405:
        assert headers["allow"] in ("GET, HEAD", "POST, DELETE", "POST")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/queues/%ZZ"),
        ("GET", "/queues/a%2"),
        ("GET", "/queues/%/peek"),
        ("POST", "/queues/%ZZ/purge"),
        ("POST", "/queues/q/move?to=%ZZ"),
    ],
)
async def test_a_malformed_percent_escape_is_refused(admin: Admin, method: str, path: str) -> None:
    peer = await admin.live.connect()
    await applied(peer, push(b"%ZZ", b"k", b"v", prio=1))  # the literal name is not purged
    status, _, body = await admin.request(method, path, ACTION)
    assert status == 400
    assert "malformed percent escape" in json.loads(body)["error"]
    assert admin.live.store.depth(b"%ZZ") == 1
    assert admin.live.store.queue_count == 1  # nothing moved
    assert (await admin.json("/queues/%25ZZ"))["packets"] == 1  # %25 is how to say %


async def test_a_queue_name_longer_than_the_protocol_allows_is_refused(admin: Admin) -> None:
    status, _, body = await admin.request("GET", "/queues/" + "x" * 65536)
    assert status == 400
    assert "at most 65535 bytes" in json.loads(body)["error"]


async def test_what_is_not_http_gets_400_and_the_listener_goes_on(admin: Admin) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", admin.port)
    await stream.send_all(b"\x70\x00\x01garbage that is no request line\r\n\r\n")
    answer = await stream.receive_some(4096)
    assert answer.startswith(b"HTTP/1.1 400 ")
    await stream.aclose()
    assert (await admin.json("/healthz")) == {"status": "serving"}


async def test_a_body_too_large_is_refused(admin: Admin) -> None:
    def post() -> int:
        connection = http.client.HTTPConnection("127.0.0.1", admin.port, timeout=10)
        try:
            connection.request("POST", "/queues/q/purge", body=b"x" * (65 * 1024))
            return connection.getresponse().status
        finally:
            connection.close()

    assert await trio.to_thread.run_sync(post) == 413
    assert (await admin.request("GET", "/healthz"))[0] == 200


async def test_admin_connections_beyond_the_limit_are_closed(
    admin: Admin, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("pinpriq.admin.http.MAX_CONNECTIONS", 2)
    monkeypatch.setattr("pinpriq.admin.http.MAX_PROBE_CONNECTIONS", 1)
    monkeypatch.setattr("pinpriq.admin.http.PROBE_TIMEOUT", 600.0)  # the probe slot stays held
    held = [await trio.open_tcp_stream("127.0.0.1", admin.port) for _ in range(3)]
    await trio.sleep(0.1)  # all accepted and counted: two served, one for a probe
    extra = await trio.open_tcp_stream("127.0.0.1", admin.port)
    with trio.fail_after(5):
        assert await extra.receive_some(100) == b""  # closed at once
    assert "refusing an admin connection from 127.0.0.1:" in caplog.text
    await extra.aclose()
    for stream in held:
        await stream.aclose()
    await trio.sleep(0.1)
    assert (await admin.request("GET", "/healthz"))[0] == 200


GET_PAGE = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


async def hold_without_reading(port: int) -> trio.SocketStream:
    """A connection that pipelines requests for the dashboard page and reads (after its first
    bytes, which show it is served) nothing of the answers: far more than socket buffers take."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(GET_PAGE * 2000)
    with trio.fail_after(10):
        assert (await stream.receive_some(5)) == b"HTTP/"
    return stream


async def test_clients_that_do_not_read_cannot_keep_the_health_probes_out(
    admin: Admin, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("pinpriq.admin.http.MAX_CONNECTIONS", 3)
    monkeypatch.setattr("pinpriq.admin.http.SEND_TIMEOUT", 600.0)  # held for the whole test
    held = [await hold_without_reading(admin.port) for _ in range(3)]
    for path in ("/healthz", "/readyz"):
        assert (await admin.request("GET", path))[0] == 200
    status, headers, body = await admin.request("GET", "/stats")
    assert status == 503
    assert "too many admin connections" in json.loads(body)["error"]
    assert headers["connection"] == "close"
    assert "refusing GET /stats from 127.0.0.1:" in caplog.text
    for stream in held:
        await stream.aclose()
    await served_in_full(admin)


async def served_in_full(admin: Admin) -> None:
    """Wait until a connection slot is free again: /stats is answered (not 503)."""
    with trio.fail_after(10):  # the listener notices the closes at its next write
        while (await admin.request("GET", "/stats"))[0] != 200:  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_an_answer_not_taken_in_time_frees_its_connection(
    admin: Admin, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("pinpriq.admin.http.MAX_CONNECTIONS", 1)
    monkeypatch.setattr("pinpriq.admin.http.SEND_TIMEOUT", 0.2)
    held = await hold_without_reading(admin.port)
    await wait_until(lambda: "did not take its answer" in caplog.text, "the server gave up")
    assert "closing the admin connection from 127.0.0.1:" in caplog.text
    await served_in_full(admin)  # its slot is free again, though the client never closed
    await held.aclose()


async def test_one_connection_serves_several_requests(admin: Admin) -> None:
    def two_requests() -> list[int]:
        connection = http.client.HTTPConnection("127.0.0.1", admin.port, timeout=10)
        statuses = []
        for path in ("/healthz", "/stats", "/metrics"):
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            statuses.append(response.status)
        connection.close()
        return statuses

    assert await trio.to_thread.run_sync(two_requests) == [200, 200, 200]


async def test_head_is_answered_without_a_body(admin: Admin) -> None:
    status, headers, body = await admin.request("HEAD", "/stats")
    assert (status, body) == (200, b"")
    assert int(headers["content-length"]) > 0


async def test_ready_only_while_serving(start_server: StartServer, nursery: trio.Nursery) -> None:
    server = PinpriqServer()
    listeners = await nursery.start(partial(serve_admin, server, 0))
    admin = Admin(None, listeners[0].socket.getsockname()[1])  # type: ignore[arg-type]
    assert (await admin.request("GET", "/readyz"))[0] == 503  # starting: not listening yet
    assert (await admin.request("GET", "/healthz"))[0] == 200
    await start_server(server)
    assert await admin.json("/readyz") == {"ready": True}
    server.shutdown()
    status, _, body = await admin.request("GET", "/readyz")
    assert (status, json.loads(body)) == (503, {"ready": False})


async def test_with_a_token_everything_but_the_probes_and_the_page_needs_it(
    start_server: StartServer, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    admin = await start_admin(start_server, nursery, PinpriqServer(token=TOKEN))
    for path in ("/healthz", "/readyz", "/"):
        assert (await admin.request("GET", path))[0] == 200
    for method, path in [
        ("GET", "/metrics"),
        ("GET", "/stats"),
        ("GET", "/queues/q"),
        ("GET", "/queues/q/peek"),
        ("POST", "/queues/q/purge"),
        ("POST", "/queues/q/move?to=r"),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"}):
            status, response_headers, body = await admin.request(method, path, headers)
            assert status == 401, (method, path, headers)
            assert response_headers["www-authenticate"] == 'Bearer realm="pinpriq"'
            assert "Bearer" in json.loads(body)["error"]
        authorized = {"Authorization": "Bearer " + TOKEN.decode(), **ACTION}
        assert (await admin.request(method, path, authorized))[0] == 200
        # Each refusal is logged, as the data port logs each: the client, never the token.
        assert f"refusing {method} {path.partition('?')[0]} from 127.0.0.1:" in caplog.text
    assert "wrong" not in caplog.text
    assert TOKEN.decode() not in caplog.text


async def test_a_change_needs_a_header_that_a_cross_site_form_cannot_send(
    admin: Admin, caplog: pytest.LogCaptureFixture
) -> None:
    peer = await admin.live.connect()
    await applied(peer, push(b"q", b"k", b"v", prio=1))
    forms = [
        {},
        {"Content-Type": "application/x-www-form-urlencoded"},
        {"Content-Type": "multipart/form-data; boundary=x"},
        {"Content-Type": "text/plain"},
        {"Content-Type": "text/plain; a=application/json"},
    ]
    for method in ("POST", "DELETE"):
        for headers in forms:
            status, _, body = await admin.request(method, "/queues/q/purge", headers)
            assert status == 403, (method, headers)
            assert "X-Pinpriq-Action" in json.loads(body)["error"]
        assert f"refusing {method} /queues/q/purge from 127.0.0.1:" in caplog.text
    assert admin.live.store.depth(b"q") == 1  # nothing purged
    scripts = [
        {"X-Pinpriq-Action": "purge"},
        {"x-pinpriq-action": ""},  # any value, the empty one too
        {"Content-Type": "application/json"},
        {"Content-Type": "Application/JSON; charset=utf-8"},
    ]
    for headers in scripts:
        status, _, body = await admin.request("POST", "/queues/q/purge", headers)
        assert status == 200, headers
    assert admin.live.store.depth(b"q") == 0


async def test_without_a_token_only_requests_to_a_loopback_host_are_answered(
    start_server: StartServer, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    # DNS rebinding: a page at attacker.example, its name re-pointed at 127.0.0.1, is the API's
    # own origin to the browser (custom headers need no preflight), but it names its host.
    admin = await start_admin(start_server, nursery, PinpriqServer())
    peer = await admin.live.connect()
    await applied(peer, push(b"q", b"k", b"v", prio=1))
    for host in ("attacker.example", f"attacker.example:{admin.port}", "127.0.0.1.example"):
        for method, path in [
            ("GET", "/stats"),
            ("GET", "/queues/q/peek"),
            ("POST", "/queues/q/purge"),
        ]:
            status, _, body = await admin.request(method, path, {"Host": host, **ACTION})
            assert status == 403, (host, method, path)
            assert "loopback" in json.loads(body)["error"]
        assert (await admin.request("GET", "/healthz", {"Host": host}))[0] == 200
    assert "refusing POST /queues/q/purge from 127.0.0.1:" in caplog.text
    assert admin.live.store.depth(b"q") == 1  # nothing purged
    for host in (
        "localhost",
        f"LocalHost:{admin.port}",
        "app.localhost",
        f"127.0.0.2:{admin.port}",
        "[::1]:80",
    ):
        assert (await admin.request("GET", "/stats", {"Host": host}))[0] == 200, host
    # With a token, the token is what proves the caller: any host name.
    guarded = await start_admin(start_server, nursery, PinpriqServer(token=TOKEN))
    bearer = {"Authorization": "Bearer " + TOKEN.decode(), "Host": "queues.example.com"}
    assert (await guarded.request("GET", "/stats", bearer))[0] == 200


async def test_cross_origin_requests_get_no_cors_permission(admin: Admin) -> None:
    # Headers a cross-site form cannot send make a browser ask first (a preflight): refused.
    preflight = {
        "Origin": "http://elsewhere.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "x-pinpriq-action",
    }
    for path in ("/queues/q/purge", "/stats", "/"):
        status, headers, _ = await admin.request("OPTIONS", path, preflight)
        assert status == 405
        assert not [name for name in headers if name.lower().startswith("access-control-")]
    status, headers, _ = await admin.request("GET", "/stats", {"Origin": preflight["Origin"]})
    assert status == 200
    assert not [name for name in headers if name.lower().startswith("access-control-")]


async def test_the_dashboard_page_is_served_whole(admin: Admin) -> None:
    status, headers, body = await admin.request("GET", "/")
    assert status == 200
    assert headers["content-type"] == "text/html; charset=utf-8"
    assert b'<svg id="chart"' in body
    assert b"stats?history=1" in body
    assert b"http://" not in body
    assert b"https://" not in body


async def test_a_handler_error_is_a_500_and_the_listener_goes_on(
    admin: Admin, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(QueueStore):
        def peek(self, queue: bytes, count: int) -> list[QueuedPacket]:
            raise RuntimeError("a bug")

    # A store of another class, not a patched method: a store compiled by mypyc (issue 14)
    # has no instance dictionary to patch.
    monkeypatch.setattr(admin.live.broker, "store", Broken(trio.current_time))
    status, _, body = await admin.request("GET", "/queues/q/peek")
    assert status == 500
    assert "internal error" in json.loads(body)["error"]
    assert "a bug" in caplog.text
    assert (await admin.request("GET", "/healthz"))[0] == 200


async def test_connections_are_counted_per_peer_address_with_subscribers_and_leases(
    admin: Admin,
) -> None:
    assert await admin.json("/connections") == {
        "connections": 0,
        "subscribers": 0,
        "leased": 0,
        "leases": 0,
        "addresses": 0,
        "by_address": [],
    }
    plain, subscriber, worker = [await admin.live.connect() for _ in range(3)]
    await applied(subscriber, subscribe(b"q"))
    await applied(worker, push(b"jobs", b"a", b"") + push(b"jobs", b"b", b""))
    await worker.send(reserve(b"jobs") + reserve(b"jobs"))
    await worker.receive_exactly(2 * len(lease_reply(1, 1, (b"a", b""))))
    await applied(plain, b"")
    figures = {"connections": 3, "subscribers": 1, "leased": 1, "leases": 2}
    assert await admin.json("/connections") == {
        **figures,
        "addresses": 1,
        "by_address": [{"address": "127.0.0.1", **figures}],
    }


async def test_peek_previews_keys_and_payloads_as_escaped_text_cut_with_their_lengths(
    admin: Admin,
) -> None:
    peer = await admin.live.connect()
    await applied(peer, push(b"q", b"k\n", b"<b>caf\xc3\xa9</b>\xff" + b"z" * 100))
    peeked = await admin.json("/queues/q/peek?preview=8")
    assert peeked["packets"] == [
        {
            "prio": 1,
            "key_text": "k\\n",
            "key_bytes": 2,
            "payload_text": "<b>caf\u00e9",  # the first 8 bytes, shown as display.escape does
            "payload_bytes": 113,
        }
    ]
    cut_in_a_character = (await admin.json("/queues/q/peek?preview=7"))["packets"][0]
    assert cut_in_a_character["payload_text"] == "<b>caf\\xc3"  # a byte is a byte
    whole = (await admin.json("/queues/q/peek?preview=65535"))["packets"][0]
    assert whole["payload_text"] == "<b>caf\u00e9</b>\\xff" + "z" * 100
    status, _, _ = await admin.request("GET", "/queues/q/peek?preview=0")
    assert status == 400


# -- delayed packets (decision 21) and moves (decision 22) -------------------------------------

HOUR_MS = 3_600_000  # delays no test outlives: those packets stay delayed throughout


async def test_stats_and_metrics_count_delayed_packets_per_queue(admin: Admin) -> None:
    peer = await admin.live.connect()
    frames = push(b"jobs", b"now", b"v") + push_options(b"jobs", b"later", b"v", delay_ms=HOUR_MS)
    await applied(peer, frames + push_options(b"only-later", b"k", b"vv", delay_ms=HOUR_MS))
    size = {b"jobs": len(b"later") + 1 + PACKET_OVERHEAD, b"only-later": 3 + PACKET_OVERHEAD}
    stats = await admin.json("/stats")
    queues = {q["name"]: q for q in stats["queues"]}
    assert (queues["jobs"]["packets"], queues["jobs"]["delayed"]) == (1, 1)
    assert queues["jobs"]["bytes"] == len(b"now") + 1 + PACKET_OVERHEAD + size[b"jobs"]
    # A queue holding only delayed packets is listed, with its bytes.
    assert (queues["only-later"]["packets"], queues["only-later"]["delayed"]) == (0, 1)
    assert queues["only-later"]["bytes"] == size[b"only-later"]
    assert stats["queues_total"] == 2
    assert stats["memory"]["delayed_bytes"] == sum(size.values())
    assert (await admin.json("/queues/only-later"))["delayed"] == 1
    samples = await admin.metrics()
    assert value(samples, "pinpriq_queue_delayed", queue="jobs") == 1
    assert value(samples, "pinpriq_queue_delayed", queue="only-later") == 1
    assert value(samples, "pinpriq_queue_packets", queue="only-later") == 0
    assert value(samples, "pinpriq_memory_delayed_bytes") == sum(size.values())
    assert value(samples, "pinpriq_packets_pushed_total") == 3
    assert await peer.request(pop(b"only-later")) == []
    assert (await admin.json("/queues/jobs/purge", "POST", **ACTION))["purged"] == 2


async def test_move_sends_dead_letters_back_and_offers_them_to_a_waiting_subscriber(
    admin: Admin,
) -> None:
    producer, consumer = await admin.live.connect(), await admin.live.connect()
    await applied(producer, push(b"jobs.dead", b"a", b"1", prio=2) + push(b"jobs.dead", b"b", b"2"))
    await applied(producer, push_options(b"jobs.dead", b"c", b"later", delay_ms=HOUR_MS))
    await consumer.send(subscribe(b"jobs") + READY)
    await consumer.expect_silence()
    moved = await admin.json("/queues/jobs.dead/move?to=jobs", "POST", **ACTION)
    assert moved == {"queue": "jobs.dead", "to": "jobs", "moved": 2}
    assert await consumer.reply() == [(b"b", b"2")]  # delivered by the move, as by a push
    assert await producer.request(pop(b"jobs")) == [(b"a", b"1")]
    assert admin.live.store.queue_info(b"jobs.dead").delayed == 1  # delayed packets stay


async def test_move_with_n_takes_whole_groups_and_to_is_percent_encoded_bytes(
    admin: Admin,
) -> None:
    peer = await admin.live.connect()
    group = push(b"q", b"g", b"1", prio=1) + push(b"q", b"g", b"2", prio=0)
    await applied(peer, group + push(b"q", b"x", b"3", prio=2) + push(b"q", b"y", b"4", prio=3))
    moved = await admin.json("/queues/q/move?to=a+b%00&n=1", "POST", **ACTION)
    assert moved == {"queue": "q", "to": "a+b\\x00", "moved": 2}  # the first group, whole
    assert admin.live.store.depth(b"a+b\x00") == 2  # "+" is a plus sign, not a space
    assert (await admin.json("/queues/q/move?to=&n=2", "POST", **ACTION))["moved"] == 2
    assert admin.live.store.depth(b"") == 2  # to= alone: the empty name
    assert (await admin.json("/queues/q/move?to=r", "POST", **ACTION))["moved"] == 0


async def test_a_move_the_store_cannot_make_is_a_501(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    # The log and the Redis store refuse moves until they record them: said, not a 500.
    class Unmovable(QueueStore):
        def move(self, source: bytes, target: bytes, limit: int = 0) -> int:
            raise NotImplementedError("not on this store")

    admin = await start_admin(start_server, nursery, PinpriqServer(Unmovable(trio.current_time)))
    status, _, body = await admin.request("POST", "/queues/q/move?to=r", ACTION)
    assert (status, json.loads(body)) == (
        501,
        {"error": "this server cannot move packets: not on this store"},
    )
