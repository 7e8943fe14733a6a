"""The client processes of a run: a throughput client sending its plan, and for subscribe the
publishers and the subscribers. Each runs in a process of its own, on plain blocking sockets;
it waits on the barrier shared with its siblings and the parent, then only sends and counts,
and returns its figures (start, end, CPU time, round-trip or delivery times) as a dict.

What the processes share (``Sync``) is defined here; starting them, and everything else the
parent does, is ``runner``'s.
"""

from __future__ import annotations

import array
import os
import random
import select
import selectors
import socket
import ssl
import struct
import time
from collections.abc import Iterable
from typing import Any

import attrs

from pinpriq.bench.dialects import (
    PinpriqDialect,
    PinpriqReplies,
    Replies,
    ReplyShape,
    count_pinpriq_replies,
    dialect_of,
)
from pinpriq.bench.plans import Batch, build_plan, draw_prios
from pinpriq.bench.workload import BenchError, Workload, share
from pinpriq.wire import (
    READY,
    Auth,
    Packet,
    Push,
    ReplyDecoder,
    Subscribe,
    encode,
    encode_reply,
)

RECEIVE_SIZE = 256 * 1024
#: Seconds the parent waits for every client to connect and prefill.
SETUP_SECONDS = 900.0
#: Seconds subscribers keep reading after the publishers finish, for deliveries in flight.
SUBSCRIBER_GRACE = 2.0


@attrs.define
class Sync:
    """What the processes of one run share."""

    barrier: Any  # multiprocessing.Barrier
    progress: Any  # RawArray of int64, one slot per process
    published: Any  # multiprocessing.Event, set when every publisher is done
    subscriber_slots: range

    def delivered(self) -> int:
        return sum(self.progress[i] for i in self.subscriber_slots)


def _connect(w: Workload) -> socket.socket:
    """A connected socket: over TLS if the workload says so, and authenticated if it has a
    token (the auth's ``00 00`` read here, before anything is counted)."""
    try:
        sock = socket.create_connection((w.host, w.port), timeout=w.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if w.tls:
            context = ssl.create_default_context(cafile=w.tls_ca)
            sock = context.wrap_socket(sock, server_hostname=w.host)
        if w.token is not None:
            sock.sendall(encode(Auth(w.token)))
            answer = b""
            while len(answer) < 2 and (data := sock.recv(2 - len(answer))):
                answer += data
            if answer != b"\x00\x00":
                raise BenchError(f"{w.host}:{w.port} did not take the token")
    except OSError as error:
        raise BenchError(f"cannot connect to {w.host}:{w.port}: {error}") from None
    return sock


class _Link:
    """A blocking socket (TLS or not) and the replies counted on it."""

    def __init__(self, w: Workload, replies: Replies) -> None:
        self.sock = _connect(w)
        self.tls = isinstance(self.sock, ssl.SSLSocket)
        # A Python-level timeout makes every read that would block a poll() plus a recv();
        # a blocking socket with a kernel timeout costs one syscall and still cannot hang.
        self.sock.settimeout(None)
        seconds, fraction = divmod(w.timeout, 1)
        timeval = struct.pack("ll", int(seconds), int(fraction * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        self.counter = replies
        self.replies = self.packets = self.empty = 0

    def receive(self, flags: int = 0) -> bool:
        """Read once and count; False when nothing was ready (non-blocking ``flags``)."""
        if self.tls and flags:  # an SSL socket takes no recv flags: look before reading
            if not self.sock.pending() and not select.select([self.sock], [], [], 0)[0]:  # type: ignore[attr-defined]
                return False
            flags = 0
        try:
            data = self.sock.recv(RECEIVE_SIZE, flags)
        except (BlockingIOError, ssl.SSLWantReadError):  # nothing, or SO_RCVTIMEO passed
            if flags & socket.MSG_DONTWAIT:
                return False
            raise BenchError("timed out waiting for the server") from None
        if not data:
            raise BenchError("the server closed the connection")
        replies, packets, empty = self.counter.feed(data)
        self.replies += replies
        self.packets += packets
        self.empty += empty
        return True

    def wait_for(self, replies: int) -> None:
        while self.replies < replies:
            self.receive()

    def stream(self, chunks: Iterable[bytes], replies: int) -> None:
        """Write everything, reading whatever is ready between writes, then wait."""
        wanted = self.replies + replies
        for chunk in chunks:
            self.sock.sendall(chunk)
            while self.receive(socket.MSG_DONTWAIT):
                pass
        self.wait_for(wanted)


def _run_batches(
    link: _Link, batches: list[Batch], progress: Any, slot: int, op_ns: float = 0.0
) -> array.array[int]:
    """The timed loop: send a batch, wait for its replies, note its round trip. With
    ``op_ns``, batches leave on a schedule of one op per ``op_ns`` instead of at once."""
    times = array.array("q")
    sendall, receive, now = link.sock.sendall, link.receive, time.monotonic_ns
    done = 0
    begun = now()
    for data, ops, replies in batches:
        if op_ns:
            _sleep_until(begun + int(done * op_ns))
        started = now()
        if data:
            sendall(data)
        wanted = link.replies + replies
        while link.replies < wanted:
            receive()
        times.append(now() - started)
        done += ops
        progress[slot] = done
    return times


def throughput_client(w: Workload, index: int, queue: bytes, sync: Sync) -> dict[str, Any]:
    plan = build_plan(w, index, queue)
    link = _Link(w, dialect_of(w).replies(w))
    with link.sock:
        link.stream(plan.fill, plan.fill_replies)
        link.replies = link.packets = link.empty = 0
        sync.barrier.wait(SETUP_SECONDS)
        cpu, started = time.process_time(), time.monotonic_ns()
        op_ns = w.clients * 1e9 / w.rate if w.rate else 0.0
        times = _run_batches(link, plan.batches, sync.progress, index, op_ns)
        ended, cpu = time.monotonic_ns(), time.process_time() - cpu
    return {
        "ops": sum(ops for _, ops, _ in plan.batches),
        "packets": link.packets,
        "empty": link.empty - plan.barriers,
        "start": started,
        "end": ended,
        "cpu": cpu,
        "times": times.tobytes() if w.scenario != "push-stream" else b"",
    }


# -- subscribe: publishers and subscribers ------------------------------------------------------


def _stamped_heads(w: Workload, queue: bytes, first: int, count: int, index: int) -> list[bytes]:
    """Push frames minus their payload and queue, which are added with the send time."""
    rng = random.Random(f"{w.seed}:{index}")
    prios = draw_prios(w, rng, count)
    heads = []
    tail_size = w.payload_size + len(queue)
    for i in range(count):
        frame = encode(Push(queue, w.key(first + i), w.payload(first + i), w.ttl_ms, prios[i]))
        heads.append(frame[:-tail_size])
    return heads


def publisher(w: Workload, index: int, queue: bytes, sync: Sync) -> dict[str, Any]:
    first, count = share(w.ops, w.clients, index)
    heads = _stamped_heads(w, queue, first, count, index)
    padding = b"." * (w.payload_size - 8)
    barrier = PinpriqDialect.barrier or b""
    interval = w.pipeline * w.clients / w.rate if w.rate else 0.0
    link = _Link(w, PinpriqReplies())
    with link.sock:
        sync.barrier.wait(SETUP_SECONDS)
        cpu, started = time.process_time(), time.monotonic_ns()
        for number, i in enumerate(range(0, count, w.pipeline)):
            if interval:
                _sleep_until(started + int(number * interval * 1e9))
            tail = time.monotonic_ns().to_bytes(8, "big") + padding + queue
            link.sock.sendall(tail.join(heads[i : i + w.pipeline]) + tail + barrier)
            link.wait_for(number + 1)
            sync.progress[index] = i + w.pipeline
        ended, cpu = time.monotonic_ns(), time.process_time() - cpu
    return {"ops": count, "start": started, "end": ended, "cpu": cpu}


def _sleep_until(deadline_ns: int) -> None:
    delay = (deadline_ns - time.monotonic_ns()) / 1e9
    if delay > 0:
        time.sleep(delay)


class _Deliveries:
    """The deliveries arriving on one subscribed connection, and their send stamps.

    Runs of one-packet deliveries of the workload's sizes (nearly all of them) are recognised
    by ``ReplyShape`` and their stamps unpacked in C; whatever else arrives is decoded by
    ``wire.ReplyDecoder``, which is only ever handed whole replies, so the two never split one.
    """

    def __init__(self, w: Workload, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._decoder = ReplyDecoder()
        template = encode_reply([Packet(bytes(w.key_size), bytes(w.payload_size))])
        self._shape = ReplyShape.of(template, [range(6, len(template))])
        # One record per delivery: skip count and lengths and key, read the stamp, skip the rest.
        self._stamp = struct.Struct(f">{6 + w.key_size}xQ{w.payload_size - 8}x")

    def read(self) -> tuple[int, int, list[int]]:
        """Take what arrived: (when, deliveries, the send stamp of each packet)."""
        data = self.sock.recv(RECEIVE_SIZE)
        now = time.monotonic_ns()
        if not data:
            raise BenchError("the server closed a subscriber's connection")
        buf = self._buf
        buf += data
        runs = self._shape.count(buf)
        fast = runs * self._shape.size
        stamps = [stamp for (stamp,) in self._stamp.iter_unpack(bytes(buf[:fast]))]
        used, replies, _, _ = count_pinpriq_replies(buf, fast)
        self._decoder.feed(bytes(buf[fast:used]))
        for reply in self._decoder:
            stamps += (int.from_bytes(packet.payload[:8], "big") for packet in reply)
        del buf[:used]
        return now, runs + replies, stamps


def _subscribe(w: Workload, queue: bytes, count: int) -> list[_Deliveries]:
    """``count`` subscribed connections, each holding ``prefetch`` credits. A barrier pop after
    the subscribe proves the server has applied it before anything is published."""
    subscribers = []
    for _ in range(count):
        link = _Link(w, PinpriqReplies())
        link.sock.sendall(encode(Subscribe(queue)) + (PinpriqDialect.barrier or b""))
        link.wait_for(1)
        link.sock.sendall(encode(READY) * w.prefetch)
        subscribers.append(_Deliveries(w, link.sock))
    return subscribers


class _SubscriberTally:
    def __init__(self) -> None:
        self.latencies = array.array("q")
        self.deliveries = self.packets = 0
        self.last = 0

    def read(self, subscriber: _Deliveries) -> None:
        """Take what arrived, time each packet from its stamp, hand back one credit each."""
        now, deliveries, stamps = subscriber.read()
        self.latencies.extend([now - stamp for stamp in stamps])
        self.packets += len(stamps)
        if deliveries:
            subscriber.sock.sendall(encode(READY) * deliveries)
            self.deliveries += deliveries
            self.last = now


def subscriber_process(w: Workload, index: int, queue: bytes, sync: Sync) -> dict[str, Any]:
    slot = w.clients + index
    _, count = share(w.subscribers, subscriber_processes(w), index)
    subscribers = _subscribe(w, queue, count)
    tally = _SubscriberTally()
    with selectors.DefaultSelector() as selector:
        for subscriber in subscribers:
            selector.register(subscriber.sock, selectors.EVENT_READ, subscriber)
        sync.barrier.wait(SETUP_SECONDS)
        cpu, started = time.process_time(), time.monotonic_ns()
        quiet_since: float | None = None
        while sync.delivered() < w.ops:
            events = selector.select(0.05)
            for key, _ in events:
                tally.read(key.data)
            sync.progress[slot] = tally.packets
            if not sync.published.is_set() or events:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > SUBSCRIBER_GRACE:
                break  # publishing ended and nothing more comes: report the shortfall
        cpu = time.process_time() - cpu
    for subscriber in subscribers:
        subscriber.sock.close()
    return {
        "deliveries": tally.deliveries,
        "packets": tally.packets,
        "start": started,
        "last": tally.last,
        "cpu": cpu,
        "times": tally.latencies.tobytes(),
    }


def subscriber_processes(w: Workload) -> int:
    return min(w.subscribers, os.cpu_count() or 1)
