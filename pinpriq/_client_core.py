"""What both Python clients share, with no I/O: arguments to frames, defaults, reply matching
and credit accounting.

``client.py`` (Trio) and ``blocking.py`` (plain sockets) differ only in how they move bytes;
everything else is here, once, as redis-py shares one parser between its sync and async clients.
Nothing here imports trio or socket, and nothing here knows a byte layout: frames come from
``wire.encode`` and replies from ``wire.ReplyDecoder``.

Theory of operation.

* **Arguments** are checked before anything is sent; an error names the argument
  (``ArgumentTypeError`` for a wrong type, ``ArgumentError`` for a value out of range).
* **Replies** come in request order on a connection (decision 8). ``Exchange`` keeps the FIFO
  of requests awaiting a reply (pops and syncs), each a ``Slot``: ``feed`` decodes what the
  server sent and fills the oldest slots. A caller that stops waiting (a timeout, a
  cancellation) just forgets its slot, which keeps its place until its reply arrives and is
  dropped, so the connection stays in step. A sync must be answered ``00 00``: anything else
  means the peer is not a pinpriq 1.1 server, and is reported at its first two bytes. So must
  an auth, the first request on a connection to a server with a token (decision 12); a server
  that refuses the token closes the connection instead, which the error then says.
* **Protocol 1.2**: a push with a delay or a long TTL goes out as a ``71``, which an older
  server answers by closing the connection. Until a reply to a later request shows that the
  server read it, a close says that it may not speak 1.2 (``Exchange.sending``).
* **Credits**: a subscription grants ``prefetch`` credits up front and returns one each time the
  caller comes back for the next delivery (``Credits``), so at most ``prefetch`` deliveries are
  ever taken from the server and not yet finished, the one in hand included.
* **Leases** (protocol 1.1, decisions 13-18). A reserve, ack, release or touch is answered with
  the 11-byte lease header, which ``Exchange`` reads for those requests; the answer to an ack,
  release or touch must name the lease asked about, or the connection is out of step. A leased
  subscription's connection carries nothing but 11-byte messages (decision 18): ``LeasedStream``
  sorts them into deliveries (count > 0) and answers (count 0), which fill its requests in
  order. ``LeaseBase`` is what both clients' ``Lease`` share: the group, its attempt, and
  whether it is settled.
"""

from __future__ import annotations

import enum
import os
import socket
from collections import deque
from collections.abc import Mapping, Sequence

from pinpriq import wire
from pinpriq.auth import TOKEN_VARIABLE
from pinpriq.errors import ArgumentError, ArgumentTypeError, PinpriqConnectionError
from pinpriq.wire import DEFAULT_PORT, LeaseReply, Packet

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT",
    "DEFAULT_WORK_LEASE_MS",
    "MAX_PREFETCH",
    "RECEIVE_SIZE",
    "TLS_HANDSHAKE_FAILED",
    "Credits",
    "Data",
    "Exchange",
    "LeaseBase",
    "LeasedStream",
    "Queues",
    "Slot",
]

DEFAULT_HOST = "127.0.0.1"
#: Seconds to wait for a connection or an answer before ``TimeoutError``.
DEFAULT_TIMEOUT = 10.0
#: Bytes asked of the socket per read.
RECEIVE_SIZE = 65536
#: Most credits a subscription may keep outstanding; each is a byte on the wire.
MAX_PREFETCH = 0xFFFF
#: A server that closes a connection this soon after it opened, having sent nothing, most
#: likely refused it (a server at its connection limit accepts and closes at once).
AT_ONCE_SECONDS = 1.0
#: A server that refuses a token closes the connection about half a second after the auth
#: (``broker.REJECT_DELAY``: tokens cannot be guessed fast); a close in answer to auth that
#: comes sooner did not judge the token: a TLS port, the connection limit, a 1.0 server.
TOKEN_JUDGED_SECONDS = 0.4
#: The lease time a worker asks for: the server's own default, said explicitly, since a worker
#: touches its lease at half of it and must know how long that is.
DEFAULT_WORK_LEASE_MS = 30_000

#: A queue name, key or payload: ``str`` is sent as UTF-8.
Data = bytes | bytearray | memoryview | str
#: What ``subscribe`` takes: one queue name, or a sequence (a list, a tuple) of them.
Queues = Data | Sequence[Data]

#: How a failed TLS handshake starts its message, after "cannot connect to HOST:PORT: ".
TLS_HANDSHAKE_FAILED = "TLS handshake failed"

#: What sends a push with options (71), for errors from a server that may not take one.
_NEEDS_1_2 = "a push with a delay or a TTL above 65,535 ms needs"
_SYNC = wire.encode(wire.SYNC)
_READY = wire.encode(wire.READY)


# -- arguments --------------------------------------------------------------------------------


def as_bytes(field: str, value: Data) -> bytes:
    """A queue, key or payload as bytes; ``str`` is encoded as UTF-8."""
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError:
            raise ArgumentError(f"{field} is not encodable as UTF-8") from None
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise ArgumentTypeError(f"{field} must be bytes or str, not {type(value).__name__}")


def check_int(
    field: str, value: object, low: int, high: int | None = None, high_means: str = ""
) -> int:
    """``value`` if it is an integer in ``low..high`` (no upper bound if ``high`` is None);
    ``high_means`` says what ``high`` is in words (``30 days``), for the error."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentTypeError(f"{field} must be an integer, not {type(value).__name__} {value!r}")
    if high is None:
        if value < low:
            raise ArgumentError(f"{field} must be at least {low}, not {value}")
    elif not low <= value <= high:
        said = f" ({high_means})" if high_means else ""
        raise ArgumentError(f"{field} must be in {low}..{high}{said}, not {value}")
    return value


def check_timeout(timeout: object) -> float | None:
    """A client's ``timeout``: a positive number of seconds, or ``None`` for no limit."""
    if timeout is None:
        return None
    if not isinstance(timeout, int | float) or isinstance(timeout, bool):
        raise ArgumentTypeError(f"timeout must be a number of seconds or None, not {timeout!r}")
    if not timeout > 0:
        raise ArgumentError(f"timeout must be a positive number of seconds or None, not {timeout}")
    return float(timeout)


def check_address(host: object, port: object) -> tuple[str, int]:
    """A server address to connect to: a host name and a port in 1..65535."""
    if not isinstance(host, str) or not host:
        raise ArgumentTypeError(f"host must be a non-empty str, not {host!r}")
    return host, check_int("port", port, 1, 65535)


def push_frame(
    queue: Data,
    key: Data,
    payload: Data,
    ttl_ms: object,
    prio: object,
    *,
    delay_ms: object = 0,
    confirm: bool = False,
) -> bytes:
    """The bytes of a push, followed by a sync if ``confirm``.

    A push that protocol 1.0 can say (no delay, a TTL of at most 65,535 ms) is a ``70``, which
    every server takes; a longer TTL or a delay makes it a push with options (``71``, protocol
    1.2), which an older server refuses by closing the connection."""
    fields = (
        as_bytes("queue", queue),
        as_bytes("key", key),
        as_bytes("payload", payload),
        check_int("ttl_ms", ttl_ms, 0, wire.MAX_TTL_MS),
        check_int("prio", prio, 0, wire.MAX_PRIO),
    )
    delay = check_int("delay_ms", delay_ms, 0, wire.MAX_DELAY_MS, "30 days")
    push = wire.DelayedPush(*fields, delay) if delay else wire.Push(*fields)
    return wire.encode(push) + _SYNC if confirm else wire.encode(push)


def resolve_token(token: object, environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The token a client presents: ``token`` (``str`` as UTF-8), or when it is ``None`` the
    ``PINPRIQ_AUTH_TOKEN`` environment variable, or none (``None``)."""
    if token is None:
        value = environ.get(TOKEN_VARIABLE)
        return os.fsencode(value) if value else None
    if isinstance(token, bytes | bytearray | memoryview | str):
        resolved = as_bytes("token", token)
        if len(resolved) > wire.MAX_FIELD:
            raise ArgumentError(f"token is {len(resolved)} bytes; the most is {wire.MAX_FIELD}")
        return resolved
    raise ArgumentTypeError(f"token must be bytes, str or None, not {type(token).__name__}")


def auth_frame(token: bytes) -> bytes:
    return wire.encode(wire.Auth(token))


def pop_frame(queue: Data) -> bytes:
    return wire.encode(wire.Pop(as_bytes("queue", queue)))


def sync_frame() -> bytes:
    return _SYNC


def subscribe_frames(
    queues: Queues, prefetch: object, limit: object, lease_ms: object = None
) -> tuple[bytes, Credits]:
    """The bytes that open a subscription to one queue or a list of them, and its credits; a
    leased subscription (decision 17) unless ``lease_ms`` is None."""
    names: list[Data] = [queues] if isinstance(queues, Data) else list(queues)
    if not names:
        raise ArgumentError("subscribe needs at least one queue")
    prefetch = check_int("prefetch", prefetch, 1, MAX_PREFETCH)
    limit = None if limit is None else check_int("limit", limit, 1)
    if lease_ms is None:
        frames = [wire.encode(wire.Subscribe(as_bytes("queue", name))) for name in names]
    else:
        ms = check_int("lease_ms", lease_ms, 0, wire.MAX_LEASE_MS)
        frames = [wire.encode(wire.LeasedSubscribe(as_bytes("queue", n), ms)) for n in names]
    credits = Credits(prefetch, limit)
    return b"".join(frames) + _READY * credits.granted, credits


def reserve_frame(queue: Data, lease_ms: object) -> bytes:
    return wire.encode(wire.Reserve(as_bytes("queue", queue), _lease_ms(lease_ms)))


def ack_frame(lease_id: int) -> bytes:
    return wire.encode(wire.Ack(lease_id))


def release_frame(lease_id: int, delay_ms: object) -> bytes:
    delay = check_int("delay_ms", delay_ms, 0, wire.MAX_LEASE_MS)
    return wire.encode(wire.Release(lease_id, delay))


def touch_frame(lease_id: int, lease_ms: object) -> bytes:
    return wire.encode(wire.Touch(lease_id, _lease_ms(lease_ms)))


def _lease_ms(lease_ms: object) -> int:
    return check_int("lease_ms", lease_ms, 0, wire.MAX_LEASE_MS)


# -- addresses and connection errors ----------------------------------------------------------


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connect_error(host: str, port: int, error: OSError) -> PinpriqConnectionError:
    """``cannot connect to host:port: reason``, from whatever the socket layer raised."""
    cause = error.__cause__
    # trio reports a failure to connect to every address as one OSError caused by a group.
    if isinstance(cause, ExceptionGroup) and isinstance(cause.exceptions[0], OSError):
        error = cause.exceptions[0]
    if isinstance(error, socket.gaierror) or not error.errno:
        reason = error.strerror or str(error)
    else:
        reason = os.strerror(error.errno)  # trio's strerror repeats the address
    address = format_address(host, port)
    return PinpriqConnectionError(f"cannot connect to {address}: {reason}", host, port)


# -- replies ----------------------------------------------------------------------------------


class Expect(enum.Enum):
    """What a request's reply must be."""

    PACKETS = "a pop reply"
    NOTHING = "00 00, the answer to a sync"
    AUTH = "00 00, the answer to auth"
    LEASE = "a reserve reply"  # the 11-byte header
    STATUS = "the answer to an ack, release or touch"  # the 11-byte header, count 0


_LEASED = (Expect.LEASE, Expect.STATUS)


class Slot:
    """Where one request's reply lands. A caller that stops waiting just forgets its slot,
    which keeps its place in the FIFO until the reply fills it and nobody reads it."""

    __slots__ = ("expect", "lease_id", "reply")

    def __init__(self, expect: Expect, lease_id: int = 0) -> None:
        self.expect = expect
        self.lease_id = lease_id  # for STATUS: the lease the answer must name
        self.reply: list[Packet] | LeaseReply | None = None


class Exchange:
    """One connection's requests awaiting replies, in order, and the decoder of its replies."""

    def __init__(self, host: str, port: int, opened_at: float, *, tls: bool = False) -> None:
        """``opened_at``: when the connection was made, in ``time.monotonic`` seconds;
        ``tls``: whether it speaks TLS."""
        self.host = host
        self.port = port
        self.tls = tls
        self.address = format_address(host, port)
        self._opened_at = opened_at
        self._decoder = wire.ReplyDecoder()
        self._waiting: deque[Slot] = deque()
        #: Whether any byte has come from the server; the client's I/O layer sets it.
        self.received_any = False
        #: Whether a push with options (71) went out that the server may not have read: no
        #: reply to a request sent after it has come. An older server closes on it.
        self._options_unproven = False
        self._options_proof: Slot | None = None  # the first request sent after it

    def sending(self, frame: bytes) -> None:
        """A frame is about to be sent (before its slot, if it has one, is filed)."""
        if frame[0] == wire.Opcode.PUSH_OPTIONS:
            self._options_unproven = True
            self._options_proof = None  # a request sent before this 71 proves nothing of it

    def expect(self, what: Expect, lease_id: int = 0) -> Slot:
        """A request was (or is about to be) sent: its reply will fill the returned slot."""
        slot = Slot(what, lease_id)
        self._waiting.append(slot)
        if self._options_unproven and self._options_proof is None:
            self._options_proof = slot
        return slot

    def _filled(self, reply: list[Packet] | LeaseReply) -> None:
        slot = self._waiting.popleft()
        slot.reply = reply
        if slot is self._options_proof:  # replies come in order: the server read the 71
            self._options_unproven = False
            self._options_proof = None

    def feed(self, data: bytes) -> None:
        """Bytes from the server: fill the oldest slots with the replies they complete.

        Raises ``PinpriqConnectionError`` when the server sends what nobody asked for,
        answers a sync with anything but ``00 00`` (known from the reply's first two bytes), or
        answers an ack, release or touch about another lease; the connection is out of step.
        """
        decoder = self._decoder
        decoder.feed(data)
        while True:
            head = self._waiting[0] if self._waiting else None
            if head is not None and head.expect in _LEASED:
                lease = decoder.next_lease_reply()
                if lease is None:
                    return
                if head.expect is Expect.STATUS:
                    check_status(self, lease, head.lease_id)
                self._filled(lease)
                continue
            reply = decoder.next_reply()
            if reply is None:
                if head is not None and head.expect is not Expect.PACKETS:
                    self._check_sync(decoder.count_in_progress)
                return
            if head is None:
                raise self.error(f"{self.address} sent a reply nobody asked for")
            if head.expect is not Expect.PACKETS:
                self._check_sync(len(reply))
            self._filled(reply)

    def _check_sync(self, count: int) -> None:
        if count:
            what = "auth" if self._waiting[0].expect is Expect.AUTH else "a sync"
            raise self.error(
                f"{self.address} answered {what} with {count.to_bytes(2, 'big').hex(' ')} "
                "instead of 00 00: it is not a pinpriq server speaking protocol 1.1"
            )

    def drop_waiting(self) -> None:
        """The connection is closed: no slot will be filled."""
        self._waiting.clear()

    def refused(self, now: float) -> bool:
        """Whether a close (or reset) by the server at ``now`` looks like a refusal: nothing
        came from the server, and the connection is less than ``AT_ONCE_SECONDS`` old."""
        return not self.received_any and now - self._opened_at < AT_ONCE_SECONDS

    def closed_by_server(self, now: float) -> str:
        """Why the connection ended, when the server closed it at ``now``."""
        if self._waiting and self._waiting[0].expect is Expect.AUTH:
            if not self.received_any and now - self._opened_at < TOKEN_JUDGED_SECONDS:
                return self._closed_before_judging()
            return (
                f"{self.address} closed the connection in answer to auth: it does not take "
                "this token (or speaks protocol 1.0, which has no auth)"
            )
        if self.refused(now):
            why = (
                "the server closed the connection at once (it may be at its connection limit, "
                "want a token or TLS, or refuse clients from other hosts"
            )
            if any(slot.expect is Expect.NOTHING for slot in self._waiting):
                why += ", or not speak protocol 1.1, which sync needs"
            if self._options_unproven:
                why += f", or not speak protocol 1.2, which {_NEEDS_1_2}"
            return f"{self.address}: {why})"
        closed = f"connection to {self.address} was closed by the server"
        if self._options_unproven:
            closed += f" (it may not speak protocol 1.2, which {_NEEDS_1_2})"
        return closed

    def _closed_before_judging(self) -> str:
        causes = "be at its connection limit, refuse clients from other hosts, or speak protocol "
        causes += "1.0, which has no auth"
        if not self.tls:  # a TLS port closes a plain client at once, whatever it sends
            causes = f"speak TLS only, which this client did not; or {causes}"
        return (
            f"{self.address}: the server closed the connection at once, without judging the "
            f"token (it may {causes})"
        )

    def broken(self, now: float, error: BaseException | None) -> PinpriqConnectionError:
        """The error for a connection the server closed (``error`` None) or reset, or that
        broke otherwise, at ``now``."""
        if error is None or self.refused(now):
            return self.error(self.closed_by_server(now))
        return self.error(f"connection to {self.address} broke: {error}")

    def error(self, message: str) -> PinpriqConnectionError:
        return PinpriqConnectionError(message, self.host, self.port)


# -- subscription credits ---------------------------------------------------------------------


class Credits:
    """A subscription's delivery credits: granted, returned, and the deliveries handed out."""

    __slots__ = ("granted", "limit", "received", "unfinished")

    def __init__(self, prefetch: int, limit: int | None) -> None:
        self.limit = limit
        self.granted = prefetch if limit is None else min(prefetch, limit)
        self.received = 0
        self.unfinished = False  # a delivery was handed out and its credit not yet returned

    @property
    def done(self) -> bool:
        """Whether the caller has had ``limit`` deliveries."""
        return self.received == self.limit

    def to_return(self) -> bytes:
        """The caller is back for the next delivery, so the last one is finished: the byte to
        send to return its credit, or ``b""`` if none is due (none handed out yet, or ``limit``
        already granted). Count it as sent only once it is: call ``returned``."""
        if not self.unfinished:
            return b""
        if self.limit is not None and self.granted >= self.limit:
            self.unfinished = False
            return b""
        return _READY

    def returned(self) -> None:
        """The credit ``to_return`` asked for has been sent."""
        self.granted += 1
        self.unfinished = False

    def delivered(self) -> None:
        """A delivery was handed to the caller."""
        self.received += 1
        self.unfinished = True


# -- leases -----------------------------------------------------------------------------------


def check_status(exchange: Exchange, answer: LeaseReply, lease_id: int) -> None:
    """An ack, release or touch must be answered about its own lease, with no packets."""
    if answer.lease_id != lease_id or answer.packets:
        raise exchange.error(
            f"{exchange.address} answered a request about lease {lease_id} with a message "
            f"about lease {answer.lease_id} ({len(answer.packets)} packets): out of step"
        )


class LeasedStream:
    """What a leased subscription's connection receives (decision 18): every message has the
    11-byte header. Deliveries (count > 0) queue up in ``deliveries``; answers (count 0) fill
    the oldest slot of an ack, release or touch sent on it."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.deliveries: deque[LeaseReply] = deque()
        self._decoder = wire.ReplyDecoder()
        self._waiting: deque[Slot] = deque()

    def expect(self, lease_id: int) -> Slot:
        slot = Slot(Expect.STATUS, lease_id)
        self._waiting.append(slot)
        return slot

    def feed(self, data: bytes) -> None:
        """Bytes from the server: deliveries to ``deliveries``, answers to their slots.
        ``PinpriqConnectionError`` if an answer comes that nobody asked for, or about another
        lease."""
        self.exchange.received_any = True
        decoder = self._decoder
        decoder.feed(data)
        while (message := decoder.next_lease_reply()) is not None:
            if message.packets:
                self.deliveries.append(message)
                continue
            if not self._waiting:
                raise self.exchange.error(
                    f"{self.exchange.address} sent an answer about lease {message.lease_id} "
                    "that nobody asked for"
                )
            slot = self._waiting.popleft()
            check_status(self.exchange, message, slot.lease_id)
            slot.reply = message


class LeaseBase:
    """A group of packets on a lease (decisions 13-17): what both clients' ``Lease`` share.

    ``packets`` is the group (the selected packet first, then the rest of its key oldest first,
    as a pop gives them); ``attempt`` is 1 the first time it is leased and counts up each time
    it comes back (saturating at 255); ``lease_id`` names the lease on its connection. A
    reserve that found nothing gives an empty lease: false, with no packets and id 0, whose
    ack, release and touch send nothing and return False.
    """

    __slots__ = ("attempt", "lease_id", "packets", "settled")

    def __init__(self, reply: LeaseReply) -> None:
        self.lease_id = reply.lease_id
        self.attempt = reply.attempt
        self.packets: list[Packet] = reply.packets
        #: Whether ``ack`` or ``release`` was called: the lease is over for this client.
        self.settled = False

    def __bool__(self) -> bool:
        return bool(self.packets)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.lease_id} attempt {self.attempt}: "
            f"{len(self.packets)} packets>"
        )
