"""Real redis-server processes for the Redis store's tests: one standalone server, or a
three-master Cluster, on 127.0.0.1 and ephemeral ports, in a temporary directory, killed at the
end. Nothing here is faked: the tests drive Redis as a deployment would.

Where redis-server is missing the tests that need it skip, except under CI=true, where they
fail (CI installs Redis: ``.ci/run``).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

__all__ = ["RedisServer", "free_port", "need_redis", "start_cluster"]

REDIS = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def need_redis() -> None:
    """Skip without redis-server, but never under CI."""
    if not Path(REDIS).exists():
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed, and CI must run the Redis tests")
        pytest.skip("redis-server not installed (CI installs it, and there these never skip)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_cluster_port() -> int:
    """A free port whose Cluster bus port (10000 above it) is free too."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 50000)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port


class RedisServer:
    """One redis-server process."""

    def __init__(self, directory: Path, *options: str, port: int | None = None) -> None:
        self.directory = directory
        self.options = options
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                REDIS,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.directory),
                "--save", "",
                "--maxmemory-policy", "noeviction",
                *self.options,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while self.cli("PING") != "PONG":
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def cli(self, *command: str) -> str:
        done = subprocess.run(
            [REDIS_CLI, "-p", str(self.port), *command],
            capture_output=True,
            text=True,
            errors="backslashreplace",  # keys are bytes
            check=False,
        )
        return done.stdout.strip()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def start_cluster(directory: Path, masters: int = 3) -> list[RedisServer]:
    """``masters`` redis-server processes made one Cluster by ``redis-cli --cluster create``."""
    nodes = []
    try:
        for index in range(masters):
            node = RedisServer(
                directory / f"node{index}",
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--appendonly", "no",
                port=free_cluster_port(),
            )  # fmt: skip
            nodes.append(node.start())
        addresses = [f"127.0.0.1:{node.port}" for node in nodes]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-yes"],
            capture_output=True,
            check=True,
            timeout=30,
        )
        deadline = time.monotonic() + 20
        while not all("cluster_state:ok" in node.cli("CLUSTER", "INFO") for node in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not come up")
            time.sleep(0.05)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes
