"""``pinpriq-bench`` as a user runs it, against a live ``pinpriq-server`` subprocess, and the
reply counters and RESP encoder it is built on. Nothing here asserts a speed."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from hypothesis import given
from hypothesis import strategies as st

from pinpriq.bench.dialects import PinpriqDialect, RedisDialect, resp_command
from pinpriq.bench.runner import percentiles
from pinpriq.bench.workload import Workload
from pinpriq.wire import Packet, ReplyDecoder, encode_reply

BIN = Path(sys.executable).parent
LISTENING = re.compile(r"listening on \S+ port (\d+)")
ROOT = Path(__file__).parent.parent
REDIS_NO_PERSISTENCE = ["--save", "", "--appendonly", "no"]


class Server:
    """A server subprocess whose first stderr line names its port."""

    def __init__(self, *command: str) -> None:
        self.process = subprocess.Popen(
            command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
        )
        assert self.process.stderr is not None
        line = self.process.stderr.readline()
        match = LISTENING.search(line)
        assert match, f"expected a listening line, got {line!r}"
        self.port = int(match.group(1))

    def stop(self) -> None:
        self.process.kill()
        self.process.communicate(timeout=10)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    started = Server(str(BIN / "pinpriq-server"), "--port", "0", "--http-port", "off")
    yield started
    started.stop()


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "pinpriq-bench"), *args], capture_output=True, text=True, timeout=timeout
    )


def bench_json(port: int, *args: str) -> list[dict[str, Any]]:
    done = bench("--port", str(port), "--json", "--timeout", "10", *args)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["tool"] == "pinpriq-bench"
    results: list[dict[str, Any]] = document["results"]
    return results


# -- every scenario against a live server --------------------------------------------------------


@pytest.mark.parametrize("scenario", ["push", "push-stream", "mix"])
def test_throughput_scenarios_report_every_op(server: Server, scenario: str) -> None:
    (result,) = bench_json(server.port, "-t", scenario, "-n", "60", "-c", "2", "-P", "8")
    assert result["scenario"] == scenario
    assert result["ops"] == 60
    assert result["ops_per_sec"] > 0
    assert result["generator_cpu_us_per_op"] >= 0
    machine = [result[f"machine_{kind}_us_per_op"] for kind in ("busy", "idle", "steal")]
    assert all(value >= 0 for value in machine)  # a short run may fall within one tick
    if scenario == "mix":
        assert result["packets"] == 30  # every pop found the push before it
        assert result["empty_pops"] == 0


def test_pop_finds_a_packet_every_time(server: Server) -> None:
    (result,) = bench_json(server.port, "-t", "pop", "-n", "50", "-c", "3", "-P", "7")
    assert (result["ops"], result["packets"], result["empty_pops"]) == (50, 50, 0)


def test_pop_takes_whole_key_groups(server: Server) -> None:
    # 10 + 30 packets over 4 keys: each pop takes a group of 10, the fifth finds nothing.
    args = ["-t", "pop", "--keys", "4", "--prefill", "10", "-n", "30", "-c", "1", "-P", "5"]
    (result,) = bench_json(server.port, *args)
    assert result["packets"] == 40
    assert result["empty_pops"] == 26


def test_pipeline_one_reports_per_op_latency(server: Server) -> None:
    (result,) = bench_json(server.port, "-t", "push", "-n", "20", "-c", "2", "-P", "1")
    assert result["latency_kind"] == "round trip per op"
    latency = result["latency_us"]
    assert 0 < latency["p50"] <= latency["p99"] <= latency["p99.9"] <= latency["max"]


def test_subscribe_delivers_every_push_with_latency(server: Server) -> None:
    args = ["-t", "subscribe", "-n", "40", "-c", "1", "-P", "4", "--subscribers", "3"]
    pid = str(server.process.pid)
    (result,) = bench_json(server.port, *args, "--prefetch", "2", "--server-pid", pid)
    assert (result["deliveries"], result["packets"], result["missing"]) == (40, 40, 0)
    assert result["latency_kind"] == "push to delivery"
    assert result["latency_us"]["p50"] > 0
    assert "server_cpu_us_per_op" in result
    assert result["subscriber_cpu_us_per_delivery"] >= 0


def test_subscribe_with_grouped_keys_counts_every_packet(server: Server) -> None:
    # Pushes faster than one subscriber takes them, so deliveries hold whole key groups:
    # the general decoder, not the one-packet fast path, has to count them.
    args = ["-t", "subscribe", "-n", "60", "-c", "2", "-P", "30", "--keys", "3"]
    (result,) = bench_json(server.port, *args)
    assert result["packets"] == 60
    assert result["deliveries"] <= 60


def test_rate_paces_the_ops(server: Server) -> None:
    args = ["-t", "push", "-n", "20", "-c", "2", "-P", "1", "--rate", "100"]
    (result,) = bench_json(server.port, *args)
    assert result["rate"] == 100
    assert result["seconds"] >= 0.15  # 20 ops at 100/s leave over 0.19 s


def test_table_lists_each_scenario(server: Server) -> None:
    done = bench("--port", str(server.port), "-q", "-t", "push,pop", "-n", "20", "-c", "1")
    assert done.returncode == 0, done.stderr
    rows = [line.split()[0] for line in done.stdout.splitlines()[2:] if line[:1].strip()]
    assert rows == ["push", "pop"]
    assert done.stderr == ""


def test_progress_goes_to_stderr_only(server: Server) -> None:
    done = bench("--port", str(server.port), "--json", "-t", "push", "-n", "20", "-c", "1")
    assert done.returncode == 0
    json.loads(done.stdout)  # stdout holds the JSON alone


@pytest.mark.parametrize(
    "null_server", [("null_server.py", "--reply-packet"), ("trio_null_server.py",)]
)
def test_runs_against_the_null_server(null_server: tuple[str, ...]) -> None:
    script, *options = null_server
    null = Server(sys.executable, str(ROOT / "benchmarks" / script), *options)
    try:
        results = bench_json(null.port, "-t", "push,pop", "-n", "40", "-c", "2", "-P", "8")
    finally:
        null.stop()
    assert [r["packets"] for r in results] == [0, 40]


@pytest.mark.skipif(
    shutil.which("redis-server") is None and not os.environ.get("CI"),
    reason="redis-server not installed (CI installs it, and there this test never skips)",
)
def test_redis_scenarios() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", *REDIS_NO_PERSISTENCE],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):  # until it accepts; bounded
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        results = bench_json(port, "--redis", "-t", "push,push-stream,pop,mix", "-n", "40")
    finally:
        redis.kill()
        redis.wait(timeout=10)
    assert [r["ops"] for r in results] == [40] * 4
    assert [r["packets"] for r in results] == [0, 0, 40, 20]


# -- bad arguments: one line, non-zero --------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["-t", "push,nope"],
        ["-c", "0"],
        ["-n", "x"],
        ["-P", "-3"],
        ["--port", "70000"],
        ["--prio-levels", "256"],
        ["--redis", "--ttl", "5"],
        ["--redis", "-t", "subscribe"],
        ["-t", "subscribe", "--payload-size", "4"],
        ["--key-size", "1", "-n", "1000"],
        ["--key-size", "1", "--keys", "300"],
        ["-c", "5", "-n", "4"],
    ],
)
def test_bad_arguments_print_one_line(args: list[str]) -> None:
    done = bench(*args)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("pinpriq-bench: error: ")


def test_no_server_prints_one_line() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    done = bench("--port", str(port), "-n", "10", "--timeout", "2")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"pinpriq-bench: cannot connect to 127.0.0.1:{port}")


def test_wrong_protocol_prints_one_line(server: Server) -> None:
    # RESP sent to a pinpriq server: it closes the connection at the unknown opcode.
    done = bench("--port", str(server.port), "-q", "--redis", "-t", "push", "-n", "10")
    assert done.returncode == 1
    assert done.stderr == "pinpriq-bench: the server closed the connection\n"


# -- the encoders and reply counters ---------------------------------------------------------


def test_resp_encodes_a_zadd_exactly() -> None:
    assert resp_command(b"ZADD", b"q", b"7", b"member") == (
        b"*4\r\n$4\r\nZADD\r\n$1\r\nq\r\n$1\r\n7\r\n$6\r\nmember\r\n"
    )


def test_redis_push_scores_priority_then_newest() -> None:
    w = Workload("push", key_size=2, payload_size=9)
    frame = RedisDialect().push(w, b"q", 5, 3)
    # score 2**40 + 3 * 2**32 - 5; member = key 5 + payload (sequence 5, then padding)
    member = b"\x00\x05" + b"\x00" * 7 + b"\x05."
    assert frame == b"*4\r\n$4\r\nZADD\r\n$1\r\nq\r\n$13\r\n1112396529659\r\n$11\r\n" + member + (
        b"\r\n"
    )
    newer = RedisDialect().push(w, b"q", 6, 3)
    assert newer.split(b"\r\n")[6] < frame.split(b"\r\n")[6]  # newest pops first


packets = st.lists(st.builds(Packet, st.binary(max_size=12), st.binary(max_size=20)), max_size=4)


@given(
    replies=st.lists(packets, max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
)
def test_pinpriq_counter_agrees_with_reply_decoder(
    replies: list[list[Packet]], cuts: list[int]
) -> None:
    stream = b"".join(encode_reply(reply) for reply in replies)
    decoder = ReplyDecoder()
    decoder.feed(stream)
    expected = list(decoder)
    counter = PinpriqDialect().replies(Workload("pop", key_size=3, payload_size=5))
    totals = [0, 0, 0]
    bounds = [0, *sorted(min(cut, len(stream)) for cut in cuts), len(stream)]
    for start, end in itertools.pairwise(bounds):
        for i, value in enumerate(counter.feed(stream[start:end])):
            totals[i] += value
    assert totals == [len(expected), sum(map(len, expected)), sum(not r for r in expected)]


def test_redis_counter_handles_every_reply_kind() -> None:
    counter = RedisDialect().replies(Workload("pop"))
    popped = resp_command(bytes(24), b"1099511627777")
    stream = b":1\r\n" * 3 + popped * 2 + b"*0\r\n" + b"+OK\r\n" + b"$-1\r\n" + b":1\r\n" + popped
    totals = [0, 0, 0]
    for i in range(0, len(stream), 7):  # awkward chunks
        for j, value in enumerate(counter.feed(stream[i : i + 7])):
            totals[j] += value
    assert totals == [10, 3, 1]


def test_percentiles_nearest_rank() -> None:
    figures = percentiles(list(range(1000, 1001000, 1000)))  # 1..1000 us
    assert figures == {"p50": 500.0, "p99": 990.0, "p99.9": 999.0, "max": 1000.0}
    assert percentiles([]) is None


# -- TLS and a token ------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["push", "pop"])
def test_tls_with_a_token(tmp_path: Path, scenario: str) -> None:
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    leaf.private_key_and_cert_chain_pem.write_to_path(tmp_path / "cert.pem")
    leaf.private_key_pem.write_to_path(tmp_path / "key.pem")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    tls = ["--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem")]
    environ = {**os.environ, "PINPRIQ_AUTH_TOKEN": "bench token"}
    server = subprocess.Popen(
        [str(BIN / "pinpriq-server"), "--port", "0", "--http-port", "off", *tls],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=environ,
    )
    try:
        assert server.stderr is not None
        match = LISTENING.search(server.stderr.readline())
        assert match
        args = ["--port", match.group(1), "--json", "-t", scenario, "-n", "200", "-c", "2"]
        done = subprocess.run(
            [str(BIN / "pinpriq-bench"), *args, "-P", "16", "--tls-ca", str(tmp_path / "ca.pem")],
            capture_output=True,
            text=True,
            timeout=60,
            env=environ,
        )
        assert done.returncode == 0, done.stderr
        (result,) = json.loads(done.stdout)["results"]
        assert result["ops"] == 200
        assert result["ops_per_sec"] > 0
        plain = subprocess.run(  # the same server, plain: refused at once
            [str(BIN / "pinpriq-bench"), *args], capture_output=True, text=True, timeout=60
        )
        assert plain.returncode != 0
    finally:
        server.kill()
        server.communicate(timeout=10)
