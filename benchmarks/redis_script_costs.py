"""What the Redis store's scripts cost inside Redis: each ``redis.call`` they make, and each
script per packet, against plain ZADD / ZPOPMIN on the same Redis.

Redis's own time (``INFO commandstats``: usec per call) is the figure a shared 2-core machine
moves least: it counts the time Redis spent running a command, not the time the load
generator or a front end took. Starts a fresh ``redis-server`` (noeviction, no persistence) on
a free loopback port. Prints medians over ``--rounds`` rounds.

    python benchmarks/redis_script_costs.py [--rounds 5] [--calls] [--scripts] [--delayed]
    python benchmarks/redis_script_costs.py --instructions [-n 6400]

``--calls``: one EVAL loops 100,000 times over one ``redis.call`` on a queue of 1,000 packets;
Redis's CPU time for it less an empty loop's, per iteration, is that call's cost. ``--scripts``:
redis-benchmark (pipeline 64, 4 connections) sends the push and pop scripts with one packet a
call (P1) and with 64 a call (P64: one push of 64 packets, one call of 64 pops), and plain
ZADD / ZPOPMIN; usec per call over packets per call is the cost per packet. ``--delayed``:
protocol 1.2's functions (``delayed_costs``). ``--instructions``: what ``--scripts`` measures,
counted in instructions by callgrind (``redis-server`` under valgrind, its counters zeroed
before and dumped after each measurement): the same on a loaded machine as on a quiet one, so
two checkouts compare by it when their CPU times are lost in the noise. It adds "pop,
confirming": a pop that confirms a kept result, as a front end's next pop does (no ``PEXPIRE``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compare_redis_store import (  # noqa: E402
    free_port,
    redis_benchmark,
    redis_cli,
    redis_pid,
    redis_server,
)
from pinpriq.redis import lua  # noqa: E402
from pinpriq.redis.keys import queue_keys  # noqa: E402

LOOP = 100_000
QUEUE = b"bench"
KEYS = [k.decode() for k in queue_keys(QUEUE)]


def load(port: int) -> None:
    """The store's functions library, as a front end loads it."""
    redis_cli(port, "FUNCTION", "LOAD", "REPLACE", lua.LIBRARY)


def push_call(packets: list[tuple[str, str, int, int]]) -> list[str]:
    """An FCALL of the push function: (key, payload, ttl ms, prio) a packet; counting the
    queue's packets, as a front end's last push call of a queue in a batch does."""
    fields = [str(f) for packet in packets for f in packet]
    keys = keys_of(QUEUE, *_D4, "waiting")
    return ["FCALL", lua.function_name("push"), str(len(keys)), *keys, KEYS[5], "1", *fields]


def pop_call(pops: int, *confirmed: str) -> list[str]:
    """An FCALL of the pop function, ``pops`` pops (as a front end's call for a batch),
    confirming the results ``confirmed``."""
    keys = [*keys_of(QUEUE, *_D4, "results"), *timed_keys()]
    args = ["65535", str(pops), "0", "bench:1", "0", "0", *confirmed]
    return ["FCALL", lua.function_name("pop"), str(len(keys)), *keys, *args]


def timed_keys(queue: bytes = QUEUE) -> list[str]:
    """The keys a pop, sweep or rank takes after ``:d`` ``:s`` ``:g`` ``:x`` (and a pop's
    ``:r``): the delayed packets, their due times, the waiting mark, the lease table."""
    return keys_of(queue, "delayed", "due", "waiting", "leases")


def keys_of(queue: bytes, *fields: str) -> list[str]:
    k = queue_keys(queue)
    return [getattr(k, field).decode() for field in fields]


_D4 = ("data", "selectable", "groups", "expiry")


def fcall(port: int, operation: str, keys: list[str], args: list[object]) -> str:
    return redis_cli(port, "FCALL", lua.function_name(operation), str(len(keys)), *keys,
                     *(str(a) for a in args))  # fmt: skip


def fcalls(port: int, calls: list[list[str]]) -> None:
    """One FCALL each (function, then keys, then arguments), over one connection, in turn."""
    keys = {"sweep": 8, "push": 5, "push_delayed": 4}
    lines = []
    for call in calls:
        count = keys[call[0].removeprefix(lua.LIBRARY_NAME + "_")]
        lines.append(" ".join(["FCALL", call[0], str(count), *call[1:]]))
    subprocess.run(["redis-cli", "-p", str(port)], input="\n".join(lines) + "\n",
                   capture_output=True, text=True, check=True)  # fmt: skip


def delayed_costs(port: int, queues: int) -> dict[str, float]:
    """Redis's usec per packet (``INFO commandstats``) of the delayed packets' functions and of
    a move (layout 3 on): ``push_delayed`` at 1 and 64 packets a call; the sweep that promotes
    them when due, one queue a call, with 1 and 64 due packets; a sweep finding nothing due
    (a second front end racing the first); and ``move`` of 64 and of 64,000 packets a call."""
    result: dict[str, float] = {}
    packet = ["k__rand_int__", "p" * 16, 0, 7, 5]  # a 5 ms delay: due by the time it is swept
    load(port)
    for per_call in (1, 64):
        redis_cli(port, "FLUSHALL")
        command = ["FCALL", lua.function_name("push_delayed"), "4",
                   *keys_of(QUEUE, "data", "delayed", "due", "waiting"),
                   *(str(f) for f in packet * per_call)]  # fmt: skip
        measure(port, result, f"push_delayed P{per_call}", per_call, 64_000 // per_call, command)
        # The same per call on ``queues`` queues, then a sweep of each once they are due.
        redis_cli(port, "FLUSHALL")
        names = [b"d%d" % i for i in range(queues)]
        sweeps = [[lua.function_name("sweep"), *keys_of(name, *_D4), *timed_keys(name)]
                  for name in names]  # fmt: skip
        pushes = [[lua.function_name("push"), *keys_of(name, *_D4, "waiting"),
                   "c", "1", *(str(f) for f in packet[:4])] for name in names]  # fmt: skip
        fields = [str(f) for f in packet * per_call]
        delayed = [[lua.function_name("push_delayed"),
                    *keys_of(name, "data", "delayed", "due", "waiting"), *fields]
                   for name in names]  # fmt: skip
        fcalls(port, delayed)
        time.sleep(0.05)
        for label, calls, per in ((f"promote P{per_call}", sweeps, per_call),
                                  ("sweep, nothing due", sweeps, 1),
                                  ("push P1, the same way", pushes, 1)):  # fmt: skip
            redis_cli(port, "CONFIG", "RESETSTAT")
            fcalls(port, calls)
            result[f"{label} (commandstats)"] = commandstats(port)["fcall"][1] / per
    source, target = queue_keys(QUEUE), queue_keys(b"other")
    move_keys = [*keys_of(QUEUE, *_D4), *timed_keys(), *keys_of(QUEUE, "attempts"),
                 *keys_of(b"other", *_D4, "waiting")]  # fmt: skip
    for per_call, label in ((64, "move n=64"), (0, "move all of 64,000")):
        redis_cli(port, "FLUSHALL")
        for start in range(0, 64_000, 8_000):  # an argument list the shell takes
            fill(port, 8_000, start)
        redis_cli(port, "CONFIG", "RESETSTAT")
        calls = 20 if per_call else 1
        for _ in range(calls):
            fcall(port, "move", move_keys, [per_call])
        moved = 64 * calls if per_call else 64_000
        result[f"{label} (commandstats)"] = commandstats(port)["fcall"][1] * calls / moved
    del source, target
    return result


def commandstats(port: int) -> dict[str, tuple[int, float]]:
    """Command -> (calls, usec per call), from ``INFO commandstats``."""
    stats: dict[str, tuple[int, float]] = {}
    for line in redis_cli(port, "INFO", "commandstats").splitlines():
        if not line.startswith("cmdstat_"):
            continue
        name, _, fields = line[len("cmdstat_") :].partition(":")
        values = dict(item.split("=") for item in fields.split(","))
        stats[name] = (int(values["calls"]), float(values["usec_per_call"]))
    return stats


def fill(port: int, packets: int, first: int = 0) -> None:
    """``packets`` packets in the bench queue, unique keys, prio 1..255, no TTL."""
    load(port)
    numbers = range(first, first + packets)
    redis_cli(port, *push_call([(f"k{i}", "p" * 16, 0, 1 + i % 255) for i in numbers]))


#: One ``redis.call`` each, as the scripts make them (KEYS[1] the queue's hash, KEYS[2] its
#: selection set, KEYS[3] a string, KEYS[4] a missing key).
CALLS = {
    "TIME": "redis.call('TIME')",
    "EXISTS (missing key)": "redis.call('EXISTS', KEYS[4])",
    "GET (string)": "redis.call('GET', KEYS[3])",
    "SET (string)": "redis.call('SET', KEYS[3], '0000001234567890')",
    "HGET (hash of 1,000)": "redis.call('HGET', KEYS[1], 'nope')",
    "HSET+HDEL (hash of 1,000)": "redis.call('HSET', KEYS[1], 'x', 'y') "
    "redis.call('HDEL', KEYS[1], 'x')",
    "ZRANGE -1 -1 (zset of 1,000)": "redis.call('ZRANGE', KEYS[2], -1, -1)",
    "ZCARD": "redis.call('ZCARD', KEYS[2])",
    "ZADD+ZREM (zset of 1,000)": "redis.call('ZADD', KEYS[2], -300, 'x') "
    "redis.call('ZREM', KEYS[2], 'x')",
    "ZRANGEBYSCORE empty (missing zset)": "redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', 5)",
    "struct.pack + string ops (no call)": "local s = struct.pack('>H', 5) .. 'key' .. 'payload'",
}


def call_costs(port: int) -> dict[str, float]:
    """Usec per iteration of each ``CALLS`` entry, less an empty loop's."""
    keys = [KEYS[0], KEYS[1], "pq:{qbench}:str", "pq:{qbench}:none"]
    redis_cli(port, "SET", keys[2], "1")

    def loop(body: str) -> float:
        script = f"for i = 1, {LOOP} do {body} end"
        cpu = cpu_seconds(port)
        redis_cli(port, "EVAL", script, "4", *keys)
        return (cpu_seconds(port) - cpu) * 1e6 / LOOP

    empty = loop("")
    return {name: loop(body) - empty for name, body in CALLS.items()}


def cpu_seconds(port: int) -> float:
    """The CPU time redis-server has used (user + system), from /proc."""
    pid = redis_cli(port, "INFO", "server").split("process_id:")[1].split()[0]
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime


def measure(port: int, result: dict[str, float], label: str, per_call: int, calls: int,
            command: list[str]) -> None:  # fmt: skip
    """redis-benchmark ``calls`` times ``command`` (``per_call`` packets each): Redis's usec
    per packet by ``INFO commandstats`` (wall time inside the command), and its CPU time per
    packet (all its work, reading and replying included; not stretched when the machine's
    other processes take the CPU from it mid-command, which commandstats is)."""
    redis_cli(port, "CONFIG", "RESETSTAT")
    cpu = cpu_seconds(port)
    redis_benchmark(port, calls, *command)
    cpu = cpu_seconds(port) - cpu
    packets = calls * per_call
    result[f"{label} (commandstats)"] = commandstats(port)[command[0].lower()][1] / per_call
    result[f"{label} (CPU)"] = cpu * 1e6 / packets


def script_costs(port: int, n: int) -> dict[str, float]:
    """Redis's usec per packet: the push and pop scripts at one and at 64 packets a call, and
    ZADD / ZPOPMIN."""
    result: dict[str, float] = {}
    for per_call in (1, 64):
        label = f"P{per_call}"
        redis_cli(port, "FLUSHALL")
        packet = ("k__rand_int__", "p" * 16, 0, 7)  # each __rand_int__ is drawn anew
        load(port)
        push, pop = push_call([packet] * per_call), pop_call(per_call)
        measure(port, result, f"push {label}", per_call, n // per_call, push)
        measure(port, result, f"pop {label}", per_call, n // per_call, pop)
    measure(port, result, "ZADD", 1, n, ["ZADD", "plain", "__rand_int__", "k__rand_int__"])
    measure(port, result, "ZPOPMIN", 1, n, ["ZPOPMIN", "plain"])
    return result


@contextlib.contextmanager
def callgrind_redis() -> Iterator[tuple[int, Callable[[Callable[[], object]], int]]]:
    """A fresh ``redis-server`` under callgrind: its port, and ``count(run)``, the instructions
    Redis spent while ``run()`` ran (counters zeroed before, dumped after)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "redis-server",
                   "--port", str(port), "--bind", "127.0.0.1", "--dir", directory, "--save", "",
                   "--appendonly", "no", "--maxmemory-policy", "noeviction"]  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while subprocess.run(["redis-cli", "-p", str(port), "PING"], capture_output=True,
                                 text=True).stdout.strip() != "PONG":  # fmt: skip
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("redis-server under valgrind did not start")
                time.sleep(0.2)
            pid = redis_pid(port)
            dumps = 0

            def count(run: Callable[[], object]) -> int:
                nonlocal dumps
                control = ["callgrind_control"]
                subprocess.run([*control, "-z", pid], capture_output=True, check=True)
                run()
                subprocess.run([*control, "-d", pid], capture_output=True, check=True)
                dumps += 1
                text = Path(f"{out}.{dumps}").read_text()
                return int(re.search(r"^summary: (\d+)", text, re.M).group(1))  # type: ignore[union-attr]

            yield port, count
        finally:
            process.kill()
            process.wait(timeout=30)


def script_instructions(n: int) -> dict[str, float]:
    """``script_costs`` in Redis's instructions per packet (callgrind)."""
    result: dict[str, float] = {}
    with callgrind_redis() as (port, count):
        load(port)
        for per_call in (1, 64):
            redis_cli(port, "FLUSHALL")
            packet = ("k__rand_int__", "p" * 16, 0, 7)
            # redis-benchmark sends whole pipelines: 4 connections of 64 calls, 256 at least.
            calls = 256 * max(1, n // (256 * per_call))
            # A front end's pop confirms the result its previous pop kept; here each confirms
            # its own (the same HSET and HDEL of ``:r``), then the next has none to confirm.
            for name, command in (("push", push_call([packet] * per_call)),
                                  ("pop", pop_call(per_call)),
                                  ("push", push_call([packet] * per_call)),
                                  ("pop, confirming", pop_call(per_call, "bench:1"))):  # fmt: skip
                spent = count(partial(redis_benchmark, port, calls, *command))
                if name != "push" or f"push P{per_call}" not in result:
                    result[f"{name} P{per_call}"] = spent / (calls * per_call)
        for name, command in (("ZADD", ["ZADD", "plain", "__rand_int__", "k__rand_int__"]),
                              ("ZPOPMIN", ["ZPOPMIN", "plain"])):  # fmt: skip
            calls = 256 * max(1, n // 256)
            result[name] = count(partial(redis_benchmark, port, calls, *command)) / calls
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-n", type=int, default=64_000, help="packets a script measurement")
    parser.add_argument("--calls", action="store_true", help="only the per-call costs")
    parser.add_argument("--scripts", action="store_true", help="only the per-script costs")
    parser.add_argument("--delayed", action="store_true",
                        help="only the delayed packets' and move's costs")  # fmt: skip
    parser.add_argument("--instructions", action="store_true",
                        help="--scripts in callgrind's instructions (-n 6400)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.instructions:
        figures = script_instructions(args.n if args.n != 64_000 else 6_400)
        print("Redis's instructions per packet (callgrind):")
        for name, value in figures.items():
            print(f"  {name:40s} {value:10.0f}")
        return 0
    both = not (args.calls or args.scripts or args.delayed)
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        with redis_server() as port:
            figures: dict[str, float] = {}
            if args.calls or both:
                fill(port, 1000)
                figures.update(call_costs(port))
            if args.scripts or both:
                figures.update(script_costs(port, args.n))
            if args.delayed or both:
                figures.update(delayed_costs(port, 300))
            rounds.append(figures)
    print(f"Redis's own usec, medians of {args.rounds} rounds:")
    for name in rounds[0]:
        values = [r[name] for r in rounds]
        low, high = min(values), max(values)
        print(f"  {name:40s} {statistics.median(values):8.2f}  ({low:.2f}-{high:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
