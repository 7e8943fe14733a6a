"""The clients' shared core (``pinpriq._client_core``) without any I/O: argument checks, reply
matching with syncs, the closed-at-once rule and credit accounting, fed bytes by hand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pinpriq import (
    ArgumentError,
    ArgumentTypeError,
    PinpriqConnectionError,
    PinpriqError,
    PinpriqTimeoutError,
    ProtocolError,
)
from pinpriq._client_core import (
    AT_ONCE_SECONDS,
    Credits,
    Exchange,
    Expect,
    LeasedStream,
    check_address,
    check_timeout,
    push_frame,
    release_frame,
    reserve_frame,
    subscribe_frames,
    touch_frame,
)
from pinpriq.wire import LeaseReply, Packet
from tests.rawpeer import READY, lease_reply, leased_subscribe, push, reply, status, subscribe


def exchange(opened_at: float = 100.0) -> Exchange:
    return Exchange("127.0.0.1", 7000, opened_at)


# -- arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"ttl_ms": 1.5}, ArgumentTypeError, "ttl_ms must be an integer, not float 1.5"),
        ({"ttl_ms": "5"}, ArgumentTypeError, "ttl_ms must be an integer, not str '5'"),
        ({"prio": None}, ArgumentTypeError, "prio must be an integer, not NoneType None"),
        ({"prio": True}, ArgumentTypeError, "prio must be an integer, not bool True"),
        ({"ttl_ms": 1 << 32}, ArgumentError, "ttl_ms must be in 0..4294967295, not 4294967296"),
        ({"prio": -1}, ArgumentError, "prio must be in 0..255, not -1"),
        ({"key": 7}, ArgumentTypeError, "key must be bytes or str, not int"),
        ({"payload": b"x" * 65536}, ArgumentError, "payload is 65536 bytes; the most is 65535"),
    ],
)
def test_push_arguments_name_the_field(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    args: dict[str, object] = {"ttl_ms": 0, "prio": 1, **kwargs}
    with pytest.raises(error) as info:
        push_frame(
            args.get("queue", "q"),  # type: ignore[arg-type]
            args.get("key", "k"),  # type: ignore[arg-type]
            args.get("payload", "p"),  # type: ignore[arg-type]
            args["ttl_ms"],
            args["prio"],
        )
    assert str(info.value) == message
    # Each is also the built-in a caller would catch, and a PinpriqError.
    assert isinstance(info.value, PinpriqError)
    assert isinstance(info.value, TypeError if error is ArgumentTypeError else ValueError)


def test_push_frame_with_confirm_ends_with_a_sync() -> None:
    assert push_frame("q", "k", "v", 0, 1) == push(b"q", b"k", b"v")
    assert push_frame("q", "k", "v", 0, 1, confirm=True) == push(b"q", b"k", b"v") + b"\x21"


@pytest.mark.parametrize(
    ("host", "port", "message"),
    [
        ("h", 0, "port must be in 1..65535, not 0"),
        ("h", 70000, "port must be in 1..65535, not 70000"),
        ("h", "7000", "port must be an integer, not str '7000'"),
        ("", 7000, "host must be a non-empty str, not ''"),
    ],
)
def test_addresses_are_checked_before_connecting(host: str, port: object, message: str) -> None:
    with pytest.raises(PinpriqError) as info:
        check_address(host, port)
    assert str(info.value) == message


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), "5", True])
def test_a_timeout_is_a_positive_number_or_none(timeout: object) -> None:
    with pytest.raises(PinpriqError, match=r"^timeout must be"):
        check_timeout(timeout)
    assert check_timeout(None) is None
    assert check_timeout(2) == 2.0


def test_subscribe_takes_one_queue_or_a_sequence_of_them() -> None:
    one, credits = subscribe_frames("a", 2, None)
    assert (one, credits.granted) == (subscribe(b"a") + READY * 2, 2)
    many, _ = subscribe_frames(["a", b"b"], 1, None)
    assert many == subscribe(b"a") + subscribe(b"b") + READY
    assert subscribe_frames(("a", "b"), 1, None)[0] == many
    with pytest.raises(ArgumentError, match="at least one queue"):
        subscribe_frames([], 1, None)
    with pytest.raises(ArgumentTypeError, match=r"^limit must be an integer"):
        subscribe_frames("a", 1, 2.0)


def test_every_error_the_package_raises_is_a_pinpriq_error() -> None:
    for kind in (ArgumentError, ArgumentTypeError, PinpriqTimeoutError, ProtocolError):
        assert issubclass(kind, PinpriqError)
    assert issubclass(PinpriqConnectionError, PinpriqError)
    assert issubclass(PinpriqConnectionError, ConnectionError)
    assert issubclass(PinpriqTimeoutError, TimeoutError)
    assert issubclass(ProtocolError, ValueError)


# -- replies ----------------------------------------------------------------------------------


def test_replies_fill_slots_in_request_order_across_any_chunking() -> None:
    ex = exchange()
    first, sync, second = (
        ex.expect(Expect.PACKETS),
        ex.expect(Expect.NOTHING),
        ex.expect(Expect.PACKETS),
    )
    data = reply((b"k", b"v")) + reply() + reply()
    for byte in data[:-1]:
        ex.feed(bytes([byte]))
    assert (first.reply, sync.reply, second.reply) == ([Packet(b"k", b"v")], [], None)
    ex.feed(data[-1:])
    assert second.reply == []


def test_a_slot_nobody_waits_for_still_takes_its_reply() -> None:
    ex = exchange()
    ex.expect(Expect.PACKETS)  # a pop whose caller timed out
    mine = ex.expect(Expect.PACKETS)
    ex.feed(reply((b"old", b"")) + reply((b"mine", b"")))
    assert mine.reply == [Packet(b"mine", b"")]


def test_a_reply_nobody_asked_for_is_an_error() -> None:
    with pytest.raises(PinpriqConnectionError, match="sent a reply nobody asked for"):
        exchange().feed(reply())


@pytest.mark.parametrize(
    ("answer", "shown"),
    [
        (b"-ERR unknown command\r\n", "2d 45"),  # Redis
        (b"HTTP/1.1 400 Bad Request\r\n", "48 54"),  # an HTTP server
        (reply((b"k", b"v")), "00 01"),  # a pinpriq server out of step
    ],
)
def test_a_sync_answered_otherwise_than_00_00_fails_at_its_first_two_bytes(
    answer: bytes, shown: str
) -> None:
    ex = exchange()
    ex.expect(Expect.NOTHING)
    with pytest.raises(PinpriqConnectionError, match=f"answered a sync with {shown} instead"):
        ex.feed(answer[:2])


def test_a_close_at_once_with_nothing_received_reads_as_a_refusal() -> None:
    ex = exchange(opened_at=100.0)
    assert ex.closed_by_server(100.5) == (
        "127.0.0.1:7000: the server closed the connection at once "
        "(it may be at its connection limit, want a token or TLS, or refuse clients from "
        "other hosts)"
    )
    assert ex.closed_by_server(100.0 + AT_ONCE_SECONDS) == (
        "connection to 127.0.0.1:7000 was closed by the server"
    )
    ex.expect(Expect.NOTHING)
    assert "or not speak protocol 1.1, which sync needs" in ex.closed_by_server(100.5)
    ex.received_any = True
    assert "at once" not in ex.closed_by_server(100.5)
    assert "broke: reset" in str(ex.broken(100.5, OSError("reset")))


# -- credits ----------------------------------------------------------------------------------


def test_credits_return_one_per_delivery_finished_never_beyond_the_limit() -> None:
    credits = Credits(prefetch=2, limit=3)
    assert credits.granted == 2
    assert credits.to_return() == b""  # nothing handed out yet
    credits.delivered()
    assert credits.to_return() == READY
    credits.returned()
    assert credits.granted == 3
    credits.delivered()
    assert credits.to_return() == b""  # the limit is granted: no more credits
    credits.delivered()
    assert credits.done


def test_credits_without_a_limit_keep_prefetch_outstanding() -> None:
    credits = Credits(prefetch=1, limit=None)
    for _ in range(5):
        credits.delivered()
        assert credits.to_return() == READY
        credits.returned()
    assert (credits.granted, credits.done) == (6, False)


# -- imports ----------------------------------------------------------------------------------


def test_the_blocking_client_broker_codec_and_store_import_without_trio() -> None:
    code = (
        "import sys; sys.modules['trio'] = None\n"
        "import pinpriq, pinpriq.blocking, pinpriq.broker, pinpriq.wire, pinpriq.store\n"
        "assert 'trio' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print(pinpriq.BlockingPinpriqClient.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "BlockingPinpriqClient\n", "")


def test_the_trio_client_is_exported_lazily() -> None:
    code = (
        "import pinpriq, sys; assert 'trio' not in sys.modules\n"
        "pinpriq.PinpriqClient; print('trio' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr


# -- leases -----------------------------------------------------------------------------------


def test_replies_with_both_headers_fill_their_slots_in_order() -> None:
    ex = exchange()
    popped, reserved, answered = (
        ex.expect(Expect.PACKETS),
        ex.expect(Expect.LEASE),
        ex.expect(Expect.STATUS, 4),
    )
    data = reply((b"k", b"v")) + lease_reply(4, 2, (b"j", b"w")) + status(4, True)
    for byte in data:  # one byte at a time: no header is mistaken for the other
        ex.feed(bytes([byte]))
    assert popped.reply == [Packet(b"k", b"v")]
    assert reserved.reply == LeaseReply(4, 2, [Packet(b"j", b"w")])
    assert answered.reply == LeaseReply(4, 1, [])


def test_an_answer_about_another_lease_is_out_of_step() -> None:
    ex = exchange()
    ex.expect(Expect.STATUS, 4)
    with pytest.raises(PinpriqConnectionError, match="about lease 4 with a message about lease 5"):
        ex.feed(status(5, True))


def test_a_leased_stream_sorts_deliveries_from_answers() -> None:
    stream = LeasedStream(exchange())
    first = stream.expect(1)
    data = lease_reply(2, 1, (b"a", b"")) + status(1, False) + lease_reply(3, 7, (b"b", b""))
    stream.feed(data[:5])
    stream.feed(data[5:])
    assert list(stream.deliveries) == [
        LeaseReply(2, 1, [Packet(b"a", b"")]),
        LeaseReply(3, 7, [Packet(b"b", b"")]),
    ]
    assert first.reply == LeaseReply(1, 0, [])
    with pytest.raises(PinpriqConnectionError, match="that nobody asked for"):
        stream.feed(status(9, True))


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ({"lease_ms": -1}, ArgumentError, "lease_ms must be in 0..86400000, not -1"),
        ({"lease_ms": 86_400_001}, ArgumentError, "lease_ms must be in 0..86400000"),
        ({"lease_ms": "1"}, ArgumentTypeError, "lease_ms must be an integer"),
    ],
)
def test_lease_times_are_checked_before_sending(
    args: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        reserve_frame("q", args["lease_ms"])
    with pytest.raises(error, match=message):
        touch_frame(1, args["lease_ms"])
    with pytest.raises(error, match=message):
        subscribe_frames("q", 1, None, args["lease_ms"])
    with pytest.raises(error, match=message.replace("lease_ms", "delay_ms")):
        release_frame(1, args["lease_ms"])


def test_a_leased_subscription_opens_with_leased_subscribes_and_credits() -> None:
    opening, credits = subscribe_frames(["a", "b"], 2, None, 500)
    assert opening == leased_subscribe(b"a", 500) + leased_subscribe(b"b", 500) + READY * 2
    assert credits.granted == 2
