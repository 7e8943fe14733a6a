"""``pinpriq-server`` as a user runs it: a subprocess, signals, and one-line errors."""

from __future__ import annotations

import argparse
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pinpriq.cli.args import byte_size

# The console script installed beside this interpreter: what a user runs.
SERVER = [str(Path(sys.executable).parent / "pinpriq-server")]
LISTENING = re.compile(r"pinpriq listening on (\S+) port (\d+)")


class ServerProcess:
    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [*SERVER, *args], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stderr is not None
        # Blocks until the server says it listens; the admin listener's line may come first.
        while not (match := LISTENING.search(line := self.process.stderr.readline())):
            assert line, "the server exited without saying it listens"
        self.listening_line = line
        self.port = int(match.group(2))

    def stop(self, signum: int) -> tuple[int, float, str]:
        """Send a signal; returns exit status, seconds to exit, and the rest of stderr."""
        started = time.monotonic()
        self.process.send_signal(signum)
        # Read through the text wrapper, to its end (the server's exit): the lines logged just
        # after the listening line may already sit in its buffer, read with that line when
        # this process was slow to read, and ``communicate`` reads the pipe beneath it.
        assert self.process.stderr is not None
        stderr = self.process.stderr.read()
        self.process.wait(timeout=10)
        for pipe in (self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()
        return self.process.returncode, time.monotonic() - started, stderr


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    process = ServerProcess("--port", "0", "--http-port", "0")
    yield process
    if process.process.poll() is None:
        process.process.kill()
    process.process.wait()
    for pipe in (process.process.stdout, process.process.stderr):
        if pipe is not None:
            pipe.close()


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SERVER, *args], capture_output=True, text=True, timeout=30)


def test_logs_one_line_with_address_and_port(server: ServerProcess) -> None:
    assert "127.0.0.1" in server.listening_line
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"\x50\x00\x01q")
        assert sock.recv(2) == b"\x00\x00"


def test_the_first_lines_say_which_store_serves(tmp_path: Path) -> None:
    # The build line says what is installed; a --data-dir server runs on the logged store.
    from pinpriq import packed

    in_memory = type(packed.default_store(time.monotonic)).__name__
    logged = "LoggedPackedStore" if packed.available else "LoggedStore"
    for args, expected in [
        ((), f"; store: {in_memory} in memory"),
        (("--data-dir", str(tmp_path / "data")), f"; store: {logged} logged"),
    ]:
        process = ServerProcess("--port", "0", "--http-port", "off", *args)
        status, _, stderr = process.stop(signal.SIGTERM)
        assert status == 0
        assert expected in stderr, stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_within_a_second(server: ServerProcess, signum: int) -> None:
    # A connected client must not hold the shutdown up.
    with socket.create_connection(("127.0.0.1", server.port), timeout=5):
        status, seconds, stderr = server.stop(signum)
    assert status == 0
    assert seconds < 1.0, f"took {seconds:.2f}s to exit"
    assert "Traceback" not in stderr
    assert signal.Signals(signum).name in stderr


def test_port_in_use_is_one_line_and_non_zero(server: ServerProcess) -> None:
    result = run("--port", str(server.port), "--http-port", "off")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"port {server.port}" in lines[0]
    assert "in use" in lines[0].lower()


def test_admin_port_in_use_is_one_line_and_non_zero() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("--port", "0", "--http-port", str(port))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"port {port} (--http-port)" in lines[0]
    assert "in use" in lines[0].lower()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--port", "seven"], "--port"),
        (["--port", "70000"], "--port"),
        (["--log-level", "loud"], "--log-level"),
        (["--no-such-option"], "--no-such-option"),
        (["--host", "no.such.host.invalid", "--port", "0", "--http-port", "off"], "no.such"),
        (["--http-port", "seven"], "--http-port"),
        (["--http-port", "0", "--http-host", "no.such.host.invalid"], "no.such.host.invalid"),
        (["--log-format", "xml"], "--log-format"),
        (["--metrics-max-queues", "-1"], "--metrics-max-queues"),
        # No token: the admin listener stays on loopback (the server exits before listening).
        (["--port", "0", "--http-host", "0.0.0.0"], "refusing an admin listener on 0.0.0.0"),
        (["--lease-default", "0"], "--lease-default"),
        (["--lease-default", "86401"], "86401 is more than 86400 seconds"),
        (["--max-deliveries", "-1"], "--max-deliveries"),
    ],
)
def test_bad_arguments_are_one_line_and_non_zero(args: list[str], fragment: str) -> None:
    result = run(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0]
    assert "Traceback" not in result.stderr


def test_help_names_every_option() -> None:
    result = run("--help")
    assert result.returncode == 0
    for option in ("--host", "--port", "--log-level"):
        assert option in result.stdout


# -- limits and shutdown (issue 6) ------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("65536", 65536),
        ("512MiB", 512 * 1024**2),
        ("512mib", 512 * 1024**2),
        ("2GB", 2 * 1000**3),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("64k", 64 * 1024),
        ("0", 0),
    ],
)
def test_memory_sizes_parse(text: str, size: int) -> None:
    assert byte_size(text) == size


@pytest.mark.parametrize("text", ["", "MiB", "-1GiB", "12XB", "1.5.2MB", "inf", "nan"])
def test_bad_memory_sizes_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size"):
        byte_size(text)


def test_limits_are_in_help() -> None:
    result = run("--help")
    assert "--max-memory" in result.stdout
    assert "--max-connections" in result.stdout
    assert "--lease-default" in result.stdout
    assert "--max-deliveries" in result.stdout


def test_lease_default_and_max_deliveries_reach_the_leases() -> None:
    process = ServerProcess("--port", "0", "--lease-default", "0.2", "--max-deliveries", "1")
    try:
        with socket.create_connection(("127.0.0.1", process.port), timeout=5) as sock:
            reserve = b"\x52\x00\x00\x00\x00\x00\x01q"  # lease time 0: the default
            sock.sendall(b"\x70" + struct.pack(">HHBHH", 1, 0, 1, 1, 0) + b"kq" + reserve)
            assert sock.recv(16, socket.MSG_WAITALL)[:11] == bytes.fromhex(
                "00000000000000010100 01"
            )
            time.sleep(0.4)  # the 0.2 s default passes; the first attempt was the last
            sock.sendall(b"\x50\x00\x01q" + b"\x50\x00\x06q.dead")
            assert sock.recv(9, socket.MSG_WAITALL) == b"\x00\x00" + b"\x00\x01\x00\x01\x00\x00k"
    finally:
        process.stop(signal.SIGTERM)


def _owe_big_replies(port: int) -> socket.socket:
    """A client that is owed ~6 MB of pop replies and has read none of them."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    payload = b"x" * 60_000
    for i in range(100):
        sock.sendall(b"\x70" + struct.pack(">HHBHH", 1, 0, 1, 2, len(payload)) + b"%02d" % i)
        sock.sendall(payload + b"q")
    sock.sendall(b"\x50\x00\x01q" * 100)
    time.sleep(0.3)  # let the server read and answer what it can before the signal
    return sock


def test_sigterm_flushes_owed_replies_before_exiting(server: ServerProcess) -> None:
    with _owe_big_replies(server.port) as sock:
        server.process.send_signal(signal.SIGTERM)
        received = bytearray()
        while chunk := sock.recv(1 << 20):
            received += chunk
    assert server.process.wait(timeout=10) == 0
    assert len(received) >= 4 * 1024 * 1024  # at least what fit under the output bound
    assert len(received) % (6 + 2 + 60_000) == 0  # whole replies only


def test_a_second_signal_exits_at_once(server: ServerProcess) -> None:
    with _owe_big_replies(server.port):  # never read: the graceful flush would wait
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        status, _, stderr = server.stop(signal.SIGTERM)
    assert status == 1
    assert "exiting now" in stderr
    assert "Traceback" not in stderr


def test_running_out_of_file_descriptors_does_not_stop_the_listener() -> None:
    def low_fd_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

    process = subprocess.Popen(
        [*SERVER, "--port", "0", "--http-port", "off"],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=low_fd_limit,
    )
    try:
        assert process.stderr is not None
        port = int(LISTENING.search(process.stderr.readline()).group(2))  # type: ignore[union-attr]
        clients = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(60)]
        time.sleep(0.5)  # the server accepts until it runs out of descriptors, then pauses
        for client in clients:
            client.close()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.settimeout(10)
            sock.sendall(b"\x50\x00\x01q")
            assert sock.recv(2) == b"\x00\x00"
        assert process.poll() is None
    finally:
        process.kill()
        process.communicate()
