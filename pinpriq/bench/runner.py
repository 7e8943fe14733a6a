"""The parent of a run: start the client processes, show progress, and aggregate their figures.

Every client connection runs in a process of its own (``multiprocessing``), so the generator
has as many cores as the machine gives it and is not what is measured. Each client reports its
start and end (``monotonic_ns``, which is system-wide on Linux, so the processes' clocks agree),
its CPU time, and its batch round-trip times; the parent aggregates: ops/s over the union of the
clients' windows, latency percentiles over all batches (one op per batch at ``-P 1``).

Knows nothing of the command line: ``run_scenario`` takes a ``Workload`` and returns a dict.
"""

from __future__ import annotations

import array
import contextlib
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

from pinpriq.bench.clients import (
    SETUP_SECONDS,
    Sync,
    publisher,
    subscriber_process,
    subscriber_processes,
    throughput_client,
)
from pinpriq.bench.lifetime import die_with_parent, require_main_thread
from pinpriq.bench.workload import BenchError, Workload

OTHER_FAILED = "another client process failed"

ClientFn = Callable[[Workload, int, bytes, Sync], dict[str, Any]]


def _child(
    fn: ClientFn, w: Workload, index: int, queue: bytes, sync: Sync, out: Any
) -> None:  # pragma: no cover - runs in a child process
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # and it stops us with SIGTERM
    die_with_parent()
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
        return [publisher] * w.clients + [subscriber_process] * subscriber_processes(w)
    return [throughput_client] * w.clients


def _start(
    w: Workload, queue: bytes
) -> tuple[list[multiprocessing.process.BaseProcess], list[Any], Sync]:
    # fork starts a client in milliseconds; the parent holds no threads or sockets then. The
    # clients die with the thread that forks them: only the main thread lives as long as we do.
    require_main_thread("run_scenario")
    ctx: Any = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    roles = _roles(w)
    sync = Sync(
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


def _collect(w: Workload, pipes: list[Any], sync: Sync, progress: Progress) -> list[dict[str, Any]]:
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
        server_cpu, machine = _cpu_seconds(server_pid), _machine_seconds()
        results = _collect(w, pipes, sync, progress)
        server_cpu = _cpu_seconds(server_pid) - server_cpu
        machine = {kind: value - machine[kind] for kind, value in _machine_seconds().items()}
    finally:
        progress.clear()
        _stop(processes)
    if w.scenario == "subscribe":
        summary = _subscribe_summary(w, results)
    else:
        summary = _throughput_summary(w, results)
    if server_pid is not None:
        summary["server_cpu_us_per_op"] = round(server_cpu * 1e6 / max(w.ops, 1), 3)
    for kind, seconds in machine.items():
        summary[f"machine_{kind}_us_per_op"] = round(seconds * 1e6 / max(w.ops, 1), 3)
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


def _machine_seconds() -> dict[str, float]:
    """The whole machine's CPU time so far, all cores, by kind (``/proc/stat``; zeros where
    there is none): busy (user, nice, system, irq, softirq), idle (idle and I/O wait) and steal
    (time the hypervisor gave to other guests). Beside the server's and the generator's CPU it
    tells whether a run saturated the machine, and what the kernel's own threads took."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return {"busy": 0.0, "idle": 0.0, "steal": 0.0}
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    return {
        "busy": (user + nice + system + irq + softirq) / tick,
        "idle": (idle + iowait) / tick,
        "steal": steal / tick,
    }


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
