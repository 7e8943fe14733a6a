"""``pinpriq-bench``: load generator and timer for a pinpriq (or Redis) server.

The pinpriq counterpart of redis-benchmark. It owns the measuring side only: what each client
sends, how fast the server answers, and how the figures are aggregated and shown. Frames come
from ``pinpriq.wire.encode``; subscription deliveries are read with ``wire.ReplyDecoder``.

Theory of operation. Every client connection runs in a process of its own (``multiprocessing``),
so the generator has as many cores as the machine gives it and is not what is measured. A
client builds every request it will send as bytes *before* the clock starts (P frames joined
per batch), connects with a plain blocking socket, queues its share of the prefill, and waits
on a barrier shared with its siblings and the parent. After the barrier it only writes
precomputed batches and counts replies. Each client reports its start and end (``monotonic_ns``,
which is system-wide on Linux, so the processes' clocks agree), its CPU time, and its batch
round-trip times; the parent aggregates: ops/s over the union of the clients' windows, latency
percentiles over all batches (one op per batch at ``-P 1``).

Replies to throughput runs are *counted*, not decoded into packets: building a ``Packet`` per
reply costs the generator about 2 us, comparable to what the server spends per pop, and on a
small machine the generator shares cores with the server. ``count_pinpriq_replies`` walks the
reply layout (``u16 count``, then ``u16 key_len``, ``u16 payload_len``, bytes) without copying;
the tests check it against ``ReplyDecoder``.

``--redis`` sends the same workload to a Redis server as ZADD / ZPOPMIN (a hand-written RESP
encoder, as lean as the pinpriq side), so both servers are driven by the same generator code.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import ctypes
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import random
import selectors
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TextIO

import attrs

from pinpriq import __version__
from pinpriq.cli import OneLineParser, port_number
from pinpriq.wire import (
    MAX_PRIO,
    MAX_TTL_MS,
    READY,
    Packet,
    Pop,
    Push,
    ReplyDecoder,
    Subscribe,
    encode,
    encode_reply,
)

__all__ = [
    "SCENARIOS",
    "BenchError",
    "ReplyShape",
    "Workload",
    "count_pinpriq_replies",
    "main",
    "resp_command",
    "run_scenario",
]

SCENARIOS = ("push", "push-stream", "pop", "mix", "subscribe")
SCENARIO_HELP = {
    "push": "P pushes then one pop of an empty queue as a barrier; wait for its reply",
    "push-stream": "every push sent without waiting, then one barrier",
    "pop": "pops from a queue prefilled with --prefill + N packets",
    "mix": "pushes and pops alternating, P per batch, on a queue of depth --prefill",
    "subscribe": "S subscribers with prefetch k; -c publishers push N timestamped packets",
}
#: Queue popped as a barrier: always empty, so its reply is ``00 00``.
BARRIER_QUEUE = b"pinpriq-bench-barrier"
RECEIVE_SIZE = 256 * 1024
#: Frames per write when streaming pushes (prefill, push-stream): big writes, and a progress
#: update per write.
STREAM_FRAMES = 4096
#: Seconds the parent waits for every client to connect and prefill.
SETUP_SECONDS = 900.0
#: Seconds subscribers keep reading after the publishers finish, for deliveries in flight.
SUBSCRIBER_GRACE = 2.0
REDIS_PORT = 6379
PINPRIQ_PORT = 7000

_U16 = struct.Struct(">H")
_U16_PAIR = struct.Struct(">HH")


OTHER_FAILED = "another client process failed"
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class BenchError(Exception):
    """A failure worth one line to the user: no server, a broken connection, a Redis error."""


# -- the workload -------------------------------------------------------------------------------


@attrs.frozen
class Workload:
    """Everything one scenario run needs; picklable, so client processes get a copy."""

    scenario: str
    host: str = "127.0.0.1"
    port: int = PINPRIQ_PORT
    redis: bool = False
    clients: int = 4
    ops: int = 100_000
    pipeline: int = 1
    key_size: int = 8
    payload_size: int = 16
    prio_levels: int = MAX_PRIO
    keys: int = 0  # distinct keys; 0: every packet its own key
    ttl_ms: int = 0
    prefill: int = 0
    subscribers: int = 1
    prefetch: int = 1
    rate: float = 0.0  # ops (subscribe: pushes) per second in all, 0 for as fast as possible
    queue: bytes = b"bench"
    seed: int = 1
    timeout: float = 30.0
    max_seconds: float = 900.0

    @property
    def fill(self) -> int:
        """Packets queued before the clock starts: pops need one each to find."""
        if self.scenario == "subscribe":
            return 0
        return self.prefill + (self.ops if self.scenario == "pop" else 0)

    def key(self, index: int) -> bytes:
        number = index % self.keys if self.keys else index
        return number.to_bytes(self.key_size, "big")

    def payload(self, index: int) -> bytes:
        # The sequence number first keeps Redis members (key + payload) unique.
        seq = (index % 256**8).to_bytes(8, "big")
        size = self.payload_size
        return seq[8 - size :] if size < 8 else seq + b"." * (size - 8)


def share(total: int, parts: int, index: int) -> tuple[int, int]:
    """The ``(start, count)`` of part ``index`` when ``total`` items are split in ``parts``."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)


# -- two dialects: what a push, a pop and a barrier look like on the wire -----------------------


class Dialect(Protocol):
    #: Sent after pushes when a reply must mark that the server applied them; None when every
    #: request is answered anyway.
    barrier: bytes | None

    def push(self, w: Workload, queue: bytes, index: int, prio: int) -> bytes: ...

    def pop(self, queue: bytes) -> bytes: ...

    def replies(self, w: Workload) -> Replies: ...


def count_pinpriq_replies(buf: bytearray, pos: int = 0) -> tuple[int, int, int, int]:
    """Walk the complete pop replies in ``buf`` from ``pos`` without building packets.

    Returns ``(end of the last complete reply, replies, packets, empty replies)``.
    """
    end = len(buf)
    replies = packets = empty = 0
    while pos + 2 <= end:
        (count,) = _U16.unpack_from(buf, pos)
        p = pos + 2
        for _ in range(count):
            if p + 4 > end:
                return pos, replies, packets, empty
            key_len, payload_len = _U16_PAIR.unpack_from(buf, p)
            p += 4 + key_len + payload_len
        if p > end:
            break
        pos = p
        replies += 1
        packets += count
        empty += not count
    return pos, replies, packets, empty


@attrs.frozen
class ReplyShape:
    """A run of replies the workload expects most of the time (a pop finding one packet of the
    workload's sizes; for Redis also a ZADD's ``:1``, or a ZADD and a ZPOPMIN in turn): its
    length, the replies and packets it holds, and the bytes every instance shares (lengths,
    framing) as ``(offset, value)`` pairs.

    ``count`` recognises a buffer of such runs with a few strided slices in C instead of a
    Python loop per reply: if the shared bytes sit at every multiple of the length, each run
    has that length, so the next one starts there. Anything else (empty or grouped pops,
    errors) goes to the general parser.
    """

    size: int
    fixed: tuple[tuple[int, int], ...]
    replies: int = 1
    packets: int = 1

    @classmethod
    def of(
        cls, template: bytes, variable: Iterable[range] = (), replies: int = 1, packets: int = 1
    ) -> ReplyShape:
        free = {i for span in variable for i in span}
        fixed = tuple((i, b) for i, b in enumerate(template) if i not in free)
        return cls(len(template), fixed, replies, packets)

    def count(self, buf: bytearray) -> int:
        """How many runs of this shape ``buf`` holds before its incomplete tail, if it holds
        nothing else; 0 otherwise."""
        size = self.size
        whole = len(buf) // size
        stop = whole * size
        for offset, value in self.fixed:
            if buf[offset:stop:size].count(value) != whole:
                return 0
        return whole


class Replies:
    """Counts the replies in a byte stream: ``feed`` returns (replies, packets, empty pops)."""

    def __init__(self, shapes: Sequence[ReplyShape] = ()) -> None:
        self._buf = bytearray()
        self._shapes = shapes

    def feed(self, data: bytes) -> tuple[int, int, int]:
        buf = self._buf
        buf += data
        replies = packets = 0
        for shape in self._shapes:
            runs = shape.count(buf)
            if runs:
                del buf[: runs * shape.size]
                replies, packets = runs * shape.replies, runs * shape.packets
                break
        used, more_replies, more_packets, empty = self.walk(buf)
        del buf[:used]
        return replies + more_replies, packets + more_packets, empty

    def walk(self, buf: bytearray) -> tuple[int, int, int, int]:
        """The general parser: (bytes used, replies, packets, empty pops)."""
        raise NotImplementedError


class PinpriqReplies(Replies):
    def walk(self, buf: bytearray) -> tuple[int, int, int, int]:
        return count_pinpriq_replies(buf)


class PinpriqDialect:
    barrier: bytes | None = encode(Pop(BARRIER_QUEUE))

    def push(self, w: Workload, queue: bytes, index: int, prio: int) -> bytes:
        return encode(Push(queue, w.key(index), w.payload(index), w.ttl_ms, prio))

    def pop(self, queue: bytes) -> bytes:
        return encode(Pop(queue))

    def replies(self, w: Workload) -> Replies:
        template = encode_reply([Packet(bytes(w.key_size), bytes(w.payload_size))])
        return PinpriqReplies([ReplyShape.of(template, [range(6, len(template))])])


def resp_command(*args: bytes) -> bytes:
    """One Redis command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


#: Added to every score so that all scores have 13 digits, and ZPOPMIN replies one length.
_SCORE_BASE = 2**40
_SCORE_DIGITS = 13


def redis_score(prio: int, index: int) -> bytes:
    """ZPOPMIN takes the lowest score: priority first, then the newest (highest index)."""
    return b"%d" % (_SCORE_BASE + prio * 2**32 - (index % 2**32))


class RedisReplies(Replies):
    """Counts RESP2 replies: integers and statuses (ZADD), arrays of bulk strings (ZPOPMIN,
    two elements per packet). An error reply raises ``BenchError``."""

    def walk(self, buf: bytearray) -> tuple[int, int, int, int]:
        pos = replies = packets = empty = 0
        while (step := self._one(buf, pos)) is not None:
            pos, elements = step
            replies += 1
            if elements >= 0:
                packets += elements // 2
                empty += not elements
        return pos, replies, packets, empty

    @staticmethod
    def _one(buf: bytearray, pos: int) -> tuple[int, int] | None:
        """The end of the reply at ``pos`` and its array length (-1 if not an array)."""
        line_end = buf.find(b"\r\n", pos)
        if line_end < 0:
            return None
        kind = buf[pos]
        if kind == 0x2A:  # '*' array
            count = int(buf[pos + 1 : line_end])
            p = line_end + 2
            for _ in range(max(count, 0)):
                end = _resp_item_end(buf, p)
                if end is None:
                    return None
                p = end
            return p, max(count, 0)
        end = _resp_item_end(buf, pos)
        return None if end is None else (end, -1)


def _resp_item_end(buf: bytearray, pos: int) -> int | None:
    """The end of one non-array RESP value at ``pos``, None if incomplete."""
    line_end = buf.find(b"\r\n", pos)
    if line_end < 0:
        return None
    kind = buf[pos]
    if kind == 0x24:  # '$' bulk string
        length = int(buf[pos + 1 : line_end])
        end = line_end + 2 + (length + 2 if length >= 0 else 0)
        return end if end <= len(buf) else None
    if kind in b":+":
        return line_end + 2
    text = bytes(buf[pos:line_end]).decode("utf-8", "replace")
    raise BenchError(f"redis replied {text}")


class RedisDialect:
    barrier: bytes | None = None

    def push(self, w: Workload, queue: bytes, index: int, prio: int) -> bytes:
        member = w.key(index) + w.payload(index)
        return resp_command(b"ZADD", queue, redis_score(prio, index), member)

    def pop(self, queue: bytes) -> bytes:
        return resp_command(b"ZPOPMIN", queue)

    def replies(self, w: Workload) -> Replies:
        member_size = w.key_size + w.payload_size
        popped = resp_command(bytes(member_size), b"0" * _SCORE_DIGITS)
        member_at = popped.index(b"\r\n", 4) + 2
        score_at = len(popped) - 2 - _SCORE_DIGITS
        variable = [range(member_at, member_at + member_size), range(score_at, len(popped) - 2)]
        added = b":1\r\n"  # members are unique: every ZADD adds one
        shifted = [range(r.start + len(added), r.stop + len(added)) for r in variable]
        shapes = [
            ReplyShape.of(popped, variable),
            ReplyShape.of(added, packets=0),
            ReplyShape.of(added + popped, shifted, replies=2),  # mix
        ]
        return RedisReplies(shapes)


def dialect_of(w: Workload) -> Dialect:
    return RedisDialect() if w.redis else PinpriqDialect()


# -- what one client sends ----------------------------------------------------------------------

#: One pipelined round trip: bytes to send, operations they count as, replies to wait for.
Batch = tuple[bytes, int, int]


@attrs.frozen
class Plan:
    fill: list[bytes]  # prefill, in big writes
    fill_replies: int
    batches: list[Batch]
    barriers: int  # replies in ``batches`` that answer a barrier, not a counted pop


def _prios(w: Workload, rng: random.Random, count: int) -> list[int]:
    return rng.choices(range(1, w.prio_levels + 1), k=count)


def _chunks(frames: list[bytes], size: int) -> list[bytes]:
    return [b"".join(frames[i : i + size]) for i in range(0, len(frames), size)]


def _pushes(
    w: Workload, d: Dialect, queue: bytes, first: int, count: int, rng: random.Random
) -> list[bytes]:
    prios = _prios(w, rng, count)
    return [d.push(w, queue, first + i, prios[i]) for i in range(count)]


def build_plan(w: Workload, index: int, queue: bytes) -> Plan:
    """Every byte client ``index`` will send, built before the clock starts."""
    d = dialect_of(w)
    rng = random.Random(f"{w.seed}:{index}")
    fill_first, fill_count = share(w.fill, w.clients, index)
    fill = _pushes(w, d, queue, fill_first, fill_count, rng)
    fill_replies = 0 if d.barrier is not None else fill_count
    if fill and d.barrier is not None:
        fill.append(d.barrier)
        fill_replies = 1
    first, count = share(w.ops, w.clients, index)
    first += w.fill  # timed pushes never reuse a prefill key
    ops = _ops(w, d, queue, first, count, rng)
    if w.scenario == "push-stream":
        batches, barriers = _stream_batches(d, ops)
    else:
        batches, barriers = _pipelined_batches(w, d, ops)
    return Plan(_chunks(fill, STREAM_FRAMES), fill_replies, batches, barriers)


def _ops(
    w: Workload, d: Dialect, queue: bytes, first: int, count: int, rng: random.Random
) -> list[tuple[bytes, bool]]:
    """The client's operations in order, as (frame, is a pop)."""
    if w.scenario == "pop":
        return [(d.pop(queue), True)] * count
    if w.scenario == "mix":
        pushes = _pushes(w, d, queue, first, (count + 1) // 2, rng)
        pop = d.pop(queue)
        return [(pushes[i // 2], False) if i % 2 == 0 else (pop, True) for i in range(count)]
    return [(frame, False) for frame in _pushes(w, d, queue, first, count, rng)]


def _pipelined_batches(
    w: Workload, d: Dialect, ops: list[tuple[bytes, bool]]
) -> tuple[list[Batch], int]:
    batches: list[Batch] = []
    barriers = 0
    for i in range(0, len(ops), w.pipeline):
        group = ops[i : i + w.pipeline]
        frames = [frame for frame, _ in group]
        if d.barrier is None:  # Redis answers every request
            replies = len(group)
        else:
            replies = sum(is_pop for _, is_pop in group)
            if not replies:  # pushes alone are not answered: a barrier pop marks them done
                frames.append(d.barrier)
                replies = 1
                barriers += 1
        batches.append((b"".join(frames), len(group), replies))
    return batches, barriers


def _stream_batches(d: Dialect, ops: list[tuple[bytes, bool]]) -> tuple[list[Batch], int]:
    """Big writes with nothing to wait for, then one barrier (pinpriq) or every reply (Redis)."""
    frames = [frame for frame, _ in ops]
    batches: list[Batch] = [
        (chunk, min(STREAM_FRAMES, len(frames) - i * STREAM_FRAMES), 0)
        for i, chunk in enumerate(_chunks(frames, STREAM_FRAMES))
    ]
    if d.barrier is not None:
        batches.append((d.barrier, 0, 1))
        return batches, 1
    batches.append((b"", 0, len(frames)))
    return batches, 0


# -- a client process ---------------------------------------------------------------------------


class _Conn:
    """A blocking socket and the replies counted on it."""

    def __init__(self, w: Workload, replies: Replies) -> None:
        try:
            self.sock = socket.create_connection((w.host, w.port), timeout=w.timeout)
        except OSError as error:
            raise BenchError(f"cannot connect to {w.host}:{w.port}: {error}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
        try:
            data = self.sock.recv(RECEIVE_SIZE, flags)
        except BlockingIOError:  # nothing ready, or SO_RCVTIMEO passed on a blocking read
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
    conn: _Conn, batches: list[Batch], progress: Any, slot: int, op_ns: float = 0.0
) -> array.array[int]:
    """The timed loop: send a batch, wait for its replies, note its round trip. With
    ``op_ns``, batches leave on a schedule of one op per ``op_ns`` instead of at once."""
    times = array.array("q")
    sendall, receive, now = conn.sock.sendall, conn.receive, time.monotonic_ns
    done = 0
    begun = now()
    for data, ops, replies in batches:
        if op_ns:
            _sleep_until(begun + int(done * op_ns))
        started = now()
        if data:
            sendall(data)
        wanted = conn.replies + replies
        while conn.replies < wanted:
            receive()
        times.append(now() - started)
        done += ops
        progress[slot] = done
    return times


def _throughput_client(w: Workload, index: int, queue: bytes, sync: _Sync) -> dict[str, Any]:
    plan = build_plan(w, index, queue)
    conn = _Conn(w, dialect_of(w).replies(w))
    with conn.sock:
        conn.stream(plan.fill, plan.fill_replies)
        conn.replies = conn.packets = conn.empty = 0
        sync.barrier.wait(SETUP_SECONDS)
        cpu, started = time.process_time(), time.monotonic_ns()
        op_ns = w.clients * 1e9 / w.rate if w.rate else 0.0
        times = _run_batches(conn, plan.batches, sync.progress, index, op_ns)
        ended, cpu = time.monotonic_ns(), time.process_time() - cpu
    return {
        "ops": sum(ops for _, ops, _ in plan.batches),
        "packets": conn.packets,
        "empty": conn.empty - plan.barriers,
        "start": started,
        "end": ended,
        "cpu": cpu,
        "times": times.tobytes() if w.scenario != "push-stream" else b"",
    }


# -- subscribe: publishers and subscribers ------------------------------------------------------


def _stamped_heads(w: Workload, queue: bytes, first: int, count: int, index: int) -> list[bytes]:
    """Push frames minus their payload and queue, which are added with the send time."""
    rng = random.Random(f"{w.seed}:{index}")
    prios = _prios(w, rng, count)
    heads = []
    tail_size = w.payload_size + len(queue)
    for i in range(count):
        frame = encode(Push(queue, w.key(first + i), w.payload(first + i), w.ttl_ms, prios[i]))
        heads.append(frame[:-tail_size])
    return heads


def _publisher(w: Workload, index: int, queue: bytes, sync: _Sync) -> dict[str, Any]:
    first, count = share(w.ops, w.clients, index)
    heads = _stamped_heads(w, queue, first, count, index)
    padding = b"." * (w.payload_size - 8)
    barrier = PinpriqDialect.barrier or b""
    interval = w.pipeline * w.clients / w.rate if w.rate else 0.0
    conn = _Conn(w, PinpriqReplies())
    with conn.sock:
        sync.barrier.wait(SETUP_SECONDS)
        cpu, started = time.process_time(), time.monotonic_ns()
        for number, i in enumerate(range(0, count, w.pipeline)):
            if interval:
                _sleep_until(started + int(number * interval * 1e9))
            tail = time.monotonic_ns().to_bytes(8, "big") + padding + queue
            conn.sock.sendall(tail.join(heads[i : i + w.pipeline]) + tail + barrier)
            conn.wait_for(number + 1)
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
        conn = _Conn(w, PinpriqReplies())
        conn.sock.sendall(encode(Subscribe(queue)) + (PinpriqDialect.barrier or b""))
        conn.wait_for(1)
        conn.sock.sendall(encode(READY) * w.prefetch)
        subscribers.append(_Deliveries(w, conn.sock))
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


def _subscriber_process(w: Workload, index: int, queue: bytes, sync: _Sync) -> dict[str, Any]:
    slot = w.clients + index
    _, count = share(w.subscribers, _subscriber_processes(w), index)
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


def _subscriber_processes(w: Workload) -> int:
    return min(w.subscribers, os.cpu_count() or 1)


# -- the parent: start clients, show progress, aggregate ----------------------------------------


@attrs.define
class _Sync:
    """What the processes of one run share."""

    barrier: Any  # multiprocessing.Barrier
    progress: Any  # RawArray of int64, one slot per process
    published: Any  # multiprocessing.Event, set when every publisher is done
    subscriber_slots: range

    def delivered(self) -> int:
        return sum(self.progress[i] for i in self.subscriber_slots)


ClientFn = Callable[[Workload, int, bytes, _Sync], dict[str, Any]]


def _child(
    fn: ClientFn, w: Workload, index: int, queue: bytes, sync: _Sync, out: Any
) -> None:  # pragma: no cover - runs in a child process
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # and it stops us with SIGTERM
    _die_with_parent()
    try:
        out.send(("ok", fn(w, index, queue, sync)))
    except threading.BrokenBarrierError:
        out.send(("error", OTHER_FAILED))
    except BlockingIOError:  # SO_SNDTIMEO passed in a sendall
        sync.barrier.abort()
        out.send(("error", "timed out sending to the server"))
    except (BenchError, OSError) as error:
        sync.barrier.abort()
        out.send(("error", str(error)))
    except BaseException as error:
        sync.barrier.abort()
        out.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        out.close()


def _die_with_parent() -> None:  # pragma: no cover - runs in a child process
    """Ask Linux for SIGTERM when the parent dies, even by SIGKILL, so that no client outlives
    it (a client waiting on the barrier would otherwise wait ``SETUP_SECONDS``)."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Progress:
    """One status line on stderr: rewritten in place on a terminal, else every few seconds."""

    def __init__(self, stream: TextIO | None, label: str, total: int) -> None:
        self.stream, self.label, self.total = stream, label, total
        self.tty = bool(stream and stream.isatty())
        self.started = time.monotonic()
        self.last_line = self.started

    def restart(self) -> None:
        """The clock starts: rates count from now."""
        self.started = self.last_line = time.monotonic()

    def show(self, done: int) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last_line < 5:
            return
        self.last_line = now
        rate = done / (now - self.started) if now > self.started else 0.0
        self.note(f"{self.label}: {done:,}/{self.total:,} ({rate:,.0f}/s)")

    def note(self, text: str) -> None:
        if self.stream is not None:
            self.stream.write(f"\r{text}\x1b[K" if self.tty else text + "\n")
            self.stream.flush()

    def clear(self) -> None:
        if self.stream is not None and self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _roles(w: Workload) -> list[ClientFn]:
    if w.scenario == "subscribe":
        return [_publisher] * w.clients + [_subscriber_process] * _subscriber_processes(w)
    return [_throughput_client] * w.clients


def _start(
    w: Workload, queue: bytes
) -> tuple[list[multiprocessing.process.BaseProcess], list[Any], _Sync]:
    # fork starts a client in milliseconds; the parent holds no threads or sockets then.
    ctx: Any = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    roles = _roles(w)
    sync = _Sync(
        barrier=ctx.Barrier(len(roles) + 1),
        progress=ctx.RawArray("q", len(roles)),
        published=ctx.Event(),
        subscriber_slots=range(w.clients, len(roles)),
    )
    processes, pipes = [], []
    for number, fn in enumerate(roles):
        index = number if number < w.clients else number - w.clients
        receiver, sender = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=_child, args=(fn, w, index, queue, sync, sender), name=f"bench-{number}"
        )
        process.start()
        sender.close()
        processes.append(process)
        pipes.append(receiver)
    return processes, pipes, sync


def _collect(
    w: Workload, pipes: list[Any], sync: _Sync, progress: Progress
) -> list[dict[str, Any]]:
    """Every process's result, in process order; progress shown while waiting."""
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + w.max_seconds
    while len(results) < len(pipes):
        if time.monotonic() > deadline:
            raise BenchError(f"gave up after {w.max_seconds:g} s")
        waiting = [p for i, p in enumerate(pipes) if i not in results]
        for ready in multiprocessing.connection.wait(waiting, timeout=0.2):
            number = pipes.index(ready)
            try:
                status, value = pipes[number].recv()
            except EOFError:
                status, value = "error", "a client process died"
            if status != "ok":
                raise BenchError(_first_cause(value, pipes, results))
            results[number] = value
        if all(i in results for i in range(w.clients)):
            sync.published.set()
        watched = sync.subscriber_slots if w.scenario == "subscribe" else range(w.clients)
        progress.show(sum(sync.progress[i] for i in watched))
    return [results[i] for i in range(len(pipes))]


def _first_cause(error: str, pipes: list[Any], results: dict[int, Any]) -> str:
    """The error that made the others give up, if another process has reported it by now."""
    if error != OTHER_FAILED:
        return error
    for number, pipe in enumerate(pipes):
        if number not in results and pipe.poll(1.0):
            with contextlib.suppress(EOFError):
                status, value = pipe.recv()
                if status != "ok" and value != OTHER_FAILED:
                    return str(value)
    return error


def run_scenario(
    w: Workload, *, server_pid: int | None = None, status: TextIO | None = None
) -> dict[str, Any]:
    """Run one scenario against a live server and return its figures."""
    queue = b"%s:%s:%s" % (w.queue, w.scenario.encode(), os.urandom(4).hex().encode())
    processes, pipes, sync = _start(w, queue)
    progress = Progress(status, w.scenario, w.ops)
    try:
        progress.note(f"{w.scenario}: preparing" + (f", {w.fill:,} to prefill" if w.fill else ""))
        with contextlib.suppress(threading.BrokenBarrierError):  # _collect reports why
            sync.barrier.wait(SETUP_SECONDS)
        progress.restart()
        server_cpu = _cpu_seconds(server_pid)
        results = _collect(w, pipes, sync, progress)
        server_cpu = _cpu_seconds(server_pid) - server_cpu
    finally:
        progress.clear()
        _stop(processes)
    if w.scenario == "subscribe":
        summary = _subscribe_summary(w, results)
    else:
        summary = _throughput_summary(w, results)
    if server_pid is not None:
        summary["server_cpu_us_per_op"] = round(server_cpu * 1e6 / max(w.ops, 1), 3)
    return summary


def _stop(processes: list[multiprocessing.process.BaseProcess]) -> None:
    for process in processes:
        process.join(timeout=2)
        if process.is_alive():
            process.terminate()
            process.join(timeout=2)


def _cpu_seconds(pid: int | None) -> float:
    """User plus system CPU time of a process, from /proc (Linux)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError as error:
        raise BenchError(f"cannot read the CPU time of process {pid}: {error}") from None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentiles(times_ns: Sequence[int]) -> dict[str, float] | None:
    """p50, p99, p99.9 and max in microseconds, nearest rank."""
    if not times_ns:
        return None
    ordered = sorted(times_ns)
    pick = {"p50": 0.5, "p99": 0.99, "p99.9": 0.999}
    figures = {
        name: ordered[max(math.ceil(q * len(ordered)) - 1, 0)] / 1000 for name, q in pick.items()
    }
    figures["max"] = ordered[-1] / 1000
    return {name: round(value, 1) for name, value in figures.items()}


def _merged_times(results: Iterable[dict[str, Any]]) -> array.array[int]:
    times = array.array("q")
    for result in results:
        times.frombytes(result["times"])
    return times


def _common(w: Workload) -> dict[str, Any]:
    return {
        "scenario": w.scenario,
        "target": "redis" if w.redis else "pinpriq",
        "clients": w.clients,
        "pipeline": w.pipeline,
        "prefill": w.prefill if w.scenario != "subscribe" else 0,
        "keys": w.keys or None,
        "rate": w.rate or None,
    }


def _throughput_summary(w: Workload, results: list[dict[str, Any]]) -> dict[str, Any]:
    ops = sum(r["ops"] for r in results)
    seconds = (max(r["end"] for r in results) - min(r["start"] for r in results)) / 1e9
    kind = "per op" if w.pipeline == 1 else f"per batch of {w.pipeline}"
    return {
        **_common(w),
        "ops": ops,
        "seconds": round(seconds, 4),
        "ops_per_sec": round(ops / seconds) if seconds > 0 else None,
        "packets": sum(r["packets"] for r in results),
        "empty_pops": sum(r["empty"] for r in results),
        "latency_us": percentiles(_merged_times(results)),
        "latency_kind": None if w.scenario == "push-stream" else f"round trip {kind}",
        "generator_cpu_us_per_op": round(sum(r["cpu"] for r in results) * 1e6 / max(ops, 1), 3),
    }


def _subscribe_summary(w: Workload, results: list[dict[str, Any]]) -> dict[str, Any]:
    publishers, subscribers = results[: w.clients], results[w.clients :]
    started = min(r["start"] for r in publishers)
    last = max(r["last"] for r in subscribers)
    seconds = (last - started) / 1e9 if last > started else 0.0
    deliveries = sum(r["deliveries"] for r in subscribers)
    packets = sum(r["packets"] for r in subscribers)
    return {
        **_common(w),
        "subscribers": w.subscribers,
        "prefetch": w.prefetch,
        "ops": w.ops,
        "seconds": round(seconds, 4),
        "deliveries": deliveries,
        "deliveries_per_sec": round(deliveries / seconds) if seconds > 0 else None,
        "packets": packets,
        "missing": w.ops - packets,
        "latency_us": percentiles(_merged_times(subscribers)),
        "latency_kind": "push to delivery",
        "publisher_cpu_us_per_push": round(
            sum(r["cpu"] for r in publishers) * 1e6 / max(w.ops, 1), 3
        ),
        "subscriber_cpu_us_per_delivery": round(
            sum(r["cpu"] for r in subscribers) * 1e6 / max(deliveries, 1), 3
        ),
        "generator_cpu_us_per_op": round(sum(r["cpu"] for r in results) * 1e6 / max(w.ops, 1), 3),
    }


# -- the command line ---------------------------------------------------------------------------


def _count(low: int, high: int = 2**62) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low}..{high}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def _scenarios(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown scenario {', '.join(unknown) or text!r}; choose from {', '.join(SCENARIOS)}"
        )
    return names


def bench_parser() -> argparse.ArgumentParser:
    scenarios = "\n".join(f"  {name:12} {text}" for name, text in SCENARIO_HELP.items())
    parser = OneLineParser(
        prog="pinpriq-bench",
        description="Measure a pinpriq server (or, with --redis, a Redis server as ZADD/ZPOPMIN) "
        "under load from several client processes.",
        epilog=f"scenarios:\n{scenarios}\n\nLatency is the round trip of a batch (one op at "
        "-P 1), or push-to-delivery for subscribe. Speak only to servers you own: the bench "
        "leaves its pushed packets queued.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="server address (default: %(default)s)")
    add("--port", type=port_number, help=f"(default: {PINPRIQ_PORT}, or {REDIS_PORT} with --redis)")
    add("--redis", action="store_true", help="the server is Redis: ZADD to push, ZPOPMIN to pop")
    add("-c", dest="clients", type=_count(1, 1024), default=4, metavar="N",
        help="client connections, each in its own process (default: %(default)s)")  # fmt: skip
    add("-n", dest="ops", type=_count(1), default=100_000, metavar="N",
        help="operations in all, per scenario (default: %(default)s)")  # fmt: skip
    add("-P", dest="pipeline", type=_count(1, 65535), default=1, metavar="N",
        help="requests per round trip (default: %(default)s)")  # fmt: skip
    add("-t", dest="scenarios", type=_scenarios, default=list(SCENARIOS), metavar="LIST",
        help=f"comma-separated scenarios (default: {','.join(SCENARIOS)})")  # fmt: skip
    add("--key-size", type=_count(1, 0xFFFF), default=8, metavar="B", help="(default: 8)")
    add("--payload-size", type=_count(0, 0xFFFF), default=16, metavar="B", help="(default: 16)")
    add("--prio-levels", type=_count(1, MAX_PRIO), default=MAX_PRIO, metavar="L",
        help="priorities drawn uniformly from 1..L (default: %(default)s)")  # fmt: skip
    add("--keys", type=_count(1), default=0, metavar="K",
        help="distinct keys, cycled, so pops take groups (default: all unique)")  # fmt: skip
    add("--ttl", type=_count(0, MAX_TTL_MS), default=0, metavar="MS",
        help="TTL of every push, 0 for none (default: 0)")  # fmt: skip
    add("--prefill", type=_count(0), default=0, metavar="N",
        help="packets queued before the clock starts; pop adds N more (default: 0)")  # fmt: skip
    add("--subscribers", type=_count(1, 10_000), default=1, metavar="S", help="(default: 1)")
    add("--prefetch", type=_count(1, 0xFFFF), default=1, metavar="K",
        help="credits each subscriber keeps outstanding (default: 1)")  # fmt: skip
    add("--rate", type=_positive_float, default=0.0, metavar="R",
        help="paced ops (subscribe: pushes) per second in all (default: unpaced)")  # fmt: skip
    add("--queue", default="bench", metavar="PREFIX", help="queue name prefix (default: bench)")
    add("--seed", type=int, default=1, help="seed of the priorities (default: 1)")
    add("--timeout", type=_positive_float, default=30.0, metavar="S",
        help="longest wait for any one reply (default: 30)")  # fmt: skip
    add("--server-pid", type=_count(1), metavar="PID",
        help="also report the server process's CPU time per op (Linux)")  # fmt: skip
    add("--json", action="store_true", help="print one JSON object instead of a table")
    add("-q", "--quiet", action="store_true", help="no progress line")
    add("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def workloads(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Iterator[Workload]:
    """One workload per scenario; a combination that cannot work is a usage error."""
    _check(args, parser)
    port = args.port if args.port is not None else (REDIS_PORT if args.redis else PINPRIQ_PORT)
    names = "host redis clients ops pipeline key_size payload_size prio_levels keys prefill"
    names += " subscribers prefetch rate seed timeout"
    fields = {name: getattr(args, name) for name in names.split()}
    for scenario in args.scenarios:
        yield Workload(
            scenario=scenario,
            port=port,
            ttl_ms=args.ttl,
            queue=os.fsencode(args.queue),
            **fields,
        )


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.redis and args.ttl:
        parser.error("--ttl has no Redis counterpart (a sorted set has no per-member TTL)")
    if args.redis and "subscribe" in args.scenarios:
        parser.error("the subscribe scenario has no Redis counterpart; drop it from -t")
    if "subscribe" in args.scenarios and args.payload_size < 8:
        parser.error("subscribe needs --payload-size of at least 8 for the send timestamp")
    if not args.keys and 256**args.key_size < args.prefill + 2 * args.ops:
        parser.error(f"--key-size {args.key_size} is too small for unique keys; add --keys")
    if args.keys and 256**args.key_size < args.keys:
        parser.error(f"--key-size {args.key_size} is too small for --keys {args.keys}")
    if args.clients > args.ops:
        parser.error(f"-c {args.clients} is more clients than -n {args.ops} operations")


def format_table(results: list[dict[str, Any]]) -> str:
    head = f"{'scenario':12} {'ops':>10} {'seconds':>8} {'ops/s':>10}  latency us p50/p99/p99.9"
    lines = [head]
    for r in results:
        rate = r.get("deliveries_per_sec") if r["scenario"] == "subscribe" else r["ops_per_sec"]
        lat = r["latency_us"]
        latency = f"{lat['p50']}/{lat['p99']}/{lat['p99.9']} ({r['latency_kind']})" if lat else "-"
        lines.append(
            f"{r['scenario']:12} {r['ops']:>10,} {r['seconds']:>8.3f} {rate or 0:>10,}  {latency}"
        )
        notes = [f"generator {r['generator_cpu_us_per_op']} us CPU/op"]
        if "server_cpu_us_per_op" in r:
            notes.append(f"server {r['server_cpu_us_per_op']} us CPU/op")
        if r.get("empty_pops"):
            notes.append(f"{r['empty_pops']:,} pops found nothing")
        if r.get("missing"):
            notes.append(f"{r['missing']:,} packets never delivered")
        if r["scenario"] == "subscribe":
            notes.append(f"{r['deliveries']:,} deliveries")
        lines.append(f"{'':12} " + "; ".join(notes))
    return "\n".join(lines)


def _describe(w: Workload) -> str:
    keys = f"{w.keys:,} keys" if w.keys else "unique keys"
    server = "redis" if w.redis else "pinpriq"
    return (
        f"{server} at {w.host}:{w.port}: -c {w.clients} -P {w.pipeline}, {w.key_size}-byte keys"
        f" ({keys}), {w.payload_size}-byte payloads, prio 1..{w.prio_levels}"
        + (f", ttl {w.ttl_ms} ms" if w.ttl_ms else "")
    )


def _preflight(w: Workload) -> None:
    """Fail with one line, before starting any process, when nothing listens."""
    try:
        socket.create_connection((w.host, w.port), timeout=w.timeout).close()
    except OSError as error:
        raise BenchError(f"cannot connect to {w.host}:{w.port}: {error}") from None


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pinpriq-bench``."""
    parser = bench_parser()
    args = parser.parse_args(argv)
    runs = list(workloads(args, parser))
    # SIGTERM unwinds like Ctrl-C, so that the client processes are stopped too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    status = None if args.quiet else sys.stderr
    results = []
    try:
        _preflight(runs[0])
        for w in runs:
            results.append(run_scenario(w, server_pid=args.server_pid, status=status))
    except BenchError as error:
        sys.exit(f"pinpriq-bench: {error}")
    except KeyboardInterrupt:
        sys.exit(130)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "quiet")}
        document = {"tool": "pinpriq-bench", "version": __version__, "settings": settings}
        print(json.dumps({**document, "results": results}))
    else:
        print(_describe(runs[0]))
        print(format_table(results))


if __name__ == "__main__":
    main()
