"""The soak script (``python -m pinpriq.soak``, in ``pinpriq.bench.soak``) still runs: a few
seconds of it, so it cannot rot. And its server lives exactly as long as the soak: through a
whole run, and not past a killed one.

The real soak is a minute or more and is run by hand; see README, "Soak test". The lifetime tests
run on real time, as they must: they are about processes and signals, not logic.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from pinpriq.bench.lifetime import start_child
from pinpriq.bench.soak import ServerProcess

RSS_LINE = re.compile(r"^\s*\d+\.\d+s  ops .* rss \d+\.\d MiB$", re.MULTILINE)
#: Longer than trio keeps an idle worker thread (10 s in trio._core._thread_cache): a child
#: forked from such a thread with PR_SET_PDEATHSIG was sent SIGTERM when the thread exited.
OUTLIVES_WORKER_THREADS = 15.0


def test_a_short_soak_runs_clean() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pinpriq.soak", "--seconds", "3", "--seed", "7"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(RSS_LINE.findall(result.stdout)) >= 4, result.stdout  # one at start, then ~6
    assert "rss: start " in result.stdout
    assert "rss levelled off: " in result.stdout
    assert "server exited with status 0" in result.stdout
    assert result.stdout.rstrip().endswith("soak: ok"), result.stdout


async def test_the_soaks_server_outlives_trios_idle_worker_threads(nursery: trio.Nursery) -> None:
    server = await ServerProcess.start(nursery)
    await trio.sleep(OUTLIVES_WORKER_THREADS)
    assert server.process.poll() is None, "\n".join(server.log)
    assert await server.stop() == 0


async def test_children_that_die_with_their_parent_are_forked_on_the_main_thread_only() -> None:
    with pytest.raises(RuntimeError, match="must run on the main thread"):
        await trio.to_thread.run_sync(start_child, [sys.executable, "-c", "pass"])


def running(pid: int) -> bool:
    """Whether a process exists and has not exited (a zombie no one has reaped yet has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_killed_soak_leaves_no_server_behind() -> None:
    soak = subprocess.Popen(
        [sys.executable, "-m", "pinpriq.soak", "--seconds", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert soak.stdout is not None
    try:
        first = soak.stdout.readline()
        match = re.match(r"soak: server pid (\d+) ", first)
        assert match, first
        server = int(match[1])
        assert running(server)
    finally:
        soak.kill()
        soak.wait()
        soak.stdout.close()
    deadline = time.monotonic() + 10  # SIGTERM, then the server's graceful stop
    while running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    left_behind = running(server)
    if left_behind:
        os.kill(server, signal.SIGKILL)  # fail, but leave nothing behind either
    assert not left_behind
