"""Jobs on leases: pinpriq's reserve + ack against its own plain pop, and against beanstalkd's
reserve + delete, on the same load, in the same run.

    python benchmarks/compare_beanstalkd.py            # 3 rounds, about 5 minutes
    python benchmarks/compare_beanstalkd.py --quick    # 1 round on small counts, a smoke run
    python benchmarks/compare_beanstalkd.py --without-beanstalkd

Each measurement starts a fresh server on a free loopback port (``pinpriq-server``, or
``beanstalkd`` with no binlog, so both keep jobs in memory), queues N jobs (8-byte keys, 16-byte
payloads, priorities uniform in 1..255) without timing it, then lets 4 client processes take
all N jobs, timed: each keeps a pipeline of P requests in flight. Per round trip a client sends
P takes and, for leases, the acks (deletes) of the P jobs of its previous round trip, and reads
every answer; so reserve + ack costs one round trip per P jobs, as pop does. Lease ids and
beanstalkd job ids are read from the replies, never guessed. Reported: jobs per second (median
of the rounds, and their range), the server's CPU time per job (from /proc), and the ratios.

beanstalkd is installed from the distribution's packages when missing (we run as root), as
``compare_redis.py`` installs redis-server. Every server started is killed on exit, and every
step gives up after a bounded time. This is the benchmark of issue 16; it prints its figures and
asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import random
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

BIN = Path(sys.executable).parent
CLIENTS = 4
KEY_SIZE, PAYLOAD_SIZE = 8, 16
LEASE_MS = 600_000  # long enough that no lease lapses during a run
#: Seconds any one step (a start, a fill, a timed run) may take before the harness gives up.
STEP_SECONDS = 600
QUEUE = b"jobs"

_U16 = struct.Struct(">H")
_PUSH = struct.Struct(">BHHBHH")
_RESERVE = b"\x52" + struct.pack(">IH", LEASE_MS, len(QUEUE)) + QUEUE
_POP = b"\x50" + _U16.pack(len(QUEUE)) + QUEUE
_SYNC = b"\x21"
_ACK = struct.Struct(">BQ")
#: What a reserve reply, an ack's answer and a pop reply of this load look like: fixed sizes.
_LEASE_REPLY = 11 + 4 + KEY_SIZE + PAYLOAD_SIZE
_STATUS = 11
_POP_REPLY = 2 + 4 + KEY_SIZE + PAYLOAD_SIZE


def log(message: str) -> None:
    print(f"[compare_beanstalkd] {message}", file=sys.stderr, flush=True)


def job(index: int) -> tuple[bytes, bytes, int]:
    """The key, payload and priority of job ``index``: the load both servers get."""
    rng = random.Random(index)
    return index.to_bytes(KEY_SIZE, "big"), rng.randbytes(PAYLOAD_SIZE), rng.randint(1, 255)


# -- servers ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def ensure_beanstalkd() -> None:
    """Install beanstalkd from the distribution if it is missing."""
    if shutil.which("beanstalkd"):
        return
    log("beanstalkd missing: apt-get install -y beanstalkd")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "beanstalkd"]
    if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
        subprocess.run(install, env=env, check=True, capture_output=True, timeout=600)


@contextlib.contextmanager
def server(kind: str) -> Iterator[tuple[int, int]]:
    """A fresh server of ``kind`` on a free loopback port: yields its port and pid."""
    port = free_port()
    if kind == "beanstalkd":
        command = ["beanstalkd", "-l", "127.0.0.1", "-p", str(port)]
    else:
        command = [str(BIN / "pinpriq-server"), "--port", str(port), "--log-level", "warning"]
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors)
        try:
            _wait_listening(port, process)
            yield port, process.pid
        finally:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


def _wait_listening(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{process.args[0]} exited with status {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.05)
    raise SystemExit(f"{process.args[0]} did not listen within 30 s")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the wire: each server's fill and its take loop -------------------------------------------


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=STEP_SECONDS)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_exactly(sock: socket.socket, size: int, buffer: bytearray) -> bytes:
    while len(buffer) < size:
        chunk = sock.recv(max(65536, size - len(buffer)))
        if not chunk:
            raise SystemExit("the server closed a connection")
        buffer += chunk
    data = bytes(buffer[:size])
    del buffer[:size]
    return data


def fill_pinpriq(port: int, jobs: int) -> None:
    with connect(port) as sock:
        for start in range(0, jobs, 4096):
            frames = []
            for key, payload, prio in map(job, range(start, min(jobs, start + 4096))):
                frames.append(_PUSH.pack(0x70, len(QUEUE), 0, prio, KEY_SIZE, PAYLOAD_SIZE))
                frames.append(key + payload + QUEUE)
            sock.sendall(b"".join(frames))
        sock.sendall(_SYNC)
        if read_exactly(sock, 2, bytearray()) != b"\0\0":
            raise SystemExit("pinpriq did not confirm the fill")


def fill_beanstalkd(port: int, jobs: int) -> None:
    with connect(port) as sock:
        buffer = bytearray()
        for start in range(0, jobs, 4096):
            batch = range(start, min(jobs, start + 4096))
            frames = [b"put %d 0 600 24\r\n%s\r\n" % (p, k + v) for k, v, p in map(job, batch)]
            sock.sendall(b"".join(frames))
            for _ in batch:
                while b"\r\n" not in buffer:
                    buffer += sock.recv(65536)
                line, _, rest = bytes(buffer).partition(b"\r\n")
                buffer[:] = rest
                if not line.startswith(b"INSERTED"):
                    raise SystemExit(f"beanstalkd refused a put: {line!r}")


def take_pinpriq_pops(sock: socket.socket, jobs: int, pipeline: int) -> None:
    buffer = bytearray()
    for done in range(0, jobs, pipeline):
        count = min(pipeline, jobs - done)
        sock.sendall(_POP * count)
        replies = read_exactly(sock, _POP_REPLY * count, buffer)
        if replies[:2] != b"\0\1":
            raise SystemExit("a pop found nothing")


def take_pinpriq_leases(sock: socket.socket, jobs: int, pipeline: int) -> None:
    buffer = bytearray()
    held: list[int] = []  # lease ids of the previous round trip, acked with this one
    for done in range(0, jobs + pipeline, pipeline):
        count = min(pipeline, max(0, jobs - done))
        if not count and not held:
            break
        sock.sendall(b"".join(_ACK.pack(0x4B, lease) for lease in held) + _RESERVE * count)
        answers = read_exactly(sock, _STATUS * len(held) + _LEASE_REPLY * count, buffer)
        statuses = answers[8 : _STATUS * len(held) : _STATUS]
        if statuses.count(1) != len(held):
            raise SystemExit("an ack found its lease gone")
        first = _STATUS * len(held)
        held = [
            int.from_bytes(answers[at : at + 8], "big")
            for at in range(first, len(answers), _LEASE_REPLY)
        ]
        if not all(held):
            raise SystemExit("a reserve found nothing")


def take_beanstalkd(sock: socket.socket, jobs: int, pipeline: int) -> None:
    buffer = bytearray()
    held: list[bytes] = []  # job ids of the previous round trip, deleted with this one
    for done in range(0, jobs + pipeline, pipeline):
        count = min(pipeline, max(0, jobs - done))
        if not count and not held:
            break
        deletes = b"".join(b"delete %s\r\n" % job_id for job_id in held)
        sock.sendall(deletes + b"reserve-with-timeout 0\r\n" * count)
        for _ in held:
            if _line(sock, buffer) != b"DELETED":
                raise SystemExit("beanstalkd did not delete a job")
        held = []
        for _ in range(count):
            head = _line(sock, buffer).split()
            if head[0] != b"RESERVED":
                raise SystemExit(f"beanstalkd answered a reserve with {head!r}")
            read_exactly(sock, int(head[2]) + 2, buffer)  # the job's body and its \r\n
            held.append(head[1])


def _line(sock: socket.socket, buffer: bytearray) -> bytes:
    while (end := buffer.find(b"\r\n")) < 0:
        chunk = sock.recv(65536)
        if not chunk:
            raise SystemExit("beanstalkd closed a connection")
        buffer += chunk
    line = bytes(buffer[:end])
    del buffer[: end + 2]
    return line


TAKE = {
    "pinpriq pop": take_pinpriq_pops,
    "pinpriq reserve+ack": take_pinpriq_leases,
    "beanstalkd reserve+delete": take_beanstalkd,
}


# -- a measurement ----------------------------------------------------------------------------


def _client(mode: str, port: int, jobs: int, pipeline: int, start: object) -> tuple[int, int]:
    with connect(port) as sock:
        start.wait(STEP_SECONDS)  # type: ignore[attr-defined]
        began = time.monotonic_ns()
        TAKE[mode](sock, jobs, pipeline)
        return began, time.monotonic_ns()


def measure(mode: str, jobs: int, pipeline: int) -> tuple[float, float]:
    """Jobs per second, and server CPU microseconds per job, of one run of ``mode``."""
    kind = mode.split()[0]
    with server(kind) as (port, pid):
        (fill_beanstalkd if kind == "beanstalkd" else fill_pinpriq)(port, jobs)
        shares = [jobs // CLIENTS + (i < jobs % CLIENTS) for i in range(CLIENTS)]
        context = multiprocessing.get_context("fork")
        with context.Manager() as manager, context.Pool(CLIENTS) as pool:
            start = manager.Barrier(CLIENTS + 1)
            runs = [
                pool.apply_async(_client, (mode, port, share, pipeline, start)) for share in shares
            ]
            cpu = cpu_seconds(pid)
            start.wait(STEP_SECONDS)
            times = [run.get(STEP_SECONDS) for run in runs]
            cpu = cpu_seconds(pid) - cpu
    seconds = (max(end for _, end in times) - min(began for began, _ in times)) / 1e9
    return jobs / seconds, cpu / jobs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round on small counts")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; medians are reported")
    parser.add_argument("-n", type=int, default=200_000, help="jobs per run at -P 64")
    parser.add_argument("--n1", type=int, default=20_000, help="jobs per run at -P 1")
    parser.add_argument(
        "--without-beanstalkd", action="store_true", help="pinpriq only (no install)"
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.n, args.n1 = 1, 20_000, 2_000
    modes = list(TAKE)
    if args.without_beanstalkd:
        modes.remove("beanstalkd reserve+delete")
    else:
        ensure_beanstalkd()
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for round_number in range(1, args.rounds + 1):
        for pipeline, jobs in ((64, args.n), (1, args.n1)):
            for mode in modes:  # alternated, so a drift in the machine's load hits all alike
                rate, cpu = measure(mode, jobs, pipeline)
                results.setdefault((mode, pipeline), []).append((rate, cpu))
                log(f"round {round_number}: {mode} -P {pipeline}: {rate:,.0f} jobs/s")
    report(results, args, modes)


def report(
    results: dict[tuple[str, int], list[tuple[float, float]]],
    args: argparse.Namespace,
    modes: list[str],
) -> None:
    print(f"{CLIENTS} client processes, {KEY_SIZE}-byte keys, {PAYLOAD_SIZE}-byte payloads, ")
    print(f"{args.rounds} rounds; {args.n:,} jobs per run at -P 64, {args.n1:,} at -P 1\n")
    print("| mode | -P | jobs/s (median) | range | server CPU per job |")
    print("|---|---|---|---|---|")
    medians: dict[tuple[str, int], float] = {}
    for (mode, pipeline), runs in results.items():
        rates = [rate for rate, _ in runs]
        medians[mode, pipeline] = statistics.median(rates)
        cpu = statistics.median(cpu for _, cpu in runs)
        print(
            f"| {mode} | {pipeline} | {medians[mode, pipeline]:,.0f} | "
            f"{min(rates):,.0f} - {max(rates):,.0f} | {cpu:.1f} us |"
        )
    print()
    for pipeline in (64, 1):
        lease = medians["pinpriq reserve+ack", pipeline]
        pop = medians["pinpriq pop", pipeline]
        print(f"-P {pipeline}: reserve+ack / pop = {lease / pop:.2f}")
        if "beanstalkd reserve+delete" in modes:
            beanstalkd = medians["beanstalkd reserve+delete", pipeline]
            print(
                f"-P {pipeline}: pinpriq reserve+ack / beanstalkd reserve+delete = "
                f"{lease / beanstalkd:.2f}"
            )


if __name__ == "__main__":
    main()
