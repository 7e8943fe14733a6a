"""The log's costs (issue 12): throughput with ``--data-dir`` against memory only, recovery time,
and disk use under churn. Figures are printed; nothing is asserted.

    python benchmarks/persistence.py throughput   # push and pop, -P 64 and -P 1, 4 connections:
                                                  # memory, everysec, always, and Redis with AOF
                                                  # everysec and always, 5 interleaved rounds
    python benchmarks/persistence.py throughput -P 64 -n 3000000 --modes memory,everysec
                                                  # a drain of 3,000,000 packets: a log of
                                                  # several segments, compaction under way
    python benchmarks/persistence.py throughput --modes memory,no,everysec
                                                  # "no": the log written, never fsynced
    python benchmarks/persistence.py cpu          # CPU per operation, memory, --fsync no and
                                                  # everysec: the server's, the load
                                                  # generator's, the kernel's, idle, steal
    python benchmarks/persistence.py recovery     # 1,000,000 packets (8 B keys, 16 B payloads)
    python benchmarks/persistence.py appends      # a block's pwrite against a copy into a
                                                  # mapping of the segment, by block size
    python benchmarks/persistence.py disk         # 10 GB of 1 KiB payloads through a queue that
                                                  # never holds more than 100 MB (long: minutes)

``throughput`` starts a fresh server for every measurement (a fresh data directory with the
log), drives it with ``pinpriq-bench`` as ``compare_redis.py`` does, and takes each round's
ratio to the memory-only server measured in the same round, and of each policy to Redis with
the same AOF policy (``redis-server --appendonly yes --appendfsync everysec|always``, its AOF
in a fresh directory on the same disk, driven by ``pinpriq-bench --redis``: ZADD and ZPOPMIN),
then the median over rounds. For ``always`` it reports the fsyncs the server made (from the
line it logs when it closes its log): per second of the run, and operations per fsync. The pop
scenario's figures include its prefill, which pushes as many packets as it pops.

``disk`` keeps one queue at a fixed depth (pushes and pops alternating, 64 of each per round
trip, priorities 1..255, so some packets stay queued a long time and pin old segments) and
samples the data directory's allocated size throughout. Data directories go in ``--dir``
(default: a temporary directory on the same disk as /tmp), which should be a real disk: fsync
costs depend on it.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pinpriq.persistence.segments import create_segment

BIN = Path(sys.executable).parent
SERVER = str(BIN / "pinpriq-server")
BENCH = str(BIN / "pinpriq-bench")
LISTENING = re.compile(r"listening on \S+ port (\d+)")
RECOVERED = re.compile(r"recovered (\d+) packets .* in ([\d.]+) s")
CLOSED = re.compile(
    r"log closed: (\d+) blocks \((\d+) bytes\) written, (\d+) fsyncs taking ([\d.]+) s"
)
WORKLOAD = ["-c", "4", "--key-size", "8", "--payload-size", "16", "--prio-levels", "255"]


class Server:
    """A ``pinpriq-server`` with its stderr in a file; stopped with SIGTERM."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self.started = time.monotonic()
        with open(log, "wb") as stderr:
            self.process = subprocess.Popen(
                [SERVER, "--port", "0", "--http-port", "off", *args], stderr=stderr
            )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if match := LISTENING.search(self.text()):
                self.port = int(match.group(1))
                self.listening_after = time.monotonic() - self.started
                return
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited at start: {self.text()[-2000:]}")
            time.sleep(0.01)
        raise SystemExit("the server did not listen within 600 s")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> str:
        terminate(self.process)
        return self.text()


def terminate(process: subprocess.Popen[bytes]) -> None:
    """Stop a server with SIGTERM (it writes and fsyncs what it holds), killing it if it takes
    longer than ten minutes."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


@contextmanager
def data_dir(base: Path | None) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="pinpriq-bench-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def bench(port: int, pid: int, args: list[str]) -> dict[str, Any]:
    command = [BENCH, "--port", str(port), "--json", "-q", "--server-pid", str(pid), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"pinpriq-bench failed: {done.stderr.strip()}")
    result: dict[str, Any] = json.loads(done.stdout)["results"][0]
    return result


# -- throughput -------------------------------------------------------------------------------

MODES = {
    "memory": [],
    "everysec": ["--fsync", "everysec"],
    "always": ["--fsync", "always"],
    "redis-everysec": ["--appendfsync", "everysec"],
    "redis-always": ["--appendfsync", "always"],
    # Not measured unless named in --modes: the log written, never fsynced (what everysec
    # costs beyond its fsyncs).
    "no": ["--fsync", "no"],
    "everysec-512": ["--fsync", "everysec", "--log-segment-size", "512MiB"],
    "everysec-pwrite": ["--fsync", "everysec", "--log-writes", "pwrite"],
}
DEFAULT_MODES = ["memory", "everysec", "always", "redis-everysec", "redis-always"]
#: What each mode's ratio is taken against, measured in the same round.
AGAINST = {
    "everysec": ("memory", "redis-everysec", "no"),
    "always": ("memory", "redis-always"),
    "no": ("memory",),
}


class RedisServer:
    """A ``redis-server`` with its AOF on, in its own directory; stopped with SIGTERM."""

    def __init__(self, args: list[str], directory: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        command += ["--appendonly", "yes", "--dir", str(directory), "--loglevel", "warning"]
        self.process = subprocess.Popen([*command, *args], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.process.poll() is not None:
                raise SystemExit("redis-server exited at start")
            time.sleep(0.02)
        raise SystemExit("redis-server did not listen within 60 s")

    def stop(self) -> None:
        terminate(self.process)


def measure(mode: str, scenario: str, pipeline: int, ops: int, base: Path | None) -> dict[str, Any]:
    workload = ["-t", scenario, "-n", str(ops), "-P", str(pipeline), *WORKLOAD]
    with data_dir(base) as path:
        if mode.startswith("redis"):
            redis = RedisServer(MODES[mode], path)
            try:
                return bench(redis.port, redis.process.pid, ["--redis", *workload])
            finally:
                redis.stop()
        args = MODES[mode] + (["--data-dir", str(path)] if mode != "memory" else [])
        server = Server(args, path.with_suffix(".log"))
        try:
            result = bench(server.port, server.process.pid, workload)
        finally:
            text = server.stop()
            path.with_suffix(".log").unlink()
        if match := CLOSED.search(text):
            fsyncs = int(match.group(3))
            result["fsyncs"] = fsyncs
            result["fsyncs_per_sec"] = fsyncs / result["seconds"]
            ops_logged = ops * (2 if scenario == "pop" else 1)  # pop's prefill pushes as many
            result["ops_per_fsync"] = ops_logged / fsyncs if fsyncs else float("inf")
            result["fsync_ms"] = float(match.group(4)) * 1000 / fsyncs if fsyncs else 0.0
        return result


def throughput(args: argparse.Namespace) -> None:
    cases = [(scenario, pipeline) for pipeline in args.pipelines for scenario in ("push", "pop")]
    rounds: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    ratios: dict[tuple[str, int, str, str], list[float]] = {}
    for round_ in range(args.rounds):
        for scenario, pipeline in cases:
            ops = args.ops if pipeline > 1 else max(1, args.ops // 10)
            measured: dict[str, float] = {}
            for mode in args.modes:
                result = measure(mode, scenario, pipeline, ops, args.dir)
                rounds.setdefault((scenario, pipeline, mode), []).append(result)
                measured[mode] = result["ops_per_sec"]
                print(
                    f"round {round_ + 1} {scenario:4} P{pipeline:<3} {mode:14} "
                    f"{result['ops_per_sec']:>9,.0f} ops/s, "
                    f"server {result.get('server_cpu_us_per_op', 0):.1f} us/op"
                    + (_fsyncs(result) if mode == "always" else ""),
                    flush=True,
                )
            for mode, against in AGAINST.items():
                for other in against:
                    if mode not in measured or other not in measured:
                        continue
                    ratio = measured[mode] / measured[other]
                    ratios.setdefault((scenario, pipeline, mode, other), []).append(ratio)
    print(f"\nmedians over {args.rounds} rounds, 4 connections (-P 1 runs a tenth of the ops):")
    for (scenario, pipeline, mode), results in rounds.items():
        median = statistics.median(r["ops_per_sec"] for r in results)
        line = f"  {scenario:4} P{pipeline:<3} {mode:14} {median:>9,.0f} ops/s"
        for other in AGAINST.get(mode, ()):
            values = ratios.get((scenario, pipeline, mode, other))
            if values is None:
                continue
            line += (
                f"  {statistics.median(values):.2f}x {other} ({min(values):.2f}-{max(values):.2f})"
            )
        if mode == "always":
            line += "; " + ", ".join(
                f"{statistics.median(r[name] for r in results):.{digits}f} {label}"
                for name, digits, label in (
                    ("fsyncs_per_sec", 0, "fsyncs/s"),
                    ("ops_per_fsync", 0, "ops per fsync"),
                    ("fsync_ms", 2, "ms per fsync"),
                )
            )
        print(line)


def _fsyncs(result: dict[str, Any]) -> str:
    return (
        f", {result['fsyncs_per_sec']:.0f} fsyncs/s, {result['ops_per_fsync']:.0f} ops/fsync, "
        f"{result['fsync_ms']:.2f} ms/fsync"
    )


# -- cpu ----------------------------------------------------------------------------------------

CPU_MODES = ("memory", "no", "everysec")


def cpu_per_op(mode: str, scenario: str, ops: int, base: Path | None) -> dict[str, float]:
    """Microseconds per operation in the load generator's window (a pop scenario's prefill
    is outside it): the server's CPU, the load generator's, the rest of the machine's busy time
    (the kernel's threads: writeback, softirqs), its idle and steal time, all cores; and wall
    time."""
    with data_dir(base) as path:
        args = MODES[mode] + (["--data-dir", str(path)] if mode != "memory" else [])
        server = Server(args, path.with_suffix(".log"))
        try:
            workload = ["-t", scenario, "-n", str(ops), "-P", "64", *WORKLOAD]
            result = bench(server.port, server.process.pid, workload)
        finally:
            server.stop()
            path.with_suffix(".log").unlink()
    server_cpu, clients = result["server_cpu_us_per_op"], result["generator_cpu_us_per_op"]
    return {
        "server": server_cpu,
        "clients": clients,
        "rest": result["machine_busy_us_per_op"] - server_cpu - clients,
        "idle": result["machine_idle_us_per_op"],
        "steal": result["machine_steal_us_per_op"],
        "wall": result["seconds"] / ops * 1e6,
    }


def cpu(args: argparse.Namespace) -> None:
    """What the log costs at -P 64, memory-only, ``--fsync no`` (the log written, never
    fsynced) and everysec alternated: the server's CPU, and where the rest of the machine's
    time went, so that a loss of throughput the server's CPU does not account for can be
    placed (the load generator, the kernel's threads, idle waits, steal)."""
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for scenario, ops in (("push", args.ops), ("pop", args.ops // 2)):
            for mode in args.modes:
                runs.setdefault((scenario, mode), []).append(
                    cpu_per_op(mode, scenario, ops, args.dir)
                )
    print(
        f"medians over {args.rounds} rounds, -P 64, 4 connections, us per operation, CPU "
        f"summed over {os.cpu_count()} cores:"
    )
    for scenario in ("push", "pop"):
        memory = {
            kind: statistics.median(v[kind] for v in runs[(scenario, "memory")])
            for kind in ("server", "wall")
        }
        for mode in args.modes:
            values = runs[(scenario, mode)]
            median = {kind: statistics.median(v[kind] for v in values) for kind in values[0]}
            print(
                f"  {scenario:4} {mode:14} server {median['server']:.3f} "
                f"({median['server'] / memory['server']:.2f}x memory), load generator "
                f"{median['clients']:.3f}, kernel and rest {median['rest']:.3f}, idle "
                f"{median['idle']:.3f}, steal {median['steal']:.3f}; wall {median['wall']:.3f} "
                f"({median['wall'] / memory['wall']:.2f}x memory)"
            )


# -- recovery ---------------------------------------------------------------------------------


def recovery(args: argparse.Namespace) -> None:
    with data_dir(args.dir) as path:
        log = path.with_suffix(".log")
        server = Server(["--data-dir", str(path), "--max-memory", "0"], log)
        fill = ["-t", "push-stream", "-n", str(args.packets)]
        bench(server.port, server.process.pid, [*fill, "-P", "64", *WORKLOAD])
        server.stop()
        size = sum(p.stat().st_size for p in path.glob("*.log"))
        print(f"{args.packets:,} packets pushed; {size / 1e6:.0f} MB of segment files")
        recovered, listening = [], []
        for run in range(args.runs):
            server = Server(["--data-dir", str(path), "--max-memory", "0"], log)
            match = RECOVERED.search(server.text())
            if match is None or int(match.group(1)) != args.packets:
                raise SystemExit(f"recovery did not say it recovered them all: {server.text()}")
            recovered.append(float(match.group(2)))
            listening.append(server.listening_after)
            server.stop()
            print(
                f"run {run + 1}: recovered in {recovered[-1]:.2f} s; listening "
                f"{listening[-1]:.2f} s after the process started",
                flush=True,
            )
        log.unlink()
    print(
        f"\nrecovery of {args.packets:,} packets, median of {args.runs}: "
        f"{statistics.median(recovered):.2f} s reading the log, "
        f"{statistics.median(listening):.2f} s from process start to listening"
    )


# -- disk use ---------------------------------------------------------------------------------


def allocated(path: Path) -> int:
    """Bytes the files in ``path`` take on disk (allocated blocks, as ``du`` counts)."""
    return sum(entry.stat().st_blocks * 512 for entry in path.iterdir() if entry.is_file())


class Churn:
    """One connection keeping a queue at a fixed depth: 64 pushes and 64 pops per round trip."""

    PUSH = struct.Struct(">BHHBHH")

    def __init__(self, port: int, payload: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.payload = bytes(payload)
        self.rng = random.Random(1)
        self.next_key = 0
        self.buffer = bytearray()

    def pushes(self, count: int) -> bytes:
        frames = []
        for _ in range(count):
            key = b"%08d" % (self.next_key % 10**8)
            self.next_key += 1
            header = self.PUSH.pack(0x70, 1, 0, self.rng.randint(1, 255), 8, len(self.payload))
            frames.append(header + key + self.payload + b"q")
        return b"".join(frames)

    def round_trip(self, frames: bytes, replies: int) -> int:
        """Send, then read ``replies`` pop replies; returns the packets they held."""
        self.sock.sendall(frames)
        packets = 0
        for _ in range(replies):
            (count,) = struct.unpack(">H", self.read(2))
            packets += count
            for _ in range(count):
                key_len, payload_len = struct.unpack(">HH", self.read(4))
                self.read(key_len + payload_len)
        return packets

    def read(self, size: int) -> bytes:
        while len(self.buffer) < size:
            data = self.sock.recv(1 << 20)
            if not data:
                raise SystemExit("the server closed the connection")
            self.buffer += data
        out = bytes(self.buffer[:size])
        del self.buffer[:size]
        return out


def disk(args: argparse.Namespace) -> None:
    payload = 1024
    depth = args.live_mb * 1_000_000 // (payload + 8)
    total = int(args.gigabytes * 1e9 // payload)
    with data_dir(args.dir) as path:
        log = path.with_suffix(".log")
        server = Server(["--data-dir", str(path), "--fsync", args.fsync], log)
        churn = Churn(server.port, payload)
        pop = b"\x50\x00\x01q"
        for _ in range(depth // 64):  # the queue at its depth, confirmed by a pop of nothing
            churn.round_trip(churn.pushes(64) + b"\x50\x00\x00", 1)
        pushed = depth // 64 * 64
        started = time.monotonic()
        most, samples = 0, []
        rounds = total // 64
        for round_ in range(rounds):
            if churn.round_trip(churn.pushes(64) + pop * 64, 64) != 64:
                raise SystemExit("a pop came back empty or grouped: the queue ran dry")
            pushed += 64
            if round_ % 256 == 0:
                used = allocated(path)
                most = max(most, used)
                samples.append(used)
            if round_ % (rounds // 20 or 1) == 0:
                print(
                    f"{pushed * payload / 1e9:6.2f} GB pushed, disk {allocated(path) / 1e6:6.0f} "
                    f"MB (most so far {most / 1e6:.0f} MB)",
                    flush=True,
                )
        seconds = time.monotonic() - started
        final = allocated(path)
        text = server.stop()
        log.unlink()
    closed = CLOSED.search(text)
    print(
        f"\n{pushed * payload / 1e9:.1f} GB of {payload}-byte payloads pushed and popped in "
        f"{seconds:.0f} s ({rounds * 128 / seconds:,.0f} ops/s) through a queue held at "
        f"{depth:,} packets ({depth * (payload + 8) / 1e6:.0f} MB of keys and payloads), "
        f"--fsync {args.fsync}, 32 MiB segments:\n"
        f"  disk use: at most {most / 1e6:.0f} MB, median {statistics.median(samples) / 1e6:.0f}"
        f" MB, at the end {final / 1e6:.0f} MB"
    )
    if closed:
        print(
            f"  log: {int(closed.group(2)) / 1e9:.1f} GB written in {closed.group(1)} blocks; "
            + text[closed.end() :].split("\n", 1)[0].strip(", ")
        )


# -- appends ----------------------------------------------------------------------------------

MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a mapping's pages in, writable, ahead of use
APPEND_HOWS = (
    "pwrite",
    "pwrite, read through",
    "mapped",
    "mapped, read through",
    "mapped, populated",
)


def append_us(how: str, block: int, base: Path | None) -> float:
    """Microseconds per append of ``block`` bytes through one 32 MiB segment made as the log
    makes one (``create_segment``: its space reserved with ``posix_fallocate``, then read
    through, so its pages are cached), by ``pwrite`` or by a copy into a shared mapping of the
    file; without "read through" its pages are dropped from the cache first, as before the
    log read its segments through; "populated": faulted in writable ahead
    (``MADV_POPULATE_WRITE``), which dirties them all. Either way the bytes are in the page
    cache when the call returns: what ``--fsync everysec`` needs of a write before its reply
    goes out."""
    size = 32 << 20
    data, count = os.urandom(block), size // block - 1
    with data_dir(base) as path:
        fd = create_segment(path / "segment", size)
        try:
            if "read through" not in how:
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)  # clean: dropped
            if how.startswith("pwrite"):
                started = time.perf_counter()
                for i in range(count):
                    os.pwrite(fd, data, i * block)
                return (time.perf_counter() - started) / count * 1e6
            with mmap.mmap(fd, size) as mapped:
                if how == "mapped, populated":
                    mapped.madvise(MADV_POPULATE_WRITE)
                started = time.perf_counter()
                for i in range(count):
                    mapped[i * block : (i + 1) * block] = data
                return (time.perf_counter() - started) / count * 1e6
        finally:
            os.close(fd)


def appends(args: argparse.Namespace) -> None:
    """What a block's write costs the server, by size (a -P 1 request's block is about 160
    bytes, a turn of 64 pushes about 2.5 KiB, of two connections' 6.9 KiB)."""
    print(f"us per append into a 32 MiB segment, median of {args.rounds} runs:")
    for block in args.blocks:
        figures = [
            statistics.median(append_us(how, block, args.dir) for _ in range(args.rounds))
            for how in APPEND_HOWS
        ]
        print(
            f"  {block:>6} B: "
            + ", ".join(f"{how} {us:.2f}" for how, us in zip(APPEND_HOWS, figures, strict=True))
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="where data directories go (a real disk)")
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser(
        "throughput", help="ops/s with a log against memory only and Redis with AOF"
    )
    one.add_argument("--rounds", type=int, default=5)
    # 1,000,000 ops make each -P 64 measurement last a second or more: at 200,000 one lasted
    # 0.13-0.2 s and a round's ratio moved by 0.3 with the machine's noise.
    one.add_argument(
        "-n", dest="ops", type=int, default=1_000_000, help="ops at -P 64 (default: 1,000,000)"
    )
    one.add_argument(
        "-P", dest="pipelines", type=int, action="append", help="pipelines (default: 64 and 1)"
    )
    one.add_argument(
        "--modes",
        type=lambda text: text.split(","),
        default=DEFAULT_MODES,
        help=f"which to measure, comma-separated, of {','.join(MODES)} (default: "
        f"{','.join(DEFAULT_MODES)})",
    )
    cpu_command = commands.add_parser("cpu", help="the server's CPU per operation, with a log")
    cpu_command.add_argument("--rounds", type=int, default=5)
    cpu_command.add_argument("-n", dest="ops", type=int, default=600_000, help="pushes")
    cpu_command.add_argument(
        "--modes",
        type=lambda text: text.split(","),
        default=list(CPU_MODES),
        help=f"which to measure, comma-separated, memory first (default: {','.join(CPU_MODES)})",
    )
    two = commands.add_parser("recovery", help="time to recover a log of N packets")
    two.add_argument("--packets", type=int, default=1_000_000)
    two.add_argument("--runs", type=int, default=3)
    three = commands.add_parser("disk", help="disk use while GBs go through a bounded queue")
    three.add_argument("--gigabytes", type=float, default=10.0)
    three.add_argument("--live-mb", type=int, default=100)
    three.add_argument("--fsync", default="everysec", choices=["always", "everysec", "no"])
    four = commands.add_parser("appends", help="a block's pwrite against a copy into a mapping")
    four.add_argument("--rounds", type=int, default=3)
    four.add_argument(
        "--blocks",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[160, 2560, 6900, 10240],
    )
    args = parser.parse_args()
    if args.command == "throughput" and not args.pipelines:
        args.pipelines = [64, 1]
    if args.command in ("throughput", "cpu") and (unknown := set(args.modes) - set(MODES)):
        parser.error(f"--modes: no such mode {', '.join(sorted(unknown))}")
    if args.command == "cpu" and "memory" not in args.modes:
        parser.error("--modes: memory is the baseline, and must be among them")
    if args.dir is not None:
        os.makedirs(args.dir, exist_ok=True)
    commands_run = {
        "throughput": throughput,
        "cpu": cpu,
        "recovery": recovery,
        "disk": disk,
        "appends": appends,
    }
    commands_run[args.command](args)


if __name__ == "__main__":
    main()
