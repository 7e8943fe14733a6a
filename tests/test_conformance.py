"""The wire fixtures against our server, and against deliberately wrong servers.

Our server must pass every fixture. Each wrong variant below is our server with one fault (a
misreading of the protocol someone could plausibly make) and must fail the fixtures named for
it: the suite can fail, and each of those fixtures checks what it says it checks. Variants are
built by subclassing the store, the subscriptions or the leases and handing them to
``PinpriqServer`` (some subclasses reach into private attributes, said where they do); faults
in framing are faked by a proxy in front of our server that rewrites the bytes, so nothing is
monkeypatched.

The fixtures run on the wall clock (TTLs, "nothing within 100 ms"), but no test here asserts
how long anything took.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import struct
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import attrs
import pytest
import trio

from pinpriq.conformance import (
    DEFAULT_FIXTURES,
    Requires,
    Result,
    load_fixtures,
    parse_fixture,
    run_fixture,
    run_suite,
)
from pinpriq.leases import DEAD_SUFFIX, Holder, Lease, Leases
from pinpriq.server import PinpriqServer
from pinpriq.store import (
    DEADLINE,
    KEY,
    LEASES,
    PACKET_OVERHEAD,
    PAYLOAD,
    PRIO,
    SEQ,
    QueuedPacket,
    QueueStore,
)
from pinpriq.subscriptions import Subscriber, Subscriptions

FIXTURES = load_fixtures(DEFAULT_FIXTURES)
HOST = "127.0.0.1"
TOKEN = b"conformance t0ken"
WITH_TOKEN = load_fixtures(DEFAULT_FIXTURES, token=TOKEN)


#: A step's bound where the suite is meant to pass. The runner's default (2 s) is for a user
#: judging a server; here the bound only stops a hung run, so it must not be what fails a right
#: server that waited for a core (reply-max-packets' 65,537 pushes took more than 2 s in the
#: pure-Python run while other builds loaded the 2 cores). A wrong byte still fails at once.
PASSING_STEP_TIMEOUT = 60.0


async def start(nursery: trio.Nursery, server: PinpriqServer) -> int:
    listeners = await nursery.start(partial(server.serve, 0, host=HOST))
    port: int = listeners[0].socket.getsockname()[1]
    return port


def failures(results: list[Result]) -> list[str]:
    return [result.line() for result in results if not result.passed]


def not_run(results: list[Result]) -> set[str]:
    return {result.name for result in results if result.skipped}


def requiring(kind: Requires) -> set[str]:
    return {fixture.name for fixture in FIXTURES if fixture.requires is kind}


async def test_our_server_passes_every_fixture_in_any_order(nursery: trio.Nursery) -> None:
    server = PinpriqServer()
    port = await start(nursery, server)
    results = await run_suite(FIXTURES, HOST, port, step_timeout=PASSING_STEP_TIMEOUT)
    assert failures(results) == []
    assert not_run(results) == requiring(Requires.TOKEN)  # reported, not failed
    # Again on the same server, backwards: no fixture depends on another's leftovers...
    assert (
        failures(await run_suite(FIXTURES[::-1], HOST, port, step_timeout=PASSING_STEP_TIMEOUT))
        == []
    )
    # ...because each leaves every queue it used empty.
    assert len(server.broker.store) == 0


@pytest.mark.parametrize("transport", ["tcp", "tls"])
async def test_our_server_with_a_token_passes_every_fixture(
    nursery: trio.Nursery,
    transport: str,
    server_tls: ssl.SSLContext,
    client_tls: ssl.SSLContext,
) -> None:
    # A one-second frame timeout, so that auth-timeout takes a second rather than thirty.
    tls = transport == "tls"
    server = PinpriqServer(token=TOKEN, frame_timeout=1, tls=server_tls if tls else None)
    port = await start(nursery, server)
    results = await run_suite(
        WITH_TOKEN,
        HOST,
        port,
        token=TOKEN,
        tls=client_tls if tls else None,
        step_timeout=PASSING_STEP_TIMEOUT,
    )
    assert failures(results) == []
    assert not_run(results) == requiring(Requires.NO_TOKEN)
    assert len(server.broker.store) == 0


# -- the runner itself, against a stand-in server --------------------------------------------


async def echo_until_ff(stream: trio.SocketStream) -> None:
    """Echoes what it receives, up to a byte ff, where it closes the connection."""
    # A client may close with our echo unread, and its reset must not end the test.
    with contextlib.suppress(trio.BrokenResourceError):
        async with stream:
            while data := await stream.receive_some(1 << 16):
                await stream.send_all(data.partition(b"\xff")[0])
                if b"\xff" in data:
                    return


@pytest.mark.parametrize(
    ("text", "outcome"),
    [
        ("A send 0102\nA expect 01\nA expect 02", ""),
        ("A send 0102\nB send 03\nB expect 03\nA expect 0102", ""),
        ("A send 0102\nA expect 0103", "line 2, A expect (2 bytes): differs at byte 1 of 2: "),
        ("A send 01\nA expect-nothing 20ms", "expected nothing, received 01"),
        ("A expect-nothing 20ms", ""),
        ("A send ff\nA expect-nothing 1000ms", "expected nothing, but the server closed"),
        ("A send 01ff\nA expect 0102", "the server closed the connection after 1 of 2 bytes"),
        ("A send ff\nA expect-closed", ""),
        ("A expect-closed", "line 1, A expect-closed: the connection is still open after 0.2 s"),
        ("A send 01ff\nA expect-closed", "expected a close, received 01"),
        ("A send 01\nA expect 0102", "received 1 of 2 bytes within 0.2 s; next expected: ... 02"),
        ("A send ff\nA expect-closed\nB send 01\nB close\nwait 1ms", ""),
    ],
)
async def test_the_runner_checks_each_step(nursery: trio.Nursery, text: str, outcome: str) -> None:
    listeners = await nursery.start(partial(trio.serve_tcp, echo_until_ff, 0, host=HOST))
    port = listeners[0].socket.getsockname()[1]
    result = await run_fixture(parse_fixture(text, "t"), HOST, port, step_timeout=0.2)
    assert result.passed == (not outcome)
    assert outcome in result.message


# -- wrong variants: the store ----------------------------------------------------------------


class OldestWinsTies(QueueStore):
    """Files each push at the bottom of its priority level's stack, so the oldest pops first."""

    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> float:
        deadline = super().push(queue, key, payload, ttl_ms, prio)
        if prio:
            level = self._queues[queue].levels[prio]
            level.insert(0, level.pop())
        return deadline


class MappedPrio(QueueStore):
    """Stores each packet under another priority: a misread priority scale."""

    def __init__(self, clock: Callable[[], float], mapping: Callable[[int], int]) -> None:
        super().__init__(clock)
        self._mapping = mapping

    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> float:
        return super().push(queue, key, payload, ttl_ms, self._mapping(prio))


class ReorderedGroup(QueueStore):
    """Returns a pop's packets in another order."""

    def __init__(
        self,
        clock: Callable[[], float],
        order: Callable[[list[QueuedPacket]], list[QueuedPacket]],
    ) -> None:
        super().__init__(clock)
        self._order = order

    def pop(self, queue: bytes) -> list[QueuedPacket]:
        return self._order(super().pop(queue))


class MappedTtl(QueueStore):
    def __init__(self, clock: Callable[[], float], mapping: Callable[[int], int]) -> None:
        super().__init__(clock)
        self._mapping = mapping

    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> float:
        return super().push(queue, key, payload, self._mapping(ttl_ms), prio)


class NoExpiry(QueueStore):
    """Never expires anything: TTLs ignored."""

    def expire(self) -> int:
        return 0

    def next_deadline(self) -> float | None:
        return None


class CStringNames(QueueStore):
    """Queue names cut at their first zero byte, as a C string would be."""

    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> float:
        return super().push(queue.split(b"\0")[0], key, payload, ttl_ms, prio)

    def pop(self, queue: bytes) -> list[QueuedPacket]:
        return super().pop(queue.split(b"\0")[0])

    def peek_rank(self, queue: bytes) -> tuple[int, int] | None:
        return super().peek_rank(queue.split(b"\0")[0])


class NewestOnReturn(QueueStore):
    """A packet coming back from a lease is pushed again: the newest, under a new number."""

    def restore(self, queue: bytes, packets: Sequence[QueuedPacket]) -> int:
        held = sum(len(p[KEY]) + len(p[PAYLOAD]) + PACKET_OVERHEAD for p in packets)
        self.taken_bytes -= held
        self.bytes_held -= held
        for packet in packets:
            self.push(queue, packet[KEY], packet[PAYLOAD], 0, packet[PRIO])
        return len(packets)


class FreshTtlOnReturn(QueueStore):
    """A packet coming back from a lease gets its whole TTL again, from now."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__(clock)
        self._ttls: dict[int, int] = {}

    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> float:
        deadline = super().push(queue, key, payload, ttl_ms, prio)
        self._ttls[self.pushed] = ttl_ms
        return deadline

    def restore(self, queue: bytes, packets: Sequence[QueuedPacket]) -> int:
        now = self.now()
        fresh = [
            (
                *p[:DEADLINE],
                now + self._ttls[p[SEQ]] / 1000 if self._ttls[p[SEQ]] else p[DEADLINE],
                p[LEASES],
            )
            for p in packets
        ]
        return super().restore(queue, fresh)  # type: ignore[arg-type]

    def _live(self, entry: tuple[float, int, bytes, bytes]) -> QueuedPacket | None:
        # (Private.) The expiry entry filed at the push no longer stands for the packet.
        packet = super()._live(entry)
        return packet if packet is not None and packet[DEADLINE] == entry[0] else None


class DelayIgnored(QueueStore):
    def push_delayed(
        self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int, delay_ms: int
    ) -> float:
        return self.push(queue, key, payload, ttl_ms, prio)


class TtlFromThePush(QueueStore):
    """Counts a delayed packet's TTL from its push, not from when it is due."""

    def push_delayed(
        self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int, delay_ms: int
    ) -> float:
        ttl_ms = max(ttl_ms - delay_ms, 1) if ttl_ms else 0  # deadline: due + TTL - delay
        return super().push_delayed(queue, key, payload, ttl_ms, prio, delay_ms)


class NewestWhenDue(QueueStore):
    """Files a delayed packet under a new number when it is due, as a push made then."""

    def _arrive(self, queue: bytes, packet: QueuedPacket, now: float) -> bool:
        # (Private.) Renumbered where the store keeps it, then let in as usual.
        self._seq += 1
        self._skipped += 1
        renumbered = (*packet[:SEQ], self._seq, *packet[SEQ + 1 :])
        waiting = self._delayed[queue]
        del waiting.packets[packet[SEQ]]
        waiting.packets[self._seq] = renumbered  # type: ignore[assignment]
        return super()._arrive(queue, renumbered, now)  # type: ignore[arg-type]


class ArrivalsOfferedToNobody(QueueStore):
    """Packets that fall due wait in their queue until something else wakes the subscribers."""

    def take_arrived(self) -> list[bytes]:
        super().take_arrived()
        return []


# -- wrong variants: leases -------------------------------------------------------------------


class ServerWideIds(Leases):
    """Numbers leases across the whole server, as one counter, rather than per connection."""

    last = 0

    def reserve(self, holder: Holder, queue: bytes, lease_ms: int) -> Lease | None:
        holder.last_id = self.last
        lease = super().reserve(holder, queue, lease_ms)
        if lease is not None:
            self.last = lease.lease_id
        return lease


class CloseKeepsLeases(Leases):
    def close(self, holder: Holder) -> None:
        pass


class ReleaseAtOnce(Leases):
    def release(self, holder: Holder, lease_id: int, delay_ms: int) -> bool:
        return super().release(holder, lease_id, 0)


class AttemptOfTheLeastLeased(Leases):
    """A group's attempt from its packet leased least: a newcomer to the key resets it."""

    def reserve(self, holder: Holder, queue: bytes, lease_ms: int) -> Lease | None:
        lease = super().reserve(holder, queue, lease_ms)
        if lease is not None:
            lease.attempt = 1 + min(packet[LEASES] for packet in lease.packets)
        return lease


class LeaseTimeZeroIsZero(Leases):
    def _due(self, lease_ms: int) -> float:
        return self._store.now() + lease_ms / 1000


class ExpiredLeaseIsOver(Leases):
    """A lease whose packets' TTL has all passed counts as over: its ack answers 0."""

    def ack(self, holder: Holder, lease_id: int) -> bool:
        lease, now = holder.leases.get(lease_id), self._store.now()
        if lease is not None and all(now >= p[DEADLINE] > 0 for p in lease.packets):
            return False
        return super().ack(holder, lease_id)


class DeadAtTheRelease(Leases):
    """A group on its last attempt goes to its dead-letter queue at the release, not when the
    release's delay ends."""

    def release(self, holder: Holder, lease_id: int, delay_ms: int) -> bool:
        lease = holder.leases.get(lease_id)
        if lease is not None and lease.attempt >= self.max_deliveries:
            delay_ms = 0
        return super().release(holder, lease_id, delay_ms)


class TooLongForDeadStays(Leases):
    """A group whose dead-letter queue's name would be too long goes back to its own queue."""

    def _bury(self, queue: bytes, packets: Sequence[QueuedPacket]) -> None:
        if len(queue + DEAD_SUFFIX) <= 0xFFFF:
            super()._bury(queue, packets)
        elif self._store.restore(queue, [(*p[:LEASES], 0) for p in packets]):
            self.returned.append(queue)


class ReturnsOfferedToNobody(Leases):
    """Packets coming back wait in their queue until something else wakes the subscribers."""

    def take_returned(self) -> list[bytes]:
        super().take_returned()
        return []


# -- wrong variants: subscriptions ------------------------------------------------------------


class SubscribeGrantsCredit(Subscriptions):
    def subscribe(self, sub: Subscriber, queue: bytes) -> None:
        if queue not in sub.queues:
            sub.credits += 1
        super().subscribe(sub, queue)


class CreditsDoNotAccumulate(Subscriptions):
    def ready(self, sub: Subscriber, credits: int = 1) -> None:
        sub.credits = 0  # "ready" read as a flag, not a count
        super().ready(sub, credits)


class UnsubscribeDropsCredits(Subscriptions):
    def unsubscribe(self, sub: Subscriber, queue: bytes) -> None:
        super().unsubscribe(sub, queue)
        sub.credits = 0


class NewestWaiterFirst(Subscriptions):
    def offer(self, queue: bytes) -> None:
        while waiters := self.waiting(queue):
            if not self._settle(waiters[-1], once=True):
                break


class FirstSubscribedFirst(Subscriptions):
    """Serves the waiter that subscribed first, however late its credit came."""

    def __init__(self, store: QueueStore) -> None:
        super().__init__(store)
        self._subscribed: dict[tuple[int, bytes], int] = {}

    def subscribe(self, sub: Subscriber, queue: bytes) -> None:
        self._subscribed.setdefault((id(sub), queue), len(self._subscribed))
        super().subscribe(sub, queue)

    def offer(self, queue: bytes) -> None:
        while waiters := self.waiting(queue):
            first = min(waiters, key=lambda sub: self._subscribed[id(sub), queue])
            if not self._settle(first, once=True):
                break


class PushWakesNoOne(Subscriptions):
    def offer(self, queue: bytes) -> None:
        pass  # deliveries only happen on ready or subscribe


class DeliversLater(Subscriptions):
    """Serves waiters after the pusher's whole read has been handled, not at once."""

    def offer(self, queue: bytes) -> None:
        trio.lowlevel.current_trio_token().run_sync_soon(super().offer, queue)


class CloseKeepsSubscriptions(Subscriptions):
    def remove(self, sub: Subscriber) -> None:
        pass


class _RecordingStore:
    """A store seen through a window: remembers the queue of the latest pop, and what the pops
    since ``popped`` was last reset returned."""

    def __init__(self, store: QueueStore) -> None:
        self.store = store
        self.last_queue = b""
        self.popped: list[tuple[bytes, list[QueuedPacket]]] = []

    def pop(self, queue: bytes) -> list[QueuedPacket]:
        self.last_queue = queue
        packets = self.store.pop(queue)
        self.popped.append((queue, packets))
        return packets

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


class RequeuesOnClose(Subscriptions):
    """At least once instead of at most once: what a closing connection was sent goes back."""

    def __init__(self, store: QueueStore) -> None:
        self._recording = _RecordingStore(store)
        super().__init__(self._recording)  # type: ignore[arg-type]
        self._sent: dict[int, list[tuple[bytes, list[QueuedPacket]]]] = {}

    def _settle(self, sub: Subscriber, *, once: bool = False) -> bool:
        # Every pop made while settling one subscriber is delivered to it.
        self._recording.popped = []
        served = super()._settle(sub, once=once)
        sent = [(queue, packets) for queue, packets in self._recording.popped if packets]
        self._sent.setdefault(id(sub), []).extend(sent)
        return served

    def remove(self, sub: Subscriber) -> None:
        super().remove(sub)
        for queue, packets in self._sent.pop(id(sub), []):
            for packet in packets:
                key, payload, prio = packet[KEY], packet[PAYLOAD], packet[PRIO]
                self._recording.store.push(queue, key, payload, 0, prio or 1)
            self.offer(queue)


class _QueueNameOrder(_RecordingStore):
    def peek_rank(self, queue: bytes) -> tuple[int, bytes] | None:
        return None if self.store.peek_rank(queue) is None else (0, queue)


class QueuesInNameOrder(Subscriptions):
    """Serves a subscriber's queues in name order instead of by their best packet."""

    def __init__(self, store: QueueStore) -> None:
        super().__init__(_QueueNameOrder(store))  # type: ignore[arg-type]


# -- wrong variants: the server's framing, faked by a proxy in front of it -------------------
#
# These faults live in how a server cuts its byte stream into frames. Rather than reach into
# our server's decoder, a proxy between the fixtures and our server rewrites the bytes. It
# finds frame boundaries with its own few lines, from the protocol's layouts.

_PUSH_HEADER = struct.Struct(">HHBHH")  # after the opcode: queue_len, ttl, prio, key/payload_len
_OPTIONS_HEADER = struct.Struct(">HIIBHH")  # a 71's: queue_len, ttl, delay, prio, key/payload_len
_MAX_DELAY_MS = 2_592_000_000
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_FIXED_SIZES = {0x4B: 9, 0x4E: 13, 0x54: 13}  # ack, release, touch: their whole length
_MAX_LEASE_MS = 86_400_000


def frame_end(data: bytes | bytearray, pos: int) -> int | None:
    """Where the client frame at ``pos`` ends; ``None`` if incomplete; ``ValueError`` if the
    byte at ``pos`` is no opcode."""
    opcode = data[pos]
    if opcode in (0x41, 0x21):
        return pos + 1
    if opcode in _FIXED_SIZES:
        end = pos + _FIXED_SIZES[opcode]
    elif opcode in (0x52, 0x53):  # a u32 time, then a named frame's fields
        if len(data) - pos < 7:
            return None
        end = pos + 7 + _U16.unpack_from(data, pos + 5)[0]
    elif opcode in (0x50, 0x73, 0x75):
        if len(data) - pos < 3:
            return None
        end = pos + 3 + _U16.unpack_from(data, pos + 1)[0]
    elif opcode == 0x70:
        if len(data) - pos < 10:
            return None
        queue_len, _, _, key_len, payload_len = _PUSH_HEADER.unpack_from(data, pos + 1)
        end = pos + 10 + queue_len + key_len + payload_len
    elif opcode == 0x71:
        if len(data) - pos < 16:
            return None
        queue_len, _, _, _, key_len, payload_len = _OPTIONS_HEADER.unpack_from(data, pos + 1)
        end = pos + 16 + queue_len + key_len + payload_len
    else:
        raise ValueError(f"no opcode {opcode:#x}")
    return end if end <= len(data) else None


def reply_end(data: bytes | bytearray, pos: int) -> int | None:
    """Where the reply at ``pos`` ends; ``None`` if incomplete."""
    if len(data) - pos < 2:
        return None
    (count,) = _U16.unpack_from(data, pos)
    pos += 2
    for _ in range(count):
        if len(data) - pos < 4:
            return None
        pos += 4 + sum(_U16.unpack_from(data, pos + 2 * i)[0] for i in range(2))
    return pos if pos <= len(data) else None


# A filter gets the bytes held back so far (and may change them) and the new chunk, and
# returns what to pass on.
Filter = Callable[[bytearray, bytes], bytes]


def skip_unknown_opcodes(held: bytearray, chunk: bytes) -> bytes:
    held += chunk
    out, pos = bytearray(), 0
    while pos < len(held):
        try:
            end = frame_end(held, pos)
        except ValueError:
            pos += 1  # drop the byte and carry on
            continue
        if end is None:
            break
        out += held[pos:end]
        pos = end
    del held[:pos]
    return bytes(out)


def whole_frames_only(held: bytearray, chunk: bytes) -> bytes:
    """Treats each read as whole frames: a frame split across reads is lost."""
    pos = 0
    try:
        while pos < len(chunk) and (end := frame_end(chunk, pos)) is not None:
            pos = end
    except ValueError:
        return chunk  # let the server see the bad byte
    return chunk[:pos]


def _frames(held: bytearray, chunk: bytes) -> list[bytearray]:
    """The whole frames of what is held and the new chunk; the rest stays held."""
    held += chunk
    frames, pos = [], 0
    while pos < len(held) and (end := frame_end(held, pos)) is not None:
        frames.append(held[pos:end])
        pos = end
    del held[:pos]
    return frames


def acks_grant_credits(held: bytearray, chunk: bytes) -> bytes:
    """Each ack is followed by a ready, as if an ack granted a delivery credit."""
    return b"".join(bytes(f) + (b"\x41" if f[0] == 0x4B else b"") for f in _frames(held, chunk))


def lease_times_clamped(held: bytearray, chunk: bytes) -> bytes:
    """Lease times and delays above 24 h are cut to 24 h: the server never sees them."""
    frames = _frames(held, chunk)
    for frame in frames:
        at = {0x52: 1, 0x53: 1, 0x4E: 9, 0x54: 9}.get(frame[0])
        if at is not None and _U32.unpack_from(frame, at)[0] > _MAX_LEASE_MS:
            _U32.pack_into(frame, at, _MAX_LEASE_MS)
    return b"".join(map(bytes, frames))


def delays_clamped(held: bytearray, chunk: bytes) -> bytes:
    """Delays above 30 days are cut to 30 days: the server never sees them."""
    frames = _frames(held, chunk)
    for frame in frames:
        if frame[0] == 0x71 and _U32.unpack_from(frame, 7)[0] > _MAX_DELAY_MS:
            _U32.pack_into(frame, 7, _MAX_DELAY_MS)
    return b"".join(map(bytes, frames))


class MixingTolerated:
    """Drops, per connection, the frames decision 18 forbids, so the server never sees them:
    a pop, subscribe or reserve after a leased subscribe, a leased subscribe after a plain
    subscribe. A filter per proxied connection, told apart by its ``held`` buffer."""

    def __init__(self) -> None:
        self._mode: dict[int, int] = {}  # id(held) -> the kind of subscribe it made, if any

    def __call__(self, held: bytearray, chunk: bytes) -> bytes:
        kept = []
        for frame in _frames(held, chunk):
            mode = self._mode.get(id(held))
            if mode == 0x53 and frame[0] in (0x50, 0x73, 0x52):
                continue
            if mode == 0x73 and frame[0] == 0x53:
                continue
            if frame[0] in (0x53, 0x73) and mode is None:
                self._mode[id(held)] = frame[0]
            kept.append(bytes(frame))
        return b"".join(kept)


_LEASE_OPCODES = frozenset({0x52, 0x4B, 0x4E, 0x54})


class PlainAndLeaseFramesMixed:
    """Drops, per connection, the frames decision 20 forbids beyond decision 18's: a reserve,
    ack, release or touch after a plain subscribe, a plain subscribe after one of those."""

    def __init__(self) -> None:
        self._first: dict[int, str] = {}  # id(held) -> "plain" or "lease", whichever came first

    def __call__(self, held: bytearray, chunk: bytes) -> bytes:
        kept = []
        for frame in _frames(held, chunk):
            kind = "plain" if frame[0] == 0x73 else "lease" if frame[0] in _LEASE_OPCODES else None
            if kind is not None and self._first.setdefault(id(held), kind) != kind:
                continue
            kept.append(bytes(frame))
        return b"".join(kept)


def unsubscribe_undoes_subscribe(held: bytearray, chunk: bytes) -> bytes:
    """Hides from the server a subscribe and the unsubscribe of its queue in the same write,
    as if an unsubscribe undid a plain subscription (decision 18 before decision 20)."""
    frames = _frames(held, chunk)
    undone = {bytes(frame[3:]) for frame in frames if frame[0] == 0x75}
    return b"".join(
        bytes(frame)
        for frame in frames
        if not (frame[0] in (0x73, 0x75) and bytes(frame[3:]) in undone)
    )


def drop_empty_replies(held: bytearray, chunk: bytes) -> bytes:
    held += chunk
    out, pos = bytearray(), 0
    while (end := reply_end(held, pos)) is not None:
        if held[pos:end] != b"\0\0":  # 00 00 only ever answers a pop
            out += held[pos:end]
        pos = end
    del held[:pos]
    return bytes(out)


async def _pipe(source: trio.SocketStream, sink: trio.SocketStream, filter: Filter | None) -> None:
    held = bytearray()
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        while chunk := await source.receive_some(1 << 16):
            data = filter(held, chunk) if filter else chunk
            if data:
                await sink.send_all(data)


class Proxy:
    """Forwards connections to our server, filtering each direction; when either side closes,
    closes both."""

    def __init__(self, upstream: int, to_server: Filter | None, to_client: Filter | None) -> None:
        self.upstream = upstream
        self.to_server = to_server
        self.to_client = to_client

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host=HOST)
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        server = await trio.open_tcp_stream(HOST, self.upstream)
        async with client, server, trio.open_nursery() as nursery:

            async def pipe(source: Any, sink: Any, filter: Filter | None) -> None:
                await _pipe(source, sink, filter)
                nursery.cancel_scope.cancel()

            nursery.start_soon(pipe, client, server, self.to_server)
            nursery.start_soon(pipe, server, client, self.to_client)


def clock() -> float:
    return trio.current_time()


def with_subscriptions(
    kind: type[Subscriptions], *, watches_pops: bool = False
) -> Callable[[], PinpriqServer]:
    """A server whose subscriptions are ``kind``. One that ``watches_pops`` (it learns what it
    delivered from the store's ``pop``) runs on ``QueueStore``: on the packed store a plain
    subscriber's delivery is written by the store itself (``pop_delivery``), never a pop."""

    def build() -> PinpriqServer:
        server = PinpriqServer(QueueStore(clock) if watches_pops else None)
        server.broker.subscriptions = kind(server.broker.store)
        return server

    return build


def with_store(build_store: Callable[[], QueueStore]) -> Callable[[], PinpriqServer]:
    return lambda: PinpriqServer(build_store())


def with_leases(kind: type[Leases]) -> Callable[[], PinpriqServer]:
    def build() -> PinpriqServer:
        server = PinpriqServer()
        server.broker.leases = kind(server.broker.store)
        return server

    return build


@attrs.frozen
class Variant:
    build: Callable[[], PinpriqServer]
    catchers: set[str]  # fixtures that must fail
    to_server: Filter | None = None  # a proxy's filters, if it needs one
    to_client: Filter | None = None


VARIANTS: dict[str, Variant] = {
    "oldest wins ties": Variant(
        with_store(lambda: OldestWinsTies(clock)),
        {"newest-wins-ties", "credits-accumulate"},
    ),
    "prio 255 is the highest": Variant(
        with_store(lambda: MappedPrio(clock, lambda p: 256 - p if p else 0)),
        {"priority-order"},
    ),
    "prio 0 is selectable": Variant(
        with_store(lambda: MappedPrio(clock, lambda p: p or 256)),
        {"pop-prio0-only", "delivery-is-key-group"},
    ),
    "no key grouping": Variant(
        with_store(lambda: QueueStore(clock, max_pop=1)),
        {"key-group", "pop-prio0-only", "delivery-is-key-group"},
    ),
    "key group returned newest first": Variant(
        with_store(lambda: ReorderedGroup(clock, lambda r: r[:1] + r[:0:-1])),
        {"key-group"},
    ),
    "key group in push order, selected not first": Variant(
        with_store(lambda: ReorderedGroup(clock, lambda r: sorted(r, key=lambda p: p[SEQ]))),
        {"key-group", "pop-prio0-only"},
    ),
    "replies not capped at 65,535 packets": Variant(
        with_store(lambda: QueueStore(clock, max_pop=1 << 20)),
        {"reply-max-packets"},
    ),
    "ttl 0 expires at once": Variant(
        with_store(lambda: MappedTtl(clock, lambda ttl: ttl or 1)),
        {"ttl-zero-never-expires"},
    ),
    "ttl in seconds": Variant(
        with_store(lambda: MappedTtl(clock, lambda ttl: min(ttl * 1000, 0xFFFF))),
        {"ttl-expiry", "ttl-expired-sibling", "ttl-expired-not-delivered"},
    ),
    "ttl ignored": Variant(
        with_store(lambda: NoExpiry(clock)),
        {"ttl-expiry", "ttl-zero-never-expires"},
    ),
    "queue names are C strings": Variant(
        with_store(lambda: CStringNames(clock)),
        {"queue-name-bytes"},
    ),
    "subscribe grants a credit": Variant(
        with_subscriptions(SubscribeGrantsCredit),
        {"subscribe-grants-no-credit"},
    ),
    "credits do not accumulate": Variant(
        with_subscriptions(CreditsDoNotAccumulate),
        {"credits-accumulate", "fifo-subscribers"},
    ),
    "unsubscribe drops credits": Variant(
        with_subscriptions(UnsubscribeDropsCredits),
        {"unsubscribe-keeps-credits"},
    ),
    "newest waiter served first": Variant(
        with_subscriptions(NewestWaiterFirst),
        {"fifo-subscribers"},
    ),
    "first subscriber served first, whenever its credit came": Variant(
        with_subscriptions(FirstSubscribedFirst),
        {"fifo-wait-starts-with-credit"},
    ),
    "a push wakes no waiting subscriber": Variant(
        with_subscriptions(PushWakesNoOne),
        {"subscribe-delivers", "delivery-before-next-frame"},
    ),
    "deliveries wait for the pusher's read to be handled": Variant(
        with_subscriptions(DeliversLater),
        {"delivery-before-next-frame", "delivery-then-reply"},
    ),
    "subscribed queues served in name order": Variant(
        with_subscriptions(QueuesInNameOrder),
        {"best-across-queues"},
    ),
    "closing keeps subscriptions": Variant(
        with_subscriptions(CloseKeepsSubscriptions),
        {"close-drops-subscription"},
    ),
    "delivered packets requeued when the connection closes": Variant(
        with_subscriptions(RequeuesOnClose, watches_pops=True),
        {"at-most-once"},
    ),
    "empty pop gets no reply": Variant(
        PinpriqServer,
        {"pop-missing-queue", "push-pop"},
        to_client=drop_empty_replies,
    ),
    "unknown opcode skipped": Variant(
        PinpriqServer,
        {"unknown-opcode-closes", "unknown-opcodes"},
        to_server=skip_unknown_opcodes,
    ),
    "a frame split across reads is lost": Variant(
        PinpriqServer,
        {"split-every-byte"},
        to_server=whole_frames_only,
    ),
    "lease ids numbered server-wide": Variant(
        with_leases(ServerWideIds),
        {"lease-ids-per-connection"},
    ),
    "leases kept when their connection closes": Variant(
        with_leases(CloseKeepsLeases),
        {"lease-close-returns"},
    ),
    "release ignores its delay": Variant(
        with_leases(ReleaseAtOnce),
        {"lease-release-delay"},
    ),
    "a packet coming back is filed as the newest": Variant(
        with_store(lambda: NewestOnReturn(clock)),
        {"lease-push-order"},
    ),
    "a packet coming back gets a fresh TTL": Variant(
        with_store(lambda: FreshTtlOnReturn(clock)),
        {"lease-ttl"},
    ),
    "attempt from the packet leased least": Variant(
        with_leases(AttemptOfTheLeastLeased),
        {"lease-attempts"},
    ),
    "no dead letters": Variant(
        partial(PinpriqServer, max_deliveries=0),
        {"lease-dead-letter"},
    ),
    "lease time 0 taken as 0 ms": Variant(
        with_leases(LeaseTimeZeroIsZero),
        {"reserve-ack"},
    ),
    "a packet coming back waits for the next push to be delivered": Variant(
        with_leases(ReturnsOfferedToNobody),
        {"lease-return-offered"},
    ),
    "a lease whose packets expired is over": Variant(
        with_leases(ExpiredLeaseIsOver),
        {"lease-ttl"},
    ),
    "dead-lettered at the release, not when its delay ends": Variant(
        with_leases(DeadAtTheRelease),
        {"lease-dead-letter-group"},
    ),
    "a group whose dead-letter name is too long stays in its queue": Variant(
        with_leases(TooLongForDeadStays),
        {"lease-dead-letter-long-name"},
    ),
    "acks grant delivery credits": Variant(
        PinpriqServer,
        {"leased-subscribe"},
        to_server=acks_grant_credits,
    ),
    "pop, subscribe or reserve tolerated on a leased connection": Variant(
        PinpriqServer,
        {"leased-mixing-closes"},
        to_server=MixingTolerated(),
    ),
    "lease frames and a plain subscribe tolerated on one connection": Variant(
        PinpriqServer,
        {"plain-lease-mixing-closes"},
        to_server=PlainAndLeaseFramesMixed(),
    ),
    "an unsubscribe undoes a plain subscription": Variant(
        PinpriqServer,
        {"leased-mixing-closes"},
        to_server=unsubscribe_undoes_subscribe,
    ),
    "lease times above 24 h accepted": Variant(
        PinpriqServer,
        {"lease-time-malformed"},
        to_server=lease_times_clamped,
    ),
    "a 71's TTL read as 16 bits": Variant(
        with_store(lambda: MappedTtl(clock, lambda ttl: ttl & 0xFFFF)),
        {"push-options"},
    ),
    "delays ignored": Variant(
        with_store(lambda: DelayIgnored(clock)),
        {"delayed-push", "delayed-push-key-group", "delayed-push-ttl"},
    ),
    "a delayed packet's TTL counted from its push": Variant(
        with_store(lambda: TtlFromThePush(clock)),
        {"delayed-push-ttl"},
    ),
    "a delayed packet filed as the newest when due": Variant(
        with_store(lambda: NewestWhenDue(clock)),
        {"delayed-push", "delayed-push-key-group"},
    ),
    "a due packet waits for the next push to be delivered": Variant(
        with_store(lambda: ArrivalsOfferedToNobody(clock)),
        {"delayed-push-delivered"},
    ),
    "delays above 30 days accepted": Variant(
        PinpriqServer,
        {"delayed-push-too-long"},
        to_server=delays_clamped,
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
async def test_wrong_variant_fails_the_fixtures_that_pin_its_fault(
    name: str, nursery: trio.Nursery
) -> None:
    variant = VARIANTS[name]
    port = await start(nursery, variant.build())
    if variant.to_server or variant.to_client:
        proxy = Proxy(port, variant.to_server, variant.to_client)
        port = await nursery.start(proxy.serve)
    fixtures = [fixture for fixture in FIXTURES if fixture.name in variant.catchers]
    assert len(fixtures) == len(variant.catchers), "a variant names a fixture that does not exist"
    # A short step timeout: these fixtures are meant to fail, and a right answer takes
    # milliseconds (our server passes each of them in test_our_server_passes_...).
    results = await run_suite(fixtures, HOST, port, step_timeout=0.5)
    assert [result.line() for result in results if result.passed] == []


async def test_a_server_that_checks_no_token_fails_the_token_fixtures(
    nursery: trio.Nursery,
) -> None:
    # The runner is told the server has a token; the server takes anything.
    port = await start(nursery, PinpriqServer(frame_timeout=1))
    catchers = {"auth-wrong-token", "auth-frame-before-auth", "auth-timeout", "auth-second"}
    fixtures = [fixture for fixture in WITH_TOKEN if fixture.name in catchers]
    results = await run_suite(fixtures, HOST, port, token=TOKEN, step_timeout=0.5)
    assert [result.line() for result in results if result.passed] == []


async def test_the_proxy_alone_changes_nothing(nursery: trio.Nursery) -> None:
    port = await start(nursery, PinpriqServer())
    port = await nursery.start(Proxy(port, None, None).serve)
    proxied = {
        name
        for variant in VARIANTS.values()
        if variant.to_server or variant.to_client
        for name in variant.catchers
    }
    fixtures = [fixture for fixture in FIXTURES if fixture.name in proxied]
    assert failures(await run_suite(fixtures, HOST, port, step_timeout=PASSING_STEP_TIMEOUT)) == []


# -- the command line, as a subprocess --------------------------------------------------------


async def conformance(*args: str) -> trio.Process:
    environ = {k: v for k, v in os.environ.items() if k != "PINPRIQ_AUTH_TOKEN"}
    return await trio.run_process(
        [sys.executable, "-m", "pinpriq.conformance", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=environ,
    )


async def test_command_line_passes_against_our_server(nursery: trio.Nursery) -> None:
    port = await start(nursery, PinpriqServer())
    done = await conformance(f"{HOST}:{port}", "push-pop", "key-group")
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().splitlines()[0].startswith("PASS push-pop (")
    assert done.stdout.decode().splitlines()[-1].startswith("2 fixtures: 2 passed, 0 failed")


async def test_command_line_reports_fixtures_for_another_server_as_not_run(
    nursery: trio.Nursery,
) -> None:
    port = await start(nursery, PinpriqServer(token=TOKEN))
    names = ["push-pop", "auth-right-token", "auth-without-token"]
    done = await conformance(f"{HOST}:{port}", *names, "--token", TOKEN.decode())
    assert done.returncode == 0, done.stdout
    lines = done.stdout.decode().splitlines()
    assert lines[0].startswith("PASS push-pop (")  # authenticated by the runner
    assert lines[1].startswith("PASS auth-right-token (")
    assert lines[2] == "NOT RUN auth-without-token: needs a server without a token"
    assert lines[-1].startswith("3 fixtures: 2 passed, 0 failed, 1 not run")
    done = await conformance(f"{HOST}:{port}", "auth-right-token")  # no --token
    assert done.stdout.decode().splitlines()[0] == (
        "NOT RUN auth-right-token: needs a server with a token (give --token)"
    )


async def test_command_line_without_a_token_for_a_server_with_one_asks_for_it(
    nursery: trio.Nursery,
) -> None:
    port = await start(nursery, PinpriqServer(token=TOKEN))
    done = await conformance(f"{HOST}:{port}", "push-pop", "key-group")
    assert done.returncode == 1
    assert done.stdout.decode().splitlines()[-1].startswith("2 fixtures: 0 passed, 2 failed")
    assert done.stderr.decode() == (
        "pinpriq-conformance: the server closed the connection without answering a sync (21): "
        "does it need --token? (or PINPRIQ_AUTH_TOKEN; a protocol 1.0 server, which has no "
        "sync, closes it too)\n"
    )


async def test_command_line_fails_against_a_wrong_server(nursery: trio.Nursery) -> None:
    port = await start(nursery, PinpriqServer(OldestWinsTies(clock)))
    done = await conformance(f"{HOST}:{port}", "push-pop", "newest-wins-ties")
    assert done.returncode == 1
    lines = done.stdout.decode().splitlines()
    assert lines[1].startswith("FAIL newest-wins-ties (")
    assert "expected" in lines[1]
    assert "received" in lines[1]
    assert lines[-1].startswith("2 fixtures: 1 passed, 1 failed")
    assert done.stderr == b""  # it answered the runner's sync: no hint about a token


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["localhost"], "bad address 'localhost'"),
        (["127.0.0.1:99999"], "bad address"),
        (["127.0.0.1:7000", "no-such-fixture"], "no fixture named no-such-fixture"),
        (["127.0.0.1:7000", "--fixtures", "/nonexistent"], "no fixtures"),
    ],
)
async def test_command_line_usage_errors_are_one_line(args: list[str], message: str) -> None:
    done = await conformance(*args)
    assert done.returncode == 2
    assert done.stdout == b""
    [line] = done.stderr.decode().splitlines()
    assert line.startswith("pinpriq-conformance: ")
    assert message in line


async def test_command_line_reports_a_refused_connection() -> None:
    # A port that was free a moment ago: nothing listens there now.
    with trio.socket.socket() as sock:
        await sock.bind((HOST, 0))
        port = sock.getsockname()[1]
    done = await conformance(f"{HOST}:{port}")
    assert done.returncode == 2
    assert done.stderr.decode() == (
        f"pinpriq-conformance: cannot connect to {HOST}:{port}: Connection refused\n"
    )
