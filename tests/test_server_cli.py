"""``pinpriq-server`` as a user runs it: a subprocess, signals, and one-line errors."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# The console script installed beside this interpreter: what a user runs.
SERVER = [str(Path(sys.executable).parent / "pinpriq-server")]
LISTENING = re.compile(r"pinpriq listening on (\S+) port (\d+)")


class ServerProcess:
    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [*SERVER, *args], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stderr is not None
        line = self.process.stderr.readline()  # blocks until the server says it listens
        match = LISTENING.search(line)
        assert match, f"expected the listening line, got {line!r}"
        self.listening_line = line
        self.port = int(match.group(2))

    def stop(self, signum: int) -> tuple[int, float, str]:
        """Send a signal; returns exit status, seconds to exit, and the rest of stderr."""
        started = time.monotonic()
        self.process.send_signal(signum)
        _, stderr = self.process.communicate(timeout=10)
        return self.process.returncode, time.monotonic() - started, stderr


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    process = ServerProcess("--port", "0")
    yield process
    if process.process.poll() is None:
        process.process.kill()
        process.process.communicate()


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SERVER, *args], capture_output=True, text=True, timeout=30)


def test_logs_one_line_with_address_and_port(server: ServerProcess) -> None:
    assert "127.0.0.1" in server.listening_line
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"\x50\x00\x01q")
        assert sock.recv(2) == b"\x00\x00"


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
    result = run("--port", str(server.port))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"port {server.port}" in lines[0]
    assert "in use" in lines[0].lower()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--port", "seven"], "--port"),
        (["--port", "70000"], "--port"),
        (["--log-level", "loud"], "--log-level"),
        (["--no-such-option"], "--no-such-option"),
        (["--host", "no.such.host.invalid", "--port", "0"], "no.such.host.invalid"),
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
