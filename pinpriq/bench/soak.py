"""Soak test: churn a pinpriq server for a while and watch whether its memory levels off.

    python -m pinpriq.soak --seconds 60 [--port P] [--connections N]

Without ``--port`` it starts ``pinpriq-server`` on a free loopback port and stops it at the end
(SIGTERM, expecting exit status 0); with ``--port`` it uses a server already running on
127.0.0.1, finding its process through ``/proc`` to read its memory (or ``--pid``). It talks only
to 127.0.0.1, uses only queues whose names start with ``soak/``, and stops by itself.

This module owns the soak's workload and its report; every byte goes through ``pinpriq.wire``.
It lives beside the bench, whose ``lifetime`` it shares; ``pinpriq/soak.py`` keeps the command
``python -m pinpriq.soak`` working. It is not part of the test suite (tests/test_soak.py runs it
for a few seconds so it cannot rot).

Theory of operation. Three kinds of client task churn the server until the time is up:

* workers push batches of packets (TTL 0 or short TTLs, sizes from empty to 60 kB, shared keys
  so pops return groups) to mixed queues and pop as many times, reconnecting now and then;
* TTL pushers push short-lived packets to queues nobody pops, so expiry is their only way out;
* subscribers come and go: subscribe to a few queues with a few credits, take deliveries for a
  while, and leave either cleanly or by resetting the connection.

Every few seconds a line shows the elapsed time, operations done, TTL-0 packets still queued,
and the server's resident memory (VmRSS). At the end the TTL pushes have expired, the queues are
drained, and TTL-0 packets are accounted for: each was popped, delivered, drained, or lost to a
subscriber that reset its connection with deliveries in flight (at most once, decision 10), and
no packet came back after its TTL. The summary says whether memory levelled off: whether the
highest RSS of the last third of the run is within a small margin of the second third's.

Exit status: 0 if the run was correct (whether or not memory levelled off, unless
``--require-level``), 1 if the server failed, a packet was lost or duplicated, or an expired
packet came back; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import trio

from pinpriq import wire
from pinpriq.bench.lifetime import start_child
from pinpriq.wire import Packet

__all__ = ["main"]

HOST = "127.0.0.1"
RECEIVE_SIZE = 65536
MIXED_QUEUES = [b"soak/mixed/%d" % i for i in range(8)]
TIMED_QUEUES = [b"soak/timed/%d" % i for i in range(4)]
#: Popped to mark a point in a connection's reply stream: nothing is ever pushed to it.
SENTINEL_QUEUE = b"soak/sentinel"
KEYS_PER_QUEUE = 64
#: TTLs in ms for packets that should expire; TTL 0 never does.
SHORT_TTLS = (20, 100, 500, 1500)
MAX_TTL_SECONDS = max(SHORT_TTLS) / 1000
#: Payload sizes and their weights: mostly small, now and then near the 64 kB maximum.
SIZES = (1, 16, 200, 2_000, 20_000, 60_000)
SIZE_WEIGHTS = (20, 30, 30, 15, 4, 1)
#: The first payload byte tells a TTL-0 packet from a short-lived one when it comes back.
FOREVER, SHORT_LIVED = b"0", b"t"
#: Memory "levelled off" if the last third's peak exceeds the second third's by at most this
#: fraction, or by at most LEVEL_SLACK_BYTES (small processes wobble by a page or two).
LEVEL_GROWTH = 0.05
LEVEL_SLACK_BYTES = 2 * 1024 * 1024
LISTENING = re.compile(rb"pinpriq listening on \S+ port (\d+)")
#: How often ``ServerProcess.wait`` looks whether the server has exited.
WAIT_POLL_SECONDS = 0.02
#: Hard stop beyond the planned run, in case a task ignores its deadline (a stuck server).
GRACE_SECONDS = 30.0


class SoakError(Exception):
    """The server misbehaved or could not be run; the message says how."""


@attrs.define
class Stats:
    """What the client tasks did, and what they saw go wrong."""

    pushes: int = 0
    pops: int = 0
    deliveries: int = 0
    forever_pushed: int = 0  # TTL-0 packets pushed
    forever_taken: int = 0  # TTL-0 packets popped or delivered
    lost_at_most: int = 0  # credits outstanding when a subscriber reset its connection
    subscriber_sessions: int = 0
    connections: int = 0
    expired_returned: int = 0  # short-lived packets handed out after the drain's wait
    errors: list[str] = attrs.Factory(list)

    @property
    def ops(self) -> int:
        return self.pushes + self.pops + self.deliveries

    def took(self, packets: Sequence[Packet]) -> None:
        self.forever_taken += sum(p.payload[:1] == FOREVER for p in packets)


# -- one connection ---------------------------------------------------------------------------


class Link:
    """A client connection: frames out, replies in."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = wire.ReplyDecoder()

    @classmethod
    async def open(cls, port: int, stats: Stats) -> Link:
        stats.connections += 1
        return cls(await trio.open_tcp_stream(HOST, port))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def reply(self) -> list[Packet]:
        while (reply := self.decoder.next_reply()) is None:
            data = await self.stream.receive_some(RECEIVE_SIZE)
            if not data:
                raise SoakError("the server closed a connection it should have kept")
            self.decoder.feed(data)
        return reply

    async def close(self, *, reset: bool = False) -> None:
        if reset:  # SO_LINGER 0: close with RST, discarding whatever is in flight
            linger = struct.pack("ii", 1, 0)
            self.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        await self.stream.aclose()


# -- the workload -----------------------------------------------------------------------------


def encode_all(frames: Sequence[wire.ClientFrame]) -> bytes:
    return b"".join(wire.encode(frame) for frame in frames)


def random_push(rng: random.Random, queue: bytes, forever: bool) -> wire.Push:
    """A push of a TTL-0 packet (prio 1..10) or a short-lived one (prio 0..10: prio 0 only
    with a TTL, so that no packet can stay queued for good once its key is popped out)."""
    size = rng.choices(SIZES, SIZE_WEIGHTS)[0]
    size = rng.randint(max(1, size // 2), size)
    payload = (FOREVER if forever else SHORT_LIVED) + b"." * (size - 1)
    key = b"k%d" % rng.randrange(KEYS_PER_QUEUE)
    ttl = 0 if forever else rng.choice(SHORT_TTLS)
    return wire.Push(queue, key, payload, ttl, rng.randint(1 if forever else 0, 10))


class ChurnTasks:
    """The client tasks, sharing a deadline and the stats."""

    def __init__(self, port: int, deadline: float, stats: Stats, seed: int) -> None:
        self.port = port
        self.deadline = deadline
        self.stats = stats
        self.seed = seed

    def running(self) -> bool:
        return trio.current_time() < self.deadline

    async def worker(self, index: int) -> None:
        """Push a batch, pop as many times, read every reply; reconnect every few hundred
        batches. Batches end at the deadline, never in the middle, so the accounting is exact."""
        rng = random.Random(f"{self.seed}/worker/{index}")
        while self.running():
            link = await Link.open(self.port, self.stats)
            try:
                for _ in range(rng.randint(20, 400)):
                    if not self.running():
                        break
                    await self._batch(link, rng)
            finally:
                await link.close()

    async def _batch(self, link: Link, rng: random.Random) -> None:
        size = rng.randint(1, 16)
        pushes = [
            random_push(rng, rng.choice(MIXED_QUEUES), rng.random() < 0.6) for _ in range(size)
        ]
        pops = [wire.Pop(rng.choice(MIXED_QUEUES)) for _ in range(size)]
        await link.send(encode_all([*pushes, *pops]))
        self.stats.pushes += size
        self.stats.forever_pushed += sum(p.ttl_ms == 0 for p in pushes)
        for _ in pops:
            self.stats.took(await link.reply())
        self.stats.pops += size

    async def ttl_pusher(self, index: int) -> None:
        """Short-lived packets to queues no one pops; a sentinel pop per batch keeps the
        pusher from running far ahead of the server."""
        rng = random.Random(f"{self.seed}/ttl/{index}")
        link = await Link.open(self.port, self.stats)
        try:
            while self.running():
                batch = [random_push(rng, rng.choice(TIMED_QUEUES), False) for _ in range(32)]
                await link.send(encode_all(batch))
                await link.send(wire.encode(wire.Pop(SENTINEL_QUEUE)))
                if await link.reply():
                    raise SoakError(f"the never-pushed queue {SENTINEL_QUEUE!r} gave a packet")
                self.stats.pushes += len(batch)
                await trio.sleep(0.002)  # share the server: expiry, not pushing, is the point
        finally:
            await link.close()

    async def subscriber(self, index: int) -> None:
        """Subscribe, take deliveries a while, leave; again and again."""
        rng = random.Random(f"{self.seed}/subscriber/{index}")
        while self.running():
            queues = rng.sample(MIXED_QUEUES + TIMED_QUEUES[:1], rng.randint(1, 3))
            lifetime = min(rng.uniform(0.05, 1.5), self.deadline - trio.current_time())
            await self._subscription(rng, queues, max(0.0, lifetime))
            self.stats.subscriber_sessions += 1

    async def _subscription(self, rng: random.Random, queues: list[bytes], seconds: float) -> None:
        link = await Link.open(self.port, self.stats)
        credits = rng.randint(1, 16)
        await link.send(encode_all([*map(wire.Subscribe, queues), *[wire.READY] * credits]))
        received = 0
        with trio.move_on_after(seconds):  # receiving is cancel-safe: nothing is lost
            while True:
                self._delivered(await link.reply())
                received += 1
                if rng.random() < 0.8:  # usually come back for more
                    credits += 1  # first: a send cut short by the timeout may still arrive
                    await link.send(wire.encode(wire.READY))
        if rng.random() < 0.3:
            await link.close(reset=True)
            self.stats.lost_at_most += credits - received
            return
        # Leave cleanly: after the unsubscribes no delivery starts, and the sentinel's empty
        # reply comes after any that had.
        await link.send(encode_all([*map(wire.Unsubscribe, queues), wire.Pop(SENTINEL_QUEUE)]))
        while packets := await link.reply():
            self._delivered(packets)
        await link.close()

    def _delivered(self, packets: list[Packet]) -> None:
        self.stats.deliveries += 1
        self.stats.took(packets)


async def drain(port: int, stats: Stats) -> int:
    """Pop every soak queue empty; returns the TTL-0 packets found. Run after every short
    TTL has passed, so any short-lived packet found is one that came back after expiring."""
    link = await Link.open(port, stats)
    found = 0
    try:
        for queue in MIXED_QUEUES + TIMED_QUEUES:
            for _ in range(1_000_000):  # bounded: far more than the workload can leave
                await link.send(wire.encode(wire.Pop(queue)))
                packets = await link.reply()
                if not packets:
                    break
                found += sum(p.payload[:1] == FOREVER for p in packets)
                stats.expired_returned += sum(p.payload[:1] == SHORT_LIVED for p in packets)
    finally:
        await link.close()
    return found


# -- the server process and its memory --------------------------------------------------------


def resident_bytes(pid: int) -> int | None:
    """VmRSS of a process, or ``None`` if it is gone or unreadable."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def listener_pid(port: int) -> int | None:
    """The process listening on TCP ``port``, found through /proc (Linux), or ``None``."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                    return int(proc.name)
            except OSError:
                continue
    return None


class ServerProcess:
    """``pinpriq-server`` on a free loopback port; its log lines are kept for the report.

    The server is forked on the main thread, not through ``trio.lowlevel.open_process``: it
    dies with the thread that forked it (``pinpriq.bench.lifetime``), and trio forks from a
    worker thread that exits after 10 s idle. trio did not start it, so it cannot wait for it
    either: ``wait`` polls."""

    def __init__(self, process: subprocess.Popen[bytes], stderr: trio.lowlevel.FdStream) -> None:
        self.process = process
        self.stderr = stderr
        self.port = 0
        self.log: list[str] = []
        self.listening = trio.Event()

    @classmethod
    async def start(cls, nursery: trio.Nursery) -> ServerProcess:
        command = [sys.executable, "-m", "pinpriq.cli.server", "--host", HOST, "--port", "0"]
        command += ["--http-port", "0"]  # never the default 7001: servers run side by side
        log_end, server_end = os.pipe()
        try:
            process = start_child(command, stderr=server_end)
        except BaseException:
            os.close(log_end)
            raise
        finally:
            os.close(server_end)
        server = cls(process, trio.lowlevel.FdStream(log_end))
        nursery.start_soon(server._read_log)
        with trio.move_on_after(15):
            await server.listening.wait()
        if not server.port:
            process.kill()
            await server.wait()
            raise SoakError("pinpriq-server did not start: " + " | ".join(server.log[-5:]))
        return server

    async def _read_log(self) -> None:
        pending = b""
        async with self.stderr:
            while chunk := await self.stderr.receive_some(RECEIVE_SIZE):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if match := LISTENING.search(line):
                        self.port = int(match.group(1))
                        self.listening.set()
                    self.log.append(line.decode(errors="replace"))
        self.listening.set()  # exited before listening: start() reports it

    async def wait(self) -> int:
        """The exit status, once the server has exited; polls without blocking trio."""
        # Nothing could set a trio.Event when it exits: trio does not know this child.
        while (status := self.process.poll()) is None:  # noqa: ASYNC110
            await trio.sleep(WAIT_POLL_SECONDS)
        return status

    async def stop(self) -> int:
        """SIGTERM, then the exit status (killed after 10 s: a graceful stop takes ~1 s)."""
        self.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(10):
            return await self.wait()
        self.process.kill()
        await self.wait()
        raise SoakError("pinpriq-server did not exit within 10 s of SIGTERM")


# -- sampling and the report ------------------------------------------------------------------


def mib(size: int | None) -> str:
    return "n/a" if size is None else f"{size / 2**20:.1f} MiB"


@attrs.define
class Sampler:
    """Prints a progress line every ``interval`` seconds and keeps the RSS samples."""

    pid: int | None
    stats: Stats
    interval: float
    out: Callable[[str], None]
    samples: list[tuple[float, int | None]] = attrs.Factory(list)
    _last: tuple[float, int] = (0.0, 0)  # elapsed and ops at the previous line

    def sample(self, elapsed: float) -> None:
        rss = resident_bytes(self.pid) if self.pid else None
        self.samples.append((elapsed, rss))
        then, ops_then = self._last
        rate = (self.stats.ops - ops_then) / (elapsed - then) if elapsed > then else 0.0
        self._last = (elapsed, self.stats.ops)
        # Exact but for deliveries in flight to subscribers that reset: those may be lost.
        most = self.stats.forever_pushed - self.stats.forever_taken
        least = max(0, most - self.stats.lost_at_most)
        queued = f"{most:,}" if least == most else f"{least:,}-{most:,}"
        self.out(
            f"{elapsed:6.1f}s  ops {self.stats.ops:>10,} ({rate:>8,.0f}/s)  "
            f"ttl0 queued {queued:>11}  subscribers {self.stats.subscriber_sessions:>5,}  "
            f"rss {mib(rss)}"
        )

    async def run(self, started: float, deadline: float) -> None:
        self.sample(0.0)
        while (now := trio.current_time()) < deadline:
            await trio.sleep(min(self.interval, deadline - now))
            self.sample(trio.current_time() - started)


def levelled(samples: list[tuple[float, int | None]]) -> tuple[bool | None, str]:
    """Whether the last third's peak RSS stays within the margin of the second third's."""
    values = [rss for _, rss in samples[1:] if rss is not None]  # samples[0] is before load
    if len(values) < 3:
        return None, "too few samples to tell"
    third = len(values) // 3
    middle, last = max(values[third : 2 * third]), max(values[2 * third :])
    growth = last - middle
    allowed = max(LEVEL_SLACK_BYTES, LEVEL_GROWTH * middle)
    verdict = growth <= allowed
    detail = (
        f"peak of the second third {mib(middle)}, of the last third {mib(last)} "
        f"({growth / 2**20:+.1f} MiB; levelled means at most +{allowed / 2**20:.1f} MiB)"
    )
    return verdict, detail


def summary(
    sampler: Sampler, seconds: float, drained: int, out: Callable[[str], None]
) -> list[str]:
    """Print the summary; returns the problems found."""
    stats, samples = sampler.stats, sampler.samples
    problems = list(stats.errors)
    out(
        f"summary: {seconds:.0f} s, {stats.ops:,} ops ({stats.ops / seconds:,.0f}/s), "
        f"{stats.pushes:,} pushes, {stats.pops:,} pops, {stats.deliveries:,} deliveries, "
        f"{stats.subscriber_sessions:,} subscriber sessions, {stats.connections:,} connections"
    )
    rss = [value for _, value in samples]
    middle = rss[min(range(len(samples)), key=lambda i: abs(samples[i][0] - seconds / 2))]
    out(f"rss: start {mib(rss[0])} (idle), middle {mib(middle)}, end {mib(rss[-1])}")
    verdict, detail = levelled(samples)
    word = {True: "yes", False: "NO", None: "unknown"}[verdict]
    out(f"rss levelled off: {word}: {detail}")
    lost = stats.forever_pushed - stats.forever_taken - drained
    out(
        f"ttl-0 packets: {stats.forever_pushed:,} pushed, {stats.forever_taken:,} popped or "
        f"delivered, {drained:,} drained at the end, {lost:,} lost "
        f"(at most {stats.lost_at_most:,} could be, in flight to subscribers that reset)"
    )
    if lost < 0:
        problems.append(f"{-lost} more TTL-0 packets came back than were pushed")
    elif lost > stats.lost_at_most:
        problems.append(f"{lost} TTL-0 packets lost, beyond what subscriber resets explain")
    out(f"packets returned after their ttl: {stats.expired_returned}")
    if stats.expired_returned:
        problems.append(f"{stats.expired_returned} packets came back after their TTL")
    return problems


# -- running it -------------------------------------------------------------------------------


async def churn(port: int, pid: int | None, args: argparse.Namespace) -> tuple[Sampler, int]:
    """Run the workload and the sampler for ``args.seconds``; then drain. Returns the sampler
    and the TTL-0 packets drained."""
    stats = Stats()
    started = trio.current_time()
    deadline = started + args.seconds
    tasks = ChurnTasks(port, deadline, stats, args.seed)
    sampler = Sampler(pid, stats, args.interval, print_flush)
    workers = max(1, args.connections // 2)
    ttl_pushers = max(1, args.connections // 4)
    subscribers = max(1, args.connections - workers - ttl_pushers)
    print_flush(
        f"soak: server pid {pid or 'unknown'} on {HOST}:{port}; {args.seconds:g} s; "
        f"{workers} workers, {ttl_pushers} ttl pushers, {subscribers} subscribers; "
        f"seed {args.seed}"
    )
    with trio.fail_after(args.seconds + GRACE_SECONDS):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler.run, started, deadline)
            for i in range(workers):
                nursery.start_soon(tasks.worker, i)
            for i in range(ttl_pushers):
                nursery.start_soon(tasks.ttl_pusher, i)
            for i in range(subscribers):
                nursery.start_soon(tasks.subscriber, i)
        await trio.sleep(MAX_TTL_SECONDS + 0.2)  # every short-lived packet has expired
        drained = await drain(port, stats)
    return sampler, drained


async def soak(args: argparse.Namespace) -> int:
    problems: list[str] = []
    async with trio.open_nursery() as nursery:
        server = None
        pid: int | None
        if args.port is None:
            server = await ServerProcess.start(nursery)
            port, pid = server.port, server.process.pid
        else:
            port, pid = args.port, args.pid or listener_pid(args.port)
        try:
            sampler, drained = await churn(port, pid, args)
            problems = summary(sampler, args.seconds, drained, print_flush)
            verdict, _ = levelled(sampler.samples)
            if args.require_level and verdict is not True:
                problems.append("resident memory did not level off")
        except* (SoakError, OSError, trio.BrokenResourceError, trio.TooSlowError) as group:
            problems += [f"{type(error).__name__}: {error}" for error in leaves(group)]
        finally:
            if server is not None:
                problems += await stopped(server)
    for problem in problems:
        print_flush(f"PROBLEM: {problem}")
    print_flush("soak: ok" if not problems else f"soak: {len(problems)} problem(s)")
    return 1 if problems else 0


def leaves(group: BaseExceptionGroup[Exception]) -> list[Exception]:
    """The exceptions in a group, nested groups flattened."""
    found: list[Exception] = []
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            found += leaves(error)
        else:
            found.append(error)
    return found


async def stopped(server: ServerProcess) -> list[str]:
    """Stop the server; the problems its exit or its log show."""
    problems = []
    try:
        status = await server.stop()
    except SoakError as error:
        return [str(error)]
    print_flush(f"server exited with status {status}")
    if status != 0:
        problems.append(f"pinpriq-server exited with status {status}")
    tracebacks = [line for line in server.log if "Traceback" in line or " ERROR " in line]
    if tracebacks:
        problems.append(f"pinpriq-server logged {len(tracebacks)} errors: {tracebacks[:3]}")
    return problems


def print_flush(line: str) -> None:
    print(line, flush=True)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pinpriq.soak",
        description="Churn a pinpriq server (pushes with TTLs, pops, subscribers coming and "
        "going) and print its resident memory over time.",
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to churn")
    parser.add_argument(
        "--port", type=int, help="use the server already listening on 127.0.0.1:PORT"
    )
    parser.add_argument("--pid", type=int, help="that server's process id (default: from /proc)")
    parser.add_argument("--connections", type=int, default=12, help="client tasks (default 12)")
    parser.add_argument(
        "--interval", type=float, help="seconds between lines (default: about 12 lines a run)"
    )
    parser.add_argument("--seed", type=int, help="random seed (default: from the clock)")
    parser.add_argument(
        "--require-level",
        action="store_true",
        help="exit 1 if resident memory did not level off",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if not 0 < args.seconds < math.inf or args.connections < 1:
        parser().error("--seconds must be positive and --connections at least 1")
    if args.interval is None:
        args.interval = min(5.0, max(0.5, args.seconds / 12))
    if args.seed is None:
        args.seed = time.time_ns() % 1_000_000
    sys.exit(trio.run(soak, args))


if __name__ == "__main__":
    main()
