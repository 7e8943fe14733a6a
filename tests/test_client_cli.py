"""The ``pinpriq`` command as a user runs it: subprocesses against a ``pinpriq-server``
subprocess on an ephemeral loopback port."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO
from urllib.parse import quote

import pytest
import trustme

from pinpriq.cli.client import ServerUrl, parse_url

BIN = Path(sys.executable).parent
PINPRIQ = str(BIN / "pinpriq")
TIMEOUT = 20


def read_line(stream: IO[bytes], deadline: float) -> bytes:
    """One line from a subprocess pipe, failing the test if none comes before ``deadline``."""
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            pytest.fail(f"no complete line within the deadline; have {line!r}")
        byte = os.read(stream.fileno(), 1)
        if not byte:
            pytest.fail(f"pipe closed; have {line!r}")
        line += byte
    return line


@contextlib.contextmanager
def server_process(*options: str) -> Iterator[int]:
    """A ``pinpriq-server --port 0`` subprocess with ``options``, stopped at the end; its port
    is parsed from its log line."""
    command = [str(BIN / "pinpriq-server"), "--host", "127.0.0.1", "--port", "0"]
    server = subprocess.Popen(
        [*command, "--http-port", "off", *options],
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert server.stderr is not None
    try:
        deadline = time.monotonic() + TIMEOUT
        while b"listening on" not in (line := read_line(server.stderr, deadline)):
            pass
        yield int(line.split()[-1])
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(TIMEOUT)
        finally:
            server.kill()
            server.stderr.close()


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with server_process() as listening:
        yield listening


def env(**extra: str) -> dict[str, str]:
    environment = {
        k: v for k, v in os.environ.items() if k not in ("PINPRIQ_URL", "PINPRIQ_AUTH_TOKEN")
    }
    return environment | extra


def pinpriq(
    port: int | None, *args: str | bytes, **environ: str
) -> subprocess.CompletedProcess[str]:
    argv = [PINPRIQ, *(["--port", str(port)] if port is not None else []), *args]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=TIMEOUT, env=env(**environ), check=False
    )


def ok(port: int, *args: str | bytes) -> str:
    """stdout of a command that must succeed quietly."""
    done = pinpriq(port, *args)
    assert (done.returncode, done.stderr) == (0, ""), done
    return done.stdout


def test_push_then_pop_prints_key_tab_payload(port: int) -> None:
    assert ok(port, "push", "jobs", "job-1", "resize cat.jpg", "--prio", "2") == ""
    assert ok(port, "pop", "jobs") == "job-1\tresize cat.jpg\n"


def test_options_go_before_or_after_the_command(port: int) -> None:
    ok(port, "push", "opts", "k", "v")
    done = subprocess.run(
        [PINPRIQ, "--json", "pop", "--port", str(port), "opts"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env(),
        check=False,
    )
    assert json.loads(done.stdout) == {"key": "k", "payload": "v"}


def test_unprintable_bytes_are_escaped_one_line_per_packet(port: int) -> None:
    ok(port, "push", "esc", "k\t1", "caf\u00e9 a\x01b\\c\nd")
    ok(port, "push", "esc", "k\t1", b"\xff\xfe", "--prio", "0")
    assert ok(port, "pop", "esc").splitlines() == [
        "k\\t1\tcaf\u00e9 a\\x01b\\\\c\\nd",
        "k\\t1\t\\xff\\xfe",
    ]


def test_json_output_parses_and_marks_base64(port: int) -> None:
    ok(port, "push", "js", "k", "caf\u00e9", "--ttl", "60000")
    ok(port, "push", "js", "k", b"\xff\xfe", "--prio", "0")
    lines = ok(port, "--json", "pop", "js").splitlines()
    assert [json.loads(line) for line in lines] == [
        {"key": "k", "payload": "caf\u00e9"},
        {"key": "k", "payload": {"base64": "//4="}},
    ]


def test_a_ttl_in_hours_is_a_push_the_server_takes(port: int) -> None:
    assert ok(port, "push", "hours", "k", "v", "--ttl", "2h") == ""  # a 71: protocol 1.2
    assert ok(port, "pop", "hours") == "k\tv\n"


def test_a_delayed_push_is_stored_and_not_popped_before_it_is_due(port: int) -> None:
    assert ok(port, "push", "later", "k", "v", "--delay", "1h", "--ttl", "2h") == ""
    assert ok(port, "pop", "later") == ""  # in no queue for an hour


def test_pop_of_an_empty_queue_prints_nothing(port: int) -> None:
    assert ok(port, "pop", "nothing-here") == ""


def test_subscribe_count_prints_that_many_and_takes_no_more(port: int) -> None:
    for i in range(4):
        ok(port, "push", "sub", f"k{i}", f"p{i}")
    assert ok(port, "subscribe", "sub", "--count", "2", "--prefetch", "5") == "k3\tp3\nk2\tp2\n"
    assert ok(port, "pop", "sub") == "k1\tp1\n"


def test_subscribe_prints_packets_as_they_are_pushed(port: int) -> None:
    with subprocess.Popen(
        [PINPRIQ, "--port", str(port), "--json", "subscribe", "live-a", "live-b", "--count", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env(),
    ) as subscriber:
        assert subscriber.stdout is not None
        deadline = time.monotonic() + TIMEOUT
        ok(port, "push", "live-b", "first", "1")
        assert json.loads(read_line(subscriber.stdout, deadline)) == {
            "key": "first",
            "payload": "1",
        }
        ok(port, "push", "live-a", "second", "2")
        assert json.loads(read_line(subscriber.stdout, deadline)) == {
            "key": "second",
            "payload": "2",
        }
        assert subscriber.wait(TIMEOUT) == 0


def test_ctrl_c_in_subscribe_exits_130_quietly(port: int) -> None:
    with subprocess.Popen(
        [PINPRIQ, "--port", str(port), "subscribe", "ctrl-c"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env(),
    ) as subscriber:
        assert subscriber.stdout is not None
        assert subscriber.stderr is not None
        ok(port, "push", "ctrl-c", "k", "v")
        assert read_line(subscriber.stdout, time.monotonic() + TIMEOUT) == b"k\tv\n"
        subscriber.send_signal(signal.SIGINT)
        assert subscriber.wait(TIMEOUT) == 130
        assert subscriber.stderr.read() == b""


def test_pinpriq_url_names_the_server_and_options_override_it(port: int) -> None:
    url = f"pinpriq://127.0.0.1:{port}"
    assert pinpriq(None, "push", "url", "k", "v", PINPRIQ_URL=url).returncode == 0
    done = pinpriq(None, "--port", str(port), "pop", "url", PINPRIQ_URL="pinpriq://127.0.0.1:1")
    assert (done.returncode, done.stdout) == (0, "k\tv\n")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://127.0.0.1:7000", "PINPRIQ_URL must look like pinpriq://HOST:PORT"),
        ("pinpriq://h/x", "PINPRIQ_URL must look like pinpriq://HOST:PORT"),
        ("pinpriq://h:port", "PINPRIQ_URL must look like pinpriq://HOST:PORT"),
        ("pinpriq://127.0.0.1:99999", "PINPRIQ_URL: port 99999 is out of range (1..65535)"),
        ("pinpriq://h:0", "PINPRIQ_URL: port 0 is out of range (1..65535)"),
    ],
)
def test_a_bad_pinpriq_url_is_one_line(url: str, message: str) -> None:
    done = pinpriq(None, "pop", "q", PINPRIQ_URL=url)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert message in done.stderr


def test_refused_connection_is_one_line_and_exit_1() -> None:
    with socket.socket() as placeholder:  # bound, never listening
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
        done = pinpriq(port, "pop", "q")
    assert done.returncode == 1
    assert done.stderr == f"pinpriq: cannot connect to 127.0.0.1:{port}: Connection refused\n"
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["push", "q", "k", "v", "--prio", "256"], "argument --prio: 256 is not in 0..255"),
        (["push", "q", "k", "v", "--ttl", "-1"], "argument --ttl: invalid duration '-1': use e.g."),
        (
            ["push", "q", "k", "v", "--ttl", "50d"],
            "argument --ttl: 50d is more than about 49.7 days (4294967295 ms)",
        ),
        (
            ["push", "q", "k", "v", "--delay", "31d"],
            "argument --delay: 31d is more than 30 days (2592000000 ms)",
        ),
        (["push", "q", "k", "v", "--delay", "10x"], "argument --delay: invalid duration '10x'"),
        (["push", "q", "k", "v", "--delay", "1.5ms"], "1.5ms is not a whole number of millis"),
        (["subscribe", "q", "--prefetch", "0"], "argument --prefetch: 0 is not in 1..65535"),
        (["subscribe"], "the following arguments are required: QUEUE"),
        (["pop", "q", "--timeout", "0"], "argument --timeout: 0 is not a positive number"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["--port", "0", "pop", "q"], "argument --port: invalid port 0: must be 1..65535"),
        (["work", "q"], "work needs a command to run: pinpriq work QUEUE -- COMMAND"),
        (["work", "q", "--"], "work needs a command to run"),
        (["work", "q", "--", "no-such-command-x"], "cannot run 'no-such-command-x': not found"),
        (["work", "q", "--lease", "0", "--", "true"], "argument --lease: 0 is less than 1 ms"),
        (["work", "q", "--lease", "25h", "--", "true"], "25h is more than 24 hours (86400000 ms)"),
        (["work", "q", "--retry-delay", "soon", "--", "true"], "invalid duration 'soon'"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    done = pinpriq(1, *args)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert message in done.stderr


def test_a_field_too_long_is_one_line_and_exit_2(port: int) -> None:
    done = pinpriq(port, "push", "q", "k", "x" * 65536)
    assert (done.returncode, done.stderr) == (
        2,
        "pinpriq: error: payload is 65536 bytes; the most is 65535\n",
    )


# -- push is confirmed; ping --------------------------------------------------------------------


@pytest.fixture
def silent_server() -> Iterator[socket.socket]:
    """A TCP server that accepts connections and answers nothing (its backlog accepts them)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener


NOT_PINPRIQ = "it may not be a pinpriq server (it took the connection and answered nothing)"


def test_push_fails_unless_the_server_confirms_it(silent_server: socket.socket) -> None:
    port = silent_server.getsockname()[1]
    done = pinpriq(port, "--timeout", "0.3", "push", "q", "k", "v")
    assert done.returncode == 1
    assert (
        done.stderr == f"pinpriq: push to 127.0.0.1:{port}: no answer within 0.3 s: {NOT_PINPRIQ}\n"
    )


def test_ping_at_something_silent_says_it_may_not_be_pinpriq(silent_server: socket.socket) -> None:
    port = silent_server.getsockname()[1]
    done = pinpriq(port, "--timeout", "0.3", "ping")
    assert done.returncode == 1
    assert (
        done.stderr
        == f"pinpriq: sync with 127.0.0.1:{port}: no answer within 0.3 s: {NOT_PINPRIQ}\n"
    )


def test_a_push_held_at_the_memory_cap_says_so() -> None:
    with server_process("--max-memory", "2000") as port:
        for key in ("k1", "k2"):  # a push is taken while the cap is not reached: over it
            ok(port, "push", "full", key, "x" * 1000)
        done = pinpriq(port, "--timeout", "0.5", "push", "full", "k3", "x")
    assert done.returncode == 1
    assert done.stderr == (
        f"pinpriq: push to 127.0.0.1:{port}: no answer within 0.5 s: the server answers a ping, "
        "so it holds the push: it is most likely at its memory cap (--max-memory), where pushes "
        "wait until pops or expiry free room\n"
    )


def test_push_to_something_that_is_not_pinpriq_fails_loudly() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        command = subprocess.Popen(
            [PINPRIQ, "--port", str(port), "push", "q", "k", "v"],
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
        )
        conn, _ = listener.accept()
        with conn:
            conn.sendall(b"-ERR unknown command\r\n")  # what a Redis server would say
            _, stderr = command.communicate(timeout=TIMEOUT)
    assert command.returncode == 1
    assert "answered a sync with 2d 45 instead of 00 00" in stderr
    assert stderr.count("\n") == 1


def push_qkv(port: int, *options: str) -> subprocess.Popen[str]:
    """``pinpriq push q k v OPTIONS`` to a port the test answers by hand; its stderr piped."""
    return subprocess.Popen(
        [PINPRIQ, "--port", str(port), "push", "q", "k", "v", *options],
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )


def test_push_delay_and_ttl_take_units_and_a_bare_number_is_milliseconds() -> None:
    # The bytes the command sends, read by hand: 10s and 2h make a 71 (decision 21), then the
    # sync that confirms it; a bare --ttl 60000 with no delay stays the 1.0 push, 70.
    ttl_2h, delay_10s = struct.pack(">I", 7_200_000), struct.pack(">I", 10_000)
    sent = {
        ("--delay", "10s", "--ttl", "2h"): b"\x71\x00\x01" + ttl_2h + delay_10s + b"\x01",
        ("--ttl", "60000"): b"\x70\x00\x01\xea\x60\x01",
        ("--delay", "1.5m", "--ttl", "0"): b"\x71\x00\x01" + bytes(4) + b"\x00\x01\x5f\x90\x01",
    }
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(TIMEOUT)
        port = listener.getsockname()[1]
        for options, header in sent.items():
            frame = header + b"\x00\x01\x00\x01kvq\x21"  # key k, payload v, queue q; sync
            command = push_qkv(port, *options)
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(TIMEOUT)
                received = b""
                while len(received) < len(frame) and (chunk := conn.recv(4096)):
                    received += chunk
                conn.sendall(b"\x00\x00")  # the sync's answer: exit 0 means stored
                _, stderr = command.communicate(timeout=TIMEOUT)
            assert (received, command.returncode, stderr) == (frame, 0, ""), options


def test_a_delayed_push_to_a_server_that_closes_on_it_says_it_may_not_speak_1_2() -> None:
    # What a 1.0 or 1.1 server does with a 71: an unknown opcode, so it closes the connection.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(TIMEOUT)
        port = listener.getsockname()[1]
        command = push_qkv(port, "--delay", "10s")
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(TIMEOUT)
            assert conn.recv(1) == b"\x71"
        _, stderr = command.communicate(timeout=TIMEOUT)
    assert command.returncode == 1
    assert stderr.endswith(
        ", or not speak protocol 1.2, which a push with a delay or a TTL above 65,535 ms needs)\n"
    )
    assert stderr.count("\n") == 1


def test_push_to_a_server_at_its_connection_limit_says_so() -> None:
    with (
        server_process("--max-connections", "1") as port,
        socket.create_connection(("127.0.0.1", port)) as holder,
    ):
        holder.sendall(b"\x21")
        assert holder.recv(2) == b"\x00\x00"  # it holds the one slot
        done = pinpriq(port, "push", "q", "k", "v")
    assert done.returncode == 1
    assert done.stderr == (
        f"pinpriq: 127.0.0.1:{port}: the server closed the connection at once (it may be at "
        "its connection limit, want a token or TLS, or refuse clients from other hosts, or not "
        "speak protocol 1.1, which sync needs)\n"
    )


def test_ping_prints_the_round_trip(port: int) -> None:
    out = ok(port, "ping")
    assert re.fullmatch(rf"pong from 127\.0\.0\.1:{port} in \d+\.\d ms\n", out), out


# -- a server with a token and TLS -----------------------------------------------------------

SECRET = "cli t0ken/with:odd@chars"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """``pinpriq-server --tls-cert --tls-key`` with a token from the environment; its port and
    the PEM file of the CA its certificate comes from."""
    files = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    leaf.private_key_and_cert_chain_pem.write_to_path(files / "cert.pem")
    leaf.private_key_pem.write_to_path(files / "key.pem")
    ca.cert_pem.write_to_path(files / "ca.pem")
    tls = ["--tls-cert", str(files / "cert.pem"), "--tls-key", str(files / "key.pem")]
    server = subprocess.Popen(
        [str(BIN / "pinpriq-server"), "--port", "0", "--http-port", "off", *tls],
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env(PINPRIQ_AUTH_TOKEN=SECRET),
    )
    assert server.stderr is not None
    try:
        deadline = time.monotonic() + TIMEOUT
        while b"listening on" not in (line := read_line(server.stderr, deadline)):
            pass
        assert line.endswith(b"(TLS)\n")
        yield int(line.split()[-2]), files / "ca.pem"
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(TIMEOUT)
        finally:
            server.kill()
            server.stderr.close()


def test_a_pinpriqs_url_with_a_token_reaches_a_tls_server(secured: tuple[int, Path]) -> None:
    port, ca = secured
    url = f"pinpriqs://:{quote(SECRET, safe='')}@127.0.0.1:{port}"
    assert pinpriq(None, "--tls-ca", str(ca), "push", "tls", "k", "v", PINPRIQ_URL=url).stderr == ""
    done = pinpriq(None, "pop", "tls", "--tls-ca", str(ca), PINPRIQ_URL=url)
    assert (done.returncode, done.stdout, done.stderr) == (0, "k\tv\n", "")


def test_the_token_comes_from_the_environment_too(secured: tuple[int, Path]) -> None:
    port, ca = secured
    done = pinpriq(port, "--tls-ca", str(ca), "ping", PINPRIQ_AUTH_TOKEN=SECRET)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout.startswith(f"pong from 127.0.0.1:{port} in ")


def test_a_wrong_token_is_one_line_that_does_not_show_it(secured: tuple[int, Path]) -> None:
    port, ca = secured
    url = f"pinpriqs://:not-the-token@127.0.0.1:{port}"
    done = pinpriq(None, "--tls-ca", str(ca), "pop", "q", PINPRIQ_URL=url)
    assert done.returncode == 1
    assert done.stderr == (
        f"pinpriq: 127.0.0.1:{port} closed the connection in answer to auth: it does not take "
        "this token (or speaks protocol 1.0, which has no auth)\n"
    )


def test_a_plain_client_with_the_right_token_on_a_tls_port_is_told_it_may_need_tls(
    secured: tuple[int, Path],
) -> None:
    port, _ = secured
    done = pinpriq(port, "ping", PINPRIQ_AUTH_TOKEN=SECRET)
    assert done.returncode == 1
    # Closed at once: a token the server refuses is closed after about half a second.
    assert done.stderr == (
        f"pinpriq: 127.0.0.1:{port}: the server closed the connection at once, without judging "
        "the token (it may speak TLS only, which this client did not; or be at its connection "
        "limit, refuse clients from other hosts, or speak protocol 1.0, which has no auth)\n"
    )


def test_tls_without_trusting_the_ca_is_one_line(secured: tuple[int, Path]) -> None:
    port, _ = secured
    done = pinpriq(port, "--tls", "pop", "q", PINPRIQ_AUTH_TOKEN=SECRET)
    assert done.returncode == 1
    assert done.stderr.startswith(
        f"pinpriq: cannot connect to 127.0.0.1:{port}: TLS handshake failed: certificate verify"
    )
    assert done.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "url", "message"),
    [
        ([], "pinpriq://user:pw@h:1", "PINPRIQ_URL: pinpriq has no user names: write the token"),
        ([], "pinpriq://pw@h:1", "PINPRIQ_URL: pinpriq has no user names: write the token"),
        ([], "pinpriq://:@h:1", "PINPRIQ_URL: the token after ':' is empty"),
        (["--tls-cert", "c.pem"], "pinpriq://h:1", "--tls-cert and --tls-key go together"),
        (["--tls-ca", "/nonexistent"], "pinpriq://h:1", "cannot use the TLS files"),
    ],
)
def test_bad_tokens_and_tls_options_are_one_line(args: list[str], url: str, message: str) -> None:
    done = pinpriq(None, *args, "pop", "q", PINPRIQ_URL=url)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert message in done.stderr
    assert "pw" not in done.stderr


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("pinpriq://h", ServerUrl("h", 7000, None, False)),  # the default port
        ("pinpriq://h:", ServerUrl("h", 7000, None, False)),
        ("pinpriqs://[::1]:7100", ServerUrl("::1", 7100, None, True)),
        ("pinpriq://:%FF%00a%2F%40%25@h:1", ServerUrl("h", 1, b"\xff\x00a/@%", False)),
        ("pinpriq://:p:w+%zz@h:1", ServerUrl("h", 1, b"p:w+%zz", False)),  # taken as written
        ("pinpriq://:s\u00e9@h:1", ServerUrl("h", 1, "s\u00e9".encode(), False)),  # UTF-8
    ],
)
def test_the_url_gives_host_port_token_and_tls(url: str, expected: ServerUrl) -> None:
    # A token is any bytes: %XX is the byte XX, not a character's UTF-8 (%FF was b"\xef\xbf\xbd").
    assert parse_url(url) == expected


# -- work: jobs on a lease ------------------------------------------------------------------------

JOB_SCRIPT = """
import os, sys
data = sys.stdin.buffer.read()
print(os.environ["PINPRIQ_KEY"], os.environ["PINPRIQ_ATTEMPT"], os.environ["PINPRIQ_PACKETS"],
      data.decode(), flush=True)
sys.exit(1 if data == b"fails once" and os.environ["PINPRIQ_ATTEMPT"] == "1" else 0)
"""


def test_work_runs_the_command_per_job_acks_on_0_and_releases_otherwise(port: int) -> None:
    ok(port, "push", "work", "a", "fails once", "--prio", "1")
    ok(port, "push", "work", "b", "fine", "--prio", "2")
    done = pinpriq(
        port, "work", "work", "--count", "3", "--lease", "30s", "--retry-delay", "0s",
        "--", sys.executable, "-c", JOB_SCRIPT,
    )  # fmt: skip
    assert done.returncode == 0, done
    # The failed job came back, with its place in push order and its priority, before "b".
    assert done.stdout.splitlines() == ["a 1 1 fails once", "a 2 1 fails once", "b 1 1 fine"]
    [line] = done.stderr.splitlines()  # one line per failure, no traceback
    assert line.startswith(f"pinpriq: 127.0.0.1:{port}: job b'a' (attempt 1) failed, released: ")
    assert line.endswith("exited with status 1")
    assert ok(port, "pop", "work") == ""  # all acked


def test_work_gives_a_key_group_to_one_command_run(port: int) -> None:
    ok(port, "push", "work-group", "k", "one ", "--prio", "1")
    ok(port, "push", "work-group", "k", "two", "--prio", "0")
    assert ok(port, "work", "work-group", "--count", "1", "--", "cat") == "one two"
    ok(port, "push", "work-group", "k", "x")
    lines = ok(port, "--json", "work", "work-group", "--count", "1", "--", "cat").splitlines()
    assert [json.loads(line) for line in lines] == [{"key": "k", "payload": "x"}]


SPLIT_SCRIPT = """
import json, os, sys
data, parts = sys.stdin.buffer.read(), []
for size in map(int, os.environ["PINPRIQ_PAYLOAD_SIZES"].split(",")):
    parts.append(data[:size].decode())
    data = data[size:]
print(json.dumps(parts + [data.decode()]))
"""


def test_work_says_where_each_payload_of_a_key_group_ends(port: int) -> None:
    for payload, prio in (("one\ntwo", "1"), ("", "0"), ("3,4", "0")):
        ok(port, "push", "work-split", "k", payload, "--prio", prio)
    out = ok(port, "work", "work-split", "--count", "1", "--", sys.executable, "-c", SPLIT_SCRIPT)
    assert json.loads(out) == ["one\ntwo", "", "3,4", ""]  # nothing after the last


def test_a_worker_interrupted_mid_job_gives_the_job_back(port: int) -> None:
    with subprocess.Popen(
        [
            PINPRIQ,
            "--port",
            str(port),
            "work",
            "work-int",
            "--",
            "sh",
            "-c",
            "echo started; sleep 60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env(),
        start_new_session=True,  # Ctrl-C reaches the worker and its command, as from a terminal
    ) as worker:
        assert worker.stdout is not None
        ok(port, "push", "work-int", "k", "v")
        assert read_line(worker.stdout, time.monotonic() + TIMEOUT) == b"started\n"
        os.killpg(worker.pid, signal.SIGINT)
        assert worker.wait(TIMEOUT) == 130
    deadline = time.monotonic() + TIMEOUT
    while not (popped := ok(port, "pop", "work-int")):  # the server has seen the close
        assert time.monotonic() < deadline, "the job never came back"
    assert popped == "k\tv\n"


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie nobody reaped has ended too)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize(("stop", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_worker_stopped_ends_its_command_and_what_it_started(
    port: int, stop: signal.Signals, status: int
) -> None:
    queue = f"work-stop-{stop.name}"
    # The command starts a process of its own and reports both: the shell's and the sleep's ids.
    script = "sleep 60 & echo $$ $!; wait"
    with subprocess.Popen(
        [PINPRIQ, "--port", str(port), "work", queue, "--", "sh", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env(),
    ) as worker:
        assert worker.stdout is not None
        ok(port, "push", queue, "k", "v")
        started = read_line(worker.stdout, time.monotonic() + TIMEOUT)
        worker.send_signal(stop)  # to the worker alone, as a service manager or kill does
        assert worker.wait(TIMEOUT) == status
    deadline = time.monotonic() + TIMEOUT
    for pid in map(int, started.split()):
        while not gone(pid):  # a signalled process takes a moment to end
            assert time.monotonic() < deadline, f"process {pid} outlived its worker"
            time.sleep(0.01)
    while not (popped := ok(port, "pop", queue)):  # the server has seen the close
        assert time.monotonic() < deadline, "the job never came back"
    assert popped == "k\tv\n"
