"""``pinpriq stats``, ``queues``, ``peek``, ``purge`` and ``health`` as a user runs them:
subprocesses against a ``pinpriq-server`` subprocess whose admin listener is on an ephemeral
loopback port (HTTPS when the server has TLS); and the server's own admin-side options (log
format, debug lines)."""

from __future__ import annotations

import json
import re
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

import pytest
import trustme

from pinpriq import BlockingPinpriqClient
from pinpriq.packed import DEFAULT_STORE_OVERHEAD as PACKET_OVERHEAD  # the live server's store
from tests.test_client_cli import BIN, PINPRIQ, TIMEOUT, read_line

TOKEN = "t0ken"
ADMIN_LINE = re.compile(rb"admin listener .* on (https?://\S+)/")
DATA_LINE = re.compile(rb"pinpriq listening on \S+ port (\d+)")


class Server(NamedTuple):
    process: subprocess.Popen[bytes]
    port: int
    admin: str
    lines: list[bytes]  # its log lines up to the listening one


def start(*options: str, env: dict[str, str] | None = None) -> Server:
    process = subprocess.Popen(
        [str(BIN / "pinpriq-server"), "--port", "0", "--http-port", "0", *options],
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    assert process.stderr is not None
    lines: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT
    while not (data := DATA_LINE.search(line := read_line(process.stderr, deadline))):
        lines.append(line)
    lines.append(line)
    admin = next(m.group(1).decode() for ln in lines if (m := ADMIN_LINE.search(ln)))
    return Server(process, int(data.group(1)), admin, lines)


def stop(server: Server) -> bytes:
    """SIGINT, wait, and the rest of its log."""
    server.process.send_signal(signal.SIGINT)
    try:
        _, rest = server.process.communicate(timeout=TIMEOUT)
    finally:
        server.process.kill()
    return rest


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    started = start()
    yield started
    stop(started)


def pinpriq(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PINPRIQ, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={"PATH": str(BIN), **env},
    )


def ok(*args: str, **env: str) -> str:
    done = pinpriq(*args, **env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return done.stdout


def push(server: Server, queue: str, key: str, payload: str, *options: str) -> None:
    ok("--port", str(server.port), "push", queue, key, payload, *options)


def test_queues_and_stats_are_aligned_tables(server: Server) -> None:
    for i in range(3):
        push(server, "tables", f"k{i}", "payload", "--prio", str(i + 1))
    push(server, "tables", "z", "p", "--prio", "0")
    push(server, "t2", "k", "p", "--ttl", "60000")
    table = ok("--admin", server.admin, "queues").splitlines()
    header = table[0]
    assert header.split() == [
        "QUEUE",
        "PACKETS",
        "LEASED",
        "DELAYED",
        "BYTES",
        "SUBSCRIBERS",
        "OLDEST",
        "NEXT",
        "EXPIRY",
        "BY",
        "PRIORITY",
    ]
    row = next(line for line in table if line.startswith("tables "))
    bytes_held = f"{3 * (2 + 7 + PACKET_OVERHEAD) + (1 + 1 + PACKET_OVERHEAD):,}"
    assert row.split()[:6] == ["tables", "4", "0", "0", bytes_held, "0"]
    assert row.endswith("0: 1, 1: 1, 2: 1, 3: 1")
    # Aligned: every row's PACKETS column ends where the header's does.
    end = header.index("PACKETS") + len("PACKETS")
    assert all(line[end - 1] != " " and line[end] == " " for line in table[1:])
    t2 = next(line for line in table if line.startswith("t2 "))
    assert re.search(r"\s(5\d|60)\.\d s\s", t2)  # next expiry, in under a minute

    stats = ok("stats", PINPRIQ_ADMIN_URL=server.admin)
    assert re.search(r"^packets\s+\d+ in \d+ queues$", stats, re.MULTILINE)
    assert re.search(r"^memory\s+.* of 1\.0 GiB$", stats, re.MULTILINE)
    assert re.search(r"^leases\s+leased 0  acked 0  redelivered 0 ", stats, re.MULTILINE)
    assert "QUEUE" in stats
    assert "tables" in stats

    one = ok("stats", "tables", "--admin", server.admin)
    assert re.search(r"^packets\s+4$", one, re.MULTILINE)
    assert re.search(r"^by priority\s+0: 1, 1: 1, 2: 1, 3: 1$", one, re.MULTILINE)


def test_queues_and_stats_count_leased_packets(server: Server) -> None:
    for key in ("a", "b", "c"):
        push(server, "leasing", key, "job")
    with BlockingPinpriqClient.connect("127.0.0.1", server.port) as client:
        lease = client.reserve("leasing")  # held until the block ends: out of the queue
        row = next(
            line.split()
            for line in ok("queues", "--admin", server.admin).splitlines()
            if line.startswith("leasing ")
        )
        assert (row[1], row[2]) == ("2", "1")  # PACKETS, LEASED
        one = ok("stats", "leasing", "--admin", server.admin)
        assert re.search(r"^leased\s+1$", one, re.MULTILINE), one
        lease.ack()


def push_delayed(server: Server, queue: bytes, key: bytes, delay_ms: int) -> None:
    """A delayed push (``71``) and a sync, in raw bytes."""
    frame = struct.pack(">BHIIBHH", 0x71, len(queue), 0, delay_ms, 1, len(key), 0) + key + queue
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as peer:
        peer.sendall(frame + b"\x21")
        assert peer.recv(2) == b"\x00\x00"


def test_queues_and_stats_count_delayed_packets(server: Server) -> None:
    push(server, "delaying", "now", "v")
    push_delayed(server, b"delaying", b"later", 3_600_000)  # outlives the test
    push_delayed(server, b"only-delayed", b"later", 3_600_000)
    rows = {
        line.split()[0]: line.split() for line in ok("queues", "--admin", server.admin).splitlines()
    }
    assert rows["delaying"][1:4] == ["1", "0", "1"]  # PACKETS, LEASED, DELAYED
    assert rows["only-delayed"][1:4] == ["0", "0", "1"]  # listed, though empty for pops
    one = ok("stats", "delaying", "--admin", server.admin)
    assert re.search(r"^delayed\s+1$", one, re.MULTILINE), one
    memory = re.search(
        r"^memory\s+.* of 1\.0 GiB \((\d+) B delayed\)$",
        ok("stats", "--admin", server.admin),
        re.MULTILINE,
    )
    assert memory is not None
    assert int(memory[1]) == 2 * (5 + PACKET_OVERHEAD)
    ok("purge", "delaying", "--admin", server.admin)
    ok("purge", "only-delayed", "--admin", server.admin)


def test_move_sends_dead_letters_back(server: Server) -> None:
    for key in ("a", "b", "b"):
        push(server, "work.dead", key, "job", "--prio", "2")
    assert ok("move", "work.dead", "work", "-n", "1", "--admin", server.admin) == (
        "moved 2 packets from work.dead to work\n"  # the first group, whole
    )
    moved = json.loads(ok("move", "work.dead", "work", "--json", "--admin", server.admin))
    assert moved == {"queue": "work.dead", "to": "work", "moved": 1}
    assert "moved 0 packets" in ok("move", "work.dead", "work", "--admin", server.admin)
    assert [
        line.split()[1] for line in ok("peek", "work", "--admin", server.admin).splitlines()[1:]
    ] == ["a", "b", "b"]
    ok("purge", "work", "--admin", server.admin)


def test_move_takes_both_names_back_with_escaped(server: Server) -> None:
    with BlockingPinpriqClient.connect("127.0.0.1", server.port) as client:
        client.push(b"mv\x00from", b"k", b"v", confirm=True)  # a NUL: no argv holds it
    moved = ok("move", "--escaped", "mv\\x00from", "mv\\x00to", "--admin", server.admin)
    assert moved == "moved 1 packets from mv\\x00from to mv\\x00to\n"
    assert ok("purge", "--escaped", "mv\\x00to", "--admin", server.admin).startswith("purged 1 ")


def test_a_move_to_itself_is_one_line_and_exit_1(server: Server) -> None:
    done = pinpriq("move", "same", "same", "--admin", server.admin)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1
    assert "said 400: to= names the queue moved from" in done.stderr


def test_json_is_the_admin_listeners_json(server: Server) -> None:
    push(server, "json-q", "k", "v", "--prio", "9")
    stats = json.loads(ok("--json", "stats", "--admin", server.admin))
    assert {"version", "connections", "memory", "totals", "rates_per_s", "queues"} <= set(stats)
    one = json.loads(ok("stats", "json-q", "--json", "--admin", server.admin))
    assert (one["name"], one["packets"], one["by_priority"]) == ("json-q", 1, {"9": 1})
    queues = [
        json.loads(line)
        for line in ok("queues", "--json", "--admin", server.admin).split("\n")
        if line
    ]
    assert "json-q" in [q["name"] for q in queues]


def test_peek_shows_without_removing_and_purge_removes(server: Server) -> None:
    for i, prio in enumerate((5, 2, 9)):
        push(server, "peeked", f"k{i}", f"payload {i}", "--prio", str(prio))
    push(server, "peeked", "bin", "\udcff", "--prio", "7")  # a payload that is not UTF-8
    table = ok("peek", "peeked", "-n", "3", "--admin", server.admin)
    assert table.splitlines() == [
        "PRIO  KEY  PAYLOAD",
        "   2  k1   payload 1",
        "   5  k0   payload 0",
        "   7  bin  \\xff",
    ]
    lines = ok("peek", "peeked", "--json", "--admin", server.admin).splitlines()
    assert [json.loads(line) for line in lines][:2] == [
        {"key": "k1", "payload": "payload 1", "prio": 2},
        {"key": "k0", "payload": "payload 0", "prio": 5},
    ]
    assert json.loads(lines[2])["payload"] == {"base64": "/w=="}
    assert ok("purge", "peeked", "--admin", server.admin) == "purged 4 packets from peeked\n"
    assert ok("peek", "peeked", "--admin", server.admin) == ""
    again = json.loads(ok("purge", "peeked", "--json", "--admin", server.admin))
    assert again == {"queue": "peeked", "purged": 0}


def test_names_that_need_encoding_reach_the_right_queue(server: Server) -> None:
    name = "a/b c?d%20\\"
    push(server, name, "k", "v")
    assert "k" in ok("peek", name, "--admin", server.admin)
    assert ok("purge", name, "--admin", server.admin) == "purged 1 packets from a/b c?d%20\\\\\n"


def test_a_name_as_the_tables_show_it_is_taken_back_with_escaped(server: Server) -> None:
    with BlockingPinpriqClient.connect("127.0.0.1", server.port) as client:
        client.push(b"bad\xff\x00name\n", b"k", b"v", confirm=True)  # a NUL: no argv holds it
    shown = next(
        line.split()[0]
        for line in ok("queues", "--admin", server.admin).splitlines()
        if line.startswith("bad")
    )
    assert shown == "bad\\xff\\x00name\\n"
    assert ok("peek", "--escaped", shown, "--admin", server.admin).splitlines()[1].split() == [
        "1",
        "k",
        "v",
    ]
    purged = ok("purge", shown, "--escaped", "--admin", server.admin)
    assert purged == f"purged 1 packets from {shown}\n"
    # Without --escaped, the name is the bytes the shell passed: another queue.
    assert "purged 0 packets" in ok("purge", shown, "--admin", server.admin)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ["stats", "--admin", "http://127.0.0.1:1"],
            {},
            "cannot reach the admin listener at http://127.0.0.1:1",
        ),
        (["queues"], {"PINPRIQ_ADMIN_URL": "http://127.0.0.1:1"}, "cannot reach"),
        (["queues"], {"PINPRIQ_ADMIN_URL": "pinpriq://x"}, "PINPRIQ_ADMIN_URL: must look like"),
    ],
)
def test_errors_are_one_line_and_exit_1(args: list[str], env: dict[str, str], message: str) -> None:
    done = pinpriq(*args, **env)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_arguments_exit_2() -> None:
    wrong = [["peek", "q", "-n", "0"], ["stats", "--admin", "ftp://host"], ["peek"]]
    wrong += [["move", "q"], ["move", "q", "r", "-n", "0"], ["move", "q", "r", "-n", "x"]]
    for args in wrong:
        done = pinpriq(*args)
        assert done.returncode == 2, args
        assert done.stderr.count("\n") == 1


def test_the_token_comes_from_the_environment() -> None:
    server = start(env={"PATH": str(BIN), "PINPRIQ_AUTH_TOKEN": TOKEN})
    try:
        done = pinpriq("stats", "--admin", server.admin)
        assert done.returncode == 1
        assert "said 401" in done.stderr
        assert "set PINPRIQ_AUTH_TOKEN" in done.stderr
        done = pinpriq("stats", "--admin", server.admin, PINPRIQ_AUTH_TOKEN="wrong")
        assert done.returncode == 1
        assert "packets" in ok("stats", "--admin", server.admin, PINPRIQ_AUTH_TOKEN=TOKEN)
    finally:
        stop(server)


def test_the_token_in_pinpriq_url_is_the_admin_commands_token_too() -> None:
    token = "t0ken/with:odd@chars"
    server = start(env={"PATH": str(BIN), "PINPRIQ_AUTH_TOKEN": token})
    try:
        url = f"pinpriq://:{quote(token, safe='')}@127.0.0.1:{server.port}"
        assert "packets" in ok("stats", "--admin", server.admin, PINPRIQ_URL=url)
        # PINPRIQ_URL's token wins over PINPRIQ_AUTH_TOKEN, as for the data port's commands.
        assert "packets" in ok(
            "stats", "--admin", server.admin, PINPRIQ_URL=url, PINPRIQ_AUTH_TOKEN="x"
        )
    finally:
        stop(server)


def test_json_logs_and_debug_lines_for_each_connection() -> None:
    server = start("--log-format", "json", "--log-level", "debug")
    try:
        entries = [json.loads(line) for line in server.lines]
        assert {"time", "level", "logger", "message"} <= set(entries[0])
        assert entries[-1]["message"].startswith("pinpriq listening on")
        push(server, "logged", "k", "v")
    finally:
        rest = stop(server)
    closed = [json.loads(line)["message"] for line in rest.splitlines() if b"closed:" in line]
    # One push and one sync: two frames, then the client's end of stream.
    assert any(
        re.fullmatch(
            r"connection from \S+ closed: closed by the client; 2 frames "
            r"handled",
            message,
        )
        for message in closed
    ), closed


def test_health_says_serving_and_ready_and_fails_without_a_server(server: Server) -> None:
    assert ok("health", "--admin", server.admin) == f"ok: {server.admin}/healthz\n"
    assert ok("health", "--ready", "--admin", server.admin) == f"ok: {server.admin}/readyz\n"
    assert json.loads(ok("health", "--json", "--admin", server.admin)) == {"status": "serving"}
    done = pinpriq("health", "--admin", "http://127.0.0.1:1")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1
    assert "cannot reach the admin listener" in done.stderr


def test_health_needs_no_token_where_stats_do() -> None:
    server = start(env={"PATH": str(BIN), "PINPRIQ_AUTH_TOKEN": TOKEN})
    try:
        ok("health", "--ready", "--admin", server.admin)
        assert pinpriq("stats", "--admin", server.admin).returncode == 1
        purge = pinpriq("purge", "q", "--admin", server.admin, PINPRIQ_AUTH_TOKEN="wrong")
        assert purge.returncode == 1
    finally:
        log = stop(server)
    assert b"refusing GET /stats from 127.0.0.1:" in log  # as the data port logs refusals
    assert b"refusing POST /queues/q/purge from 127.0.0.1:" in log
    assert b"wrong" not in log


def test_with_tls_the_admin_listener_speaks_https_with_the_data_ports_certificate(
    tmp_path: Path,
) -> None:
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(tmp_path / "both.pem")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    pem, trust = str(tmp_path / "both.pem"), str(tmp_path / "ca.pem")
    server = start("--tls-cert", pem, "--tls-key", pem)
    try:
        assert server.admin.startswith("https://127.0.0.1:")
        ok("health", "--admin", server.admin, "--tls-ca", trust)
        push_done = pinpriq(
            "--port", str(server.port), "--tls-ca", trust, "push", "secured", "k", "v"
        )
        assert push_done.returncode == 0, push_done.stderr
        assert "secured" in ok("queues", "--admin", server.admin, "--tls-ca", trust)
        untrusted = pinpriq("health", "--admin", server.admin)  # the system's CAs: no
        assert untrusted.returncode == 1
        assert untrusted.stderr == (
            f"pinpriq: cannot reach the admin listener at {server.admin}: TLS handshake failed: "
            "certificate verify failed: unable to get local issuer certificate; if the server's "
            "certificate comes from a private CA, trust it with --tls-ca FILE\n"
        )
        plain = pinpriq("health", "--admin", server.admin.replace("https:", "http:"))
        assert plain.returncode == 1  # plain HTTP to a TLS port gets no answer
        assert plain.stderr.count("\n") == 1
        ok("health", "--admin", server.admin, "--tls-ca", trust)  # and the listener goes on
    finally:
        log = stop(server)
    # The plain request is logged, naming the client, as the data port logs its refusals.
    assert re.search(
        rb"closing the admin connection from 127\.0\.0\.1:\d+: TLS handshake failed: .*"
        rb"the peer does not seem to speak TLS",
        log,
    )
