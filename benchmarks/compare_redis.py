"""Side-by-side: pinpriq-server against redis-server, driven by the same generator.

Starts a fresh ``redis-server`` (no persistence) and a fresh ``pinpriq-server`` on free loopback
ports for every measurement, runs ``pinpriq-bench`` against each (``--redis`` speaks ZADD /
ZPOPMIN through the same client code), alternates the two round after round, and writes the
medians, ranges and per-round ratios to ``docs/performance.md`` below its hand-written intro.
It installs redis-server with apt-get when it is missing, kills every server it started on
exit (Ctrl-C and errors included), and gives up on any one step after a bounded time. Two
ceilings run beside them: ``null_server.py`` (the generator's) and ``trio_null_server.py``
(pinpriq's socket loop and codec with no store: what pinpriq could reach at P64 and P1).

    python benchmarks/compare_redis.py            # 5 rounds, about 10 minutes
    python benchmarks/compare_redis.py --quick    # 1 round on small counts, a smoke run

The workload is the one of issue 5: 8-byte unique keys, 16-byte payloads, priorities uniform in
1..255, 4 client processes. What this module must not know: any byte of either protocol (that
is pinpriq-bench's).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "performance.md"
MARKER = "<!-- Everything below is written by benchmarks/compare_redis.py; edit above only. -->"
BIN = Path(sys.executable).parent
#: Longest any one bench run may take before the harness gives up on it.
RUN_SECONDS = 900
WORKLOAD = ["--key-size", "8", "--payload-size", "16", "--prio-levels", "255"]


def log(message: str) -> None:
    print(f"[compare_redis] {message}", file=sys.stderr, flush=True)


# -- servers --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def ensure_redis() -> None:
    """Install redis-server from the distribution if it is missing (we run as root)."""
    if shutil.which("redis-server"):
        return
    log("redis-server missing: apt-get install -y redis-server")
    install = ["apt-get", "install", "-y", "redis-server"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
        subprocess.run(install, env=env, check=True, capture_output=True, timeout=600)


class Servers:
    """Every server process this run started, so that all of them die with it."""

    def __init__(self) -> None:
        self.live: list[subprocess.Popen[bytes]] = []

    def start(self, kind: str) -> tuple[subprocess.Popen[bytes], int, list[str]]:
        """A fresh server of ``kind``; returns it, its port and its command line."""
        if kind == "redis":
            port = free_port()
            command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
            command += ["--save", "", "--appendonly", "no", "--loglevel", "warning"]
            process = self._spawn(command)
            _wait_listening(port, process)
            return process, port, command
        if kind == "null":
            command = [sys.executable, str(ROOT / "benchmarks" / "null_server.py")]
            command += ["--reply-packet"]
        elif kind == "trio-null":
            command = [sys.executable, str(ROOT / "benchmarks" / "trio_null_server.py")]
        else:
            command = [str(BIN / "pinpriq-server"), "--port", "0", "--http-port", "0"]
        process = self._spawn(command, stderr_file=True)
        port = _port_from_log(process)
        _wait_listening(port, process)
        return process, port, command

    def _spawn(self, command: list[str], stderr_file: bool = False) -> subprocess.Popen[bytes]:
        # The log file lives as long as the server; stop() closes it.
        stderr = tempfile.TemporaryFile() if stderr_file else subprocess.DEVNULL  # noqa: SIM115
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        process.log = stderr  # type: ignore[attr-defined]
        self.live.append(process)
        return process

    def stop(self, process: subprocess.Popen[bytes]) -> None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
        with contextlib.suppress(AttributeError, OSError):
            process.log.close()  # type: ignore[attr-defined]
        self.live.remove(process)

    def stop_all(self) -> None:
        for process in list(self.live):
            self.stop(process)


def _port_from_log(process: subprocess.Popen[bytes]) -> int:
    """The port a server reports in its first log line (it was started on port 0)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        process.log.seek(0)  # type: ignore[attr-defined]
        text = process.log.read().decode(errors="replace")  # type: ignore[attr-defined]
        match = re.search(r"listening on \S+ port (\d+)", text)
        if match:
            return int(match.group(1))
        if process.poll() is not None:
            raise RuntimeError(f"server exited at start: {text.strip()[-300:]}")
        time.sleep(0.05)
    raise RuntimeError("server did not report its port within 15 s")


def _wait_listening(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode} at start")
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after 15 s")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


# -- scenarios --------------------------------------------------------------------------------


@attrs.frozen
class Scenario:
    name: str
    title: str
    bench: list[str]  # pinpriq-bench arguments, less host, port and --redis
    targets: tuple[str, ...] = ("redis", "pinpriq")
    metric: str = "ops_per_sec"  # key of the result, or latency_us.p99 and the like
    memory_packets: int = 0  # measure RSS before and after: packets queued by the run


def scenarios(quick: bool) -> list[Scenario]:
    n, n1, deep = (40_000, 4_000, 100_000) if quick else (400_000, 40_000, 1_000_000)
    light = 500 if quick else 5_000

    def bench(text: str, clients: int = 4) -> list[str]:
        return [*text.split(), "-c", str(clients), *WORKLOAD]

    subscribers = "-t subscribe --subscribers 100 --prefetch 1 -P 1 --rate 1000"
    return [
        Scenario("push-p64", "push, -P 64", bench(f"-t push -P 64 -n {n}")),
        Scenario("pop-p64", "pop, -P 64", bench(f"-t pop -P 64 -n {n}")),
        Scenario("push-p1", "push, -P 1", bench(f"-t push -P 1 -n {n1}")),
        Scenario("pop-p1", "pop, -P 1", bench(f"-t pop -P 1 -n {n1}")),
        Scenario(
            "mix-depth-1k",
            "push/pop mix at depth 1,000",
            bench(f"-t mix -P 64 -n {n} --prefill 1000"),
        ),
        Scenario(
            "mix-depth-1m",
            f"push/pop mix at depth {deep:,}",
            bench(f"-t mix -P 64 -n {n} --prefill {deep}"),
        ),
        Scenario(
            "pop-grouped",
            "pop, 10,000 keys in groups of 10",
            bench("-t pop -P 64 -n 10000 --prefill 90000 --keys 10000"),
        ),
        Scenario(
            "memory",
            f"{deep:,} packets queued (push-stream)",
            bench(f"-t push-stream -P 64 -n {deep}"),
            memory_packets=deep,
        ),
        Scenario(
            "subscribe-100",
            f"100 subscribers, light load ({light:,} pushes at 1,000/s)",
            bench(f"{subscribers} -n {light}", clients=1),
            targets=("pinpriq",),
            metric="latency_us.p99",
        ),
        Scenario(
            "light-p1",
            f"push, -P 1, 1 connection paced at 1,000/s ({light:,} ops): the machine's floor",
            bench(f"-t push -P 1 --rate 1000 -n {light}", clients=1),
        ),
        Scenario(
            "subscribe-64",
            "1 subscriber, prefetch 64",
            bench(f"-t subscribe --subscribers 1 --prefetch 64 -P 64 -n {n // 2}"),
            targets=("pinpriq",),
            metric="deliveries_per_sec",
        ),
        Scenario(
            "ceiling-push",
            "push, -P 64",
            bench(f"-t push -P 64 -n {n}"),
            targets=("null",),
        ),
        Scenario(
            "ceiling-pop",
            "pop, -P 64 (one-packet replies)",
            bench(f"-t pop -P 64 -n {n}"),
            targets=("null",),
        ),
        *(
            Scenario(
                f"trio-ceiling-{op}-p{depth}",
                f"{op}, -P {depth}",
                bench(f"-t {op} -P {depth} -n {n if depth == 64 else n1}"),
                targets=("trio-null",),
            )
            for depth in (64, 1)
            for op in ("push", "pop")
        ),
        *(
            Scenario(
                f"redis-benchmark-p{depth}",
                f"-P {depth}",
                f"-c 4 -P {depth} -n {count} -r 1000000000 -t zadd,zpopmin --csv".split(),
                targets=("redis-benchmark",),
            )
            for depth, count in ((64, n), (1, n1))
        ),
    ]


def bench_command(scenario: Scenario, kind: str, port: int, pid: int) -> list[str]:
    if kind == "redis-benchmark":
        return ["redis-benchmark", "-p", str(port), *scenario.bench]
    command = [str(BIN / "pinpriq-bench"), "--port", str(port), "--json", "-q"]
    command += ["--server-pid", str(pid), *(["--redis"] if kind == "redis" else [])]
    return command + scenario.bench


def measure(servers: Servers, scenario: Scenario, kind: str) -> dict[str, Any]:
    """One bench run against a fresh server of ``kind``; the result, with memory if asked."""
    process, port, server_command = servers.start("redis" if kind == "redis-benchmark" else kind)
    try:
        before = rss_bytes(process.pid)
        command = bench_command(scenario, kind, port, process.pid)
        status, stdout, stderr = run_bench(command)
        if status != 0:
            raise RuntimeError(f"{scenario.name} on {kind}: {stderr.strip()}")
        result = (
            _redis_benchmark_csv(stdout)
            if kind == "redis-benchmark"
            else json.loads(stdout)["results"][0]
        )
        if scenario.memory_packets:
            grown = rss_bytes(process.pid) - before
            result["rss_grown_bytes"] = grown
            result["rss_bytes_per_packet"] = round(grown / scenario.memory_packets, 1)
            result["overhead_bytes_per_packet"] = round(grown / scenario.memory_packets - 24, 1)
        result["server_command"] = server_command
        result["bench_command"] = command
        return dict(result)
    finally:
        servers.stop(process)


def run_bench(command: list[str]) -> tuple[int, str, str]:
    """Run a load generator to its end; on Ctrl-C, a timeout or any error, stop it with SIGTERM
    so that it stops its own client processes (SIGKILL would orphan them)."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as bench:
        try:
            stdout, stderr = bench.communicate(timeout=RUN_SECONDS)
        except BaseException:
            bench.terminate()
            try:
                bench.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                bench.kill()
            raise
        return bench.returncode, stdout, stderr


def _redis_benchmark_csv(text: str) -> dict[str, Any]:
    """redis-benchmark --csv: a header, then one line per test; keep requests per second."""
    rows = list(csv.reader(text.splitlines()))
    return {row[0]: float(row[1]) for row in rows[1:] if len(row) > 1}


def metric(result: dict[str, Any], name: str) -> float:
    value: Any = result
    for part in name.split(".", 1):  # "latency_us.p99.9": the percentile's name has a dot
        value = value[part]
    return float(value)


# -- the report ------------------------------------------------------------------------------

Results = dict[str, dict[str, list[dict[str, Any]]]]  # scenario -> server kind -> rounds


def machine() -> dict[str, str]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        cpu = next((ln.split(":", 1)[1].strip() for ln in info if "model name" in ln), cpu)
    redis = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    import trio  # the server's event loop; imported here only for its version

    return {
        "cores (nproc)": str(os.cpu_count()),
        "CPU": cpu,
        "kernel": platform.release(),
        "Python": platform.python_version(),
        "trio": trio.__version__,
        "Redis": redis.stdout.split(" sha=")[0].strip(),
        "pinpriq commit": commit.stdout.strip() or "unknown",
    }


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def spread(values: list[float], digits: int = 0) -> str:
    """``median (min-max)``, thousands separated."""
    fmt = f"{{:,.{digits}f}}"
    median = fmt.format(statistics.median(values))
    if len(values) == 1:
        return median
    return f"{median} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def values(results: Results, scenario: str, kind: str, name: str) -> list[float]:
    return [metric(r, name) for r in results.get(scenario, {}).get(kind, [])]


def ratios(results: Results, scenario: str, name: str = "ops_per_sec") -> list[float]:
    """pinpriq / Redis, round by round."""
    ours = values(results, scenario, "pinpriq", name)
    theirs = values(results, scenario, "redis", name)
    return [a / b for a, b in zip(ours, theirs, strict=False) if b]


@attrs.frozen
class Target:
    text: str
    scenarios: tuple[str, ...]
    figure: Callable[[Results], list[float]]  # per round
    met: Callable[[float], bool]
    unit: str


def _depth(results: Results) -> list[float]:
    deep = values(results, "mix-depth-1m", "pinpriq", "ops_per_sec")
    shallow = values(results, "mix-depth-1k", "pinpriq", "ops_per_sec")
    return [a / b for a, b in zip(deep, shallow, strict=False) if b]


def _packet_ratios(results: Results, scenario: str) -> list[float]:
    """pinpriq / Redis in packets per second (a grouped pop returns its whole key group, a
    ZPOPMIN one member), round by round."""
    ours = [r["packets"] / r["seconds"] for r in results.get(scenario, {}).get("pinpriq", [])]
    theirs = [r["packets"] / r["seconds"] for r in results.get(scenario, {}).get("redis", [])]
    return [a / b for a, b in zip(ours, theirs, strict=False) if b]


TARGETS = [
    Target("push -P 64 at least 1.3x Redis ZADD", ("push-p64",),
           lambda r: ratios(r, "push-p64"), lambda x: x >= 1.3, "x Redis"),
    Target("pop -P 64 at least 1.3x Redis ZPOPMIN", ("pop-p64",),
           lambda r: ratios(r, "pop-p64"), lambda x: x >= 1.3, "x Redis"),
    Target("push -P 1, 4 connections, at least 0.9x Redis", ("push-p1",),
           lambda r: ratios(r, "push-p1"), lambda x: x >= 0.9, "x Redis"),
    Target("pop -P 1, 4 connections, at least 0.9x Redis", ("pop-p1",),
           lambda r: ratios(r, "pop-p1"), lambda x: x >= 0.9, "x Redis"),
    Target("depth 1,000,000 at least 0.9x depth 1,000", ("mix-depth-1k", "mix-depth-1m"),
           _depth, lambda x: x >= 0.9, "x depth 1,000"),
    Target("groups of 10: packets/s at least 1.0x ZPOPMIN members/s", ("pop-grouped",),
           lambda r: _packet_ratios(r, "pop-grouped"), lambda x: x >= 1.0, "x Redis"),
    Target("at most 140 bytes RSS per packet, key and payload included", ("memory",),
           lambda r: values(r, "memory", "pinpriq", "rss_bytes_per_packet"),
           lambda x: x <= 140, "bytes"),
    Target("100 subscribers, light load: push-to-delivery p99 under 1 ms", ("subscribe-100",),
           lambda r: values(r, "subscribe-100", "pinpriq", "latency_us.p99"),
           lambda x: x < 1000, "us"),
    Target("1 subscriber, prefetch 64: at least 100k deliveries/s", ("subscribe-64",),
           lambda r: values(r, "subscribe-64", "pinpriq", "deliveries_per_sec"),
           lambda x: x >= 100_000, "deliveries/s"),
]  # fmt: skip


def shell(command: list[str]) -> str:
    """A command line as someone would type it: console scripts by name, ports as $PORT."""
    words = [Path(w).name if w.startswith(str(BIN)) else w for w in command]
    words = [w.replace(str(ROOT) + "/", "") for w in words]
    for flag in ("--port", "--server-pid"):
        if flag in words:
            words[words.index(flag) + 1] = "$PORT" if flag == "--port" else "$SERVER_PID"
    return shlex.join(words).replace("'$PORT'", "$PORT").replace("'$SERVER_PID'", "$SERVER_PID")


def report(results: Results, info: dict[str, str], chosen: list[Scenario], rounds: int) -> str:
    out = [MARKER, "", f"## Results of {info['date']}", ""]
    out += [f"- {key}: {value}" for key, value in info.items() if key != "date"]
    sections = [
        _targets_table(results),
        _throughput_table(results, chosen),
        _latency_table(results, chosen),
        _memory_table(results),
        _ceiling_table(results, chosen),
        _trio_ceiling_table(results, chosen),
        _cross_check(results, chosen),
    ]
    for section in sections:
        if not section[-1].startswith("|---"):  # a table without rows is left out
            out += ["", *section]
    out += ["", *_commands(results, chosen, rounds)]
    return "\n".join(out) + "\n"


def _targets_table(results: Results) -> list[str]:
    lines = [
        "### Targets (issue 20; the last two from issue 5)",
        "",
        "Each figure is the median over rounds, with the range; ratios are taken within a round"
        " (the two servers ran back to back), then the median of those.",
        "",
        "| target | measured by (commands below) | measured | from | met? |",
        "|---|---|---|---|---|",
    ]
    for target in TARGETS:
        figures = target.figure(results)
        if not figures:
            continue
        digits = 2 if target.unit.startswith("x") else 0
        verdict = "met" if target.met(statistics.median(figures)) else "**not met**"
        names = ", ".join(f"`{name}`" for name in target.scenarios)
        row = [target.text, names, f"{spread(figures, digits)} {target.unit}"]
        lines.append(f"| {' | '.join(row)} | {_inputs(results, target)} | {verdict} |")
    return lines


def _inputs(results: Results, target: Target) -> str:
    """The medians a ratio was taken from."""
    if not target.unit.startswith("x"):
        return ""
    parts = []
    for name in target.scenarios:
        for kind in ("pinpriq", "redis"):
            if target.unit == "x Redis" or kind == "pinpriq":
                figures = values(results, name, kind, "ops_per_sec")
                if figures:
                    label = kind if len(target.scenarios) == 1 else f"{name} {kind}"
                    parts.append(f"{label} {statistics.median(figures):,.0f}/s")
    return ", ".join(parts)


def _throughput_table(results: Results, chosen: list[Scenario]) -> list[str]:
    lines = [
        "### Throughput, ops/s (4 client processes)",
        "",
        "| scenario | Redis | pinpriq | pinpriq/Redis per round | server CPU us/op: Redis, ours |",
        "|---|---|---|---|---|",
    ]
    for s in chosen:
        if s.targets != ("redis", "pinpriq") or s.name not in results or "--rate" in s.bench:
            continue  # paced runs measure latency, not throughput
        redis, ours = (values(results, s.name, k, "ops_per_sec") for k in ("redis", "pinpriq"))
        per_round = ", ".join(f"{x:.2f}" for x in ratios(results, s.name))
        cpu = [values(results, s.name, k, "server_cpu_us_per_op") for k in ("redis", "pinpriq")]
        cpu_text = ", ".join(f"{statistics.median(c):.2f}" if c else "-" for c in cpu)
        lines.append(f"| {s.title} | {spread(redis)} | {spread(ours)} | {per_round} | {cpu_text} |")
    return lines


def _latency_table(results: Results, chosen: list[Scenario]) -> list[str]:
    lines = [
        "### Latency, microseconds (median over rounds of each round's percentile)",
        "",
        "The paced run at 1,000 ops/s shows what one round trip costs on this machine when the"
        " processes sleep between requests (waking an idle virtual CPU is slow): a push-to-"
        "delivery time crosses the loopback twice, so twice that p99 is a floor for the"
        " subscriber target.",
        "",
        "| scenario | server | kind | p50 | p99 | p99.9 |",
        "|---|---|---|---|---|---|",
    ]
    for s in chosen:
        if s.targets == ("redis-benchmark",):
            continue
        if not s.name.endswith("-p1") and not s.name.startswith("subscribe"):
            continue
        for kind in s.targets:
            runs = results.get(s.name, {}).get(kind, [])
            if not runs:
                continue
            cells = [spread(values(results, s.name, kind, f"latency_us.{p}")) for p in PCTS]
            lines.append(
                f"| {s.title} | {kind} | {runs[0]['latency_kind']} | {' | '.join(cells)} |"
            )
    return lines


PCTS = ("p50", "p99", "p99.9")


def _memory_table(results: Results) -> list[str]:
    lines = [
        "### Memory: resident set growth while packets are queued",
        "",
        "| server | RSS growth per packet | beyond 8+16 bytes of key and payload |",
        "|---|---|---|",
    ]
    for kind in ("redis", "pinpriq"):
        if results.get("memory", {}).get(kind):
            per = values(results, "memory", kind, "rss_bytes_per_packet")
            over = values(results, "memory", kind, "overhead_bytes_per_packet")
            lines.append(f"| {kind} | {spread(per, 1)} | {spread(over, 1)} |")
    return lines


def _ceiling_table(results: Results, chosen: list[Scenario]) -> list[str]:
    lines = [
        "### The generator's ceiling",
        "",
        "pinpriq-bench against `benchmarks/null_server.py`, a one-thread server that keeps no "
        "queue. On a machine with few cores the null server shares them with the generator, so "
        "this is a floor for the generator's ceiling; the CPU columns say what each op costs.",
        "",
        "| scenario | ops/s | generator CPU us/op | null server CPU us/op |",
        "|---|---|---|---|",
    ]
    for s in chosen:
        if s.targets == ("null",) and s.name in results:
            rate = spread(values(results, s.name, "null", "ops_per_sec"))
            gen = spread(values(results, s.name, "null", "generator_cpu_us_per_op"), 2)
            srv = spread(values(results, s.name, "null", "server_cpu_us_per_op"), 2)
            lines.append(f"| {s.title} | {rate} | {gen} | {srv} |")
    return lines


def _trio_ceiling_table(results: Results, chosen: list[Scenario]) -> list[str]:
    lines = [
        "### The Trio ceiling",
        "",
        "pinpriq-bench against `benchmarks/trio_null_server.py`: pinpriq's socket loop and codec "
        "on Trio with no store (pops answered with one stored packet). What pinpriq could reach "
        "if its store cost nothing; the ratios are pinpriq's (the scenario of the same name above) "
        "over this ceiling, and Redis's over it, within each round.",
        "",
        "| scenario | ops/s | server CPU us/op | pinpriq / ceiling | Redis / ceiling |",
        "|---|---|---|---|---|",
    ]
    for s in chosen:
        if s.targets == ("trio-null",) and s.name in results:
            rate = spread(values(results, s.name, "trio-null", "ops_per_sec"))
            srv = spread(values(results, s.name, "trio-null", "server_cpu_us_per_op"), 2)
            same = s.name.removeprefix("trio-ceiling-")
            over = [_over_ceiling(results, same, kind, s.name) for kind in ("pinpriq", "redis")]
            lines.append(f"| {s.title} | {rate} | {srv} | {over[0]} | {over[1]} |")
    return lines


def _over_ceiling(results: Results, scenario: str, kind: str, ceiling: str) -> str:
    """Median of per-round ratios of ``kind``'s rate in ``scenario`` to the Trio ceiling's."""
    ours = values(results, scenario, kind, "ops_per_sec")
    top = values(results, ceiling, "trio-null", "ops_per_sec")
    per_round = [a / b for a, b in zip(ours, top, strict=False) if b]
    return spread(per_round, 2) if per_round else ""


def _cross_check(results: Results, chosen: list[Scenario]) -> list[str]:
    lines = [
        "### Cross-check: Redis measured by redis-benchmark",
        "",
        "redis-benchmark is C, one process multiplexing its connections with epoll. Its ZADD"
        " adds random members with score 0 to one set and its ZPOPMIN pops that set (empty"
        " once it runs dry), so the workload is close to ours, not the same; what matters is"
        " whether our Python generator reports Redis much slower than a C client does.",
        "",
        "| 4 connections | redis-benchmark ZADD | ours, Redis push | redis-benchmark ZPOPMIN"
        " | ours, Redis pop |",
        "|---|---|---|---|---|",
    ]
    for s in chosen:
        if s.targets != ("redis-benchmark",) or s.name not in results:
            continue
        depth = s.name.rsplit("-p", 1)[1]
        ours = [values(results, f"{op}-p{depth}", "redis", "ops_per_sec") for op in ("push", "pop")]
        row = [s.title, *(spread(values(results, s.name, "redis-benchmark", t)) for t in TESTS)]
        row.insert(2, spread(ours[0]) if ours[0] else "-")
        row.append(spread(ours[1]) if ours[1] else "-")
        lines.append(f"| {' | '.join(row)} |")
    return lines


TESTS = ("ZADD", "ZPOPMIN")


def _commands(results: Results, chosen: list[Scenario], rounds: int) -> list[str]:
    lines = [
        "### Exact commands",
        "",
        f"{rounds} round(s); in each, every scenario ran on Redis and then on pinpriq, each on a"
        " fresh server started as below, on a free loopback port.",
        "",
        "```",
    ]
    seen = set()
    for s in chosen:
        for kind, runs in results.get(s.name, {}).items():
            server = shell(runs[0]["server_command"])
            if server not in seen:
                seen.add(server)
                lines.append(f"# {kind} server: {server}")
    for s in chosen:
        for kind, runs in results.get(s.name, {}).items():
            lines.append(f"# {s.name}, {kind}\n{shell(runs[0]['bench_command'])}")
    return [*lines, "```"]


def write_report(text: str, path: Path) -> None:
    """Replace what follows the marker, keeping the hand-written intro above it."""
    old = path.read_text() if path.exists() else ""
    intro = old.split(MARKER)[0].rstrip() if MARKER in old else old.rstrip()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text((intro + "\n\n" if intro else "") + text)


# -- main ------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> None:
    chosen = [s for s in scenarios(args.quick) if not args.only or s.name in args.only]
    rounds = 1 if args.quick else args.rounds
    if args.from_raw:
        saved = json.loads(Path(args.from_raw).read_text())
        info, results = saved["machine"], saved["results"]
        rounds = max(len(runs) for kinds in results.values() for runs in kinds.values())
    else:
        info, results = measure_all(chosen, rounds, args.max_minutes)
    if not args.from_raw:
        raw = Path(args.raw or tempfile.mkstemp(prefix="compare_redis-", suffix=".json")[1])
        raw.write_text(json.dumps({"machine": info, "results": results}, indent=1))
        log(f"every result is in {raw} (--from-raw rewrites the report from it)")
    text = report(results, info, chosen, rounds)
    if args.output == "-":
        print(text)
    else:
        write_report(text, Path(args.output))
        log(f"wrote {args.output}")


def measure_all(
    chosen: list[Scenario], rounds: int, max_minutes: float
) -> tuple[dict[str, str], Results]:
    """Every scenario on every server, round after round; the machine's description too."""
    ensure_redis()
    info = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}
    info |= machine()
    info["load average (1, 5, 15 min) at start"] = load()
    if rounds == 1 and any(s.name == "memory" and s.memory_packets < 10**6 for s in chosen):
        info["mode"] = "--quick: a smoke run, counts cut tenfold (depth and memory at 100,000)"
    results: Results = {}
    servers = Servers()
    deadline = time.monotonic() + max_minutes * 60
    try:
        for number in range(rounds):
            for s in chosen:
                for kind in s.targets:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"gave up after {max_minutes} minutes")
                    log(f"round {number + 1}/{rounds}: {s.name} on {kind} (load {load()})")
                    result = measure(servers, s, kind)
                    results.setdefault(s.name, {}).setdefault(kind, []).append(result)
    finally:
        servers.stop_all()
    info["load average (1, 5, 15 min) at end"] = load()
    return info, results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="(default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="1 round, small counts: a smoke run")
    names = [s.name for s in scenarios(False)]
    parser.add_argument(
        "--only", nargs="+", choices=names, metavar="SCENARIO", help=f"of {', '.join(names)}"
    )
    parser.add_argument("--output", default=str(OUTPUT), help="report file, - for stdout")
    parser.add_argument("--raw", metavar="FILE", help="also write every result as JSON")
    parser.add_argument("--from-raw", metavar="FILE", help="rewrite the report from a --raw file")
    parser.add_argument("--max-minutes", type=float, default=60.0, help="(default: 60)")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the finally clause stops the servers.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        run(args)
    except KeyboardInterrupt:
        sys.exit("compare_redis: interrupted; servers stopped")
    except (RuntimeError, subprocess.SubprocessError, OSError) as error:
        sys.exit(f"compare_redis: {error}")


if __name__ == "__main__":
    main()
