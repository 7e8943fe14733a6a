"""``pinpriq-server --data-dir`` as an operator runs it: real processes on real directories.
Restarts keep packets (TTLs, key groups split across segments, prio-0 riders); every way a
directory cannot be used is one line and a non-zero exit; ``--check-log`` reports;
``--truncate-damaged-log`` starts past damage; a full disk (a small tmpfs) stops pushes and
keeps pops going, and nothing is lost."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pinpriq.blocking import BlockingPinpriqClient
from pinpriq.errors import PinpriqTimeoutError
from pinpriq.persistence.records import read_block
from pinpriq.persistence.segments import SEGMENT_HEADER_SIZE
from pinpriq.wire import DelayedPush, Sync, encode

SERVER = str(Path(sys.executable).parent / "pinpriq-server")
LISTENING = re.compile(r"pinpriq listening on \S+ port (\d+)")


class Server:
    """A ``pinpriq-server`` process, its stderr in a file, started once it listens."""

    _count = 0

    def __init__(self, *args: str) -> None:
        Server._count += 1
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"pinpriq-{os.getpid()}-{self._count}"
        with open(self.log, "wb") as stderr:
            self.process = subprocess.Popen(
                [SERVER, "--port", "0", "--http-port", "off", *args], stderr=stderr
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if match := LISTENING.search(self.text()):
                self.port = int(match.group(1))
                return
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited at start: {self.text()}")
            time.sleep(0.02)
        raise AssertionError("the server did not listen within 60 s")

    def text(self) -> str:
        """Its stderr so far."""
        return self.log.read_text(errors="replace")

    def client(self) -> BlockingPinpriqClient:
        return BlockingPinpriqClient.connect("127.0.0.1", self.port, timeout=10)

    def stop(self) -> str:
        """SIGTERM; returns its whole stderr."""
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)
        text = self.text()
        self.log.unlink()
        assert self.process.returncode == 0, text
        return text


def run(*args: str) -> subprocess.CompletedProcess[str]:
    command = [SERVER, "--http-port", "off", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def drain(client: BlockingPinpriqClient, queue: str) -> list[list[tuple[bytes, bytes]]]:
    replies = []
    while packets := client.pop(queue):
        replies.append([(p.key, p.payload) for p in packets])
    return replies


@pytest.mark.parametrize("writes", ["mapped", "pwrite"])
def test_packets_survive_a_restart_with_ttls_groups_across_segments_and_riders(
    tmp_path: Path, writes: str
) -> None:
    """Either way of writing blocks (``--log-writes``): the default copies into mapped
    segments, rotating through several of them here."""
    data = str(tmp_path / "data")
    server = Server("--data-dir", data, "--log-segment-size", "64KiB", "--log-writes", writes)
    with server.client() as client:
        client.push("q", "group", "first", prio=3)
        client.push("q", "group", "rider", prio=0)
        for i in range(30):  # 120 kB between the group's packets: other segments
            client.push("filler", f"{i}", bytes(4000), prio=1)
        client.push("q", "group", "last", prio=2)
        client.push("q", "alone", "a", prio=2)  # newer than group/last at prio 2: first out
        client.push("q", "lone-rider", "r", prio=0)
        client.push("q", "brief", "b", ttl_ms=300, prio=1)
        client.push("q", "lasting", "l", ttl_ms=60_000, prio=1)
        client.sync()
    server.stop()
    assert len(list((tmp_path / "data").glob("*.log"))) >= 3
    time.sleep(0.4)  # "brief" expires while the server is down
    server = Server("--data-dir", data, "--log-segment-size", "64KiB")
    assert "packets expired while the server was down" in server.text()
    with server.client() as client:
        assert drain(client, "q") == [
            [(b"lasting", b"l")],
            [(b"alone", b"a")],
            [(b"group", b"last"), (b"group", b"first"), (b"group", b"rider")],
        ]
        client.push("q", "lone-rider", "sweeper", prio=1)
        assert drain(client, "q") == [[(b"lone-rider", b"sweeper"), (b"lone-rider", b"r")]]
        assert len(drain(client, "filler")) == 30
    rest = server.stop()
    assert "log closed" in rest


def test_an_empty_directory_is_said_to_be_new(tmp_path: Path) -> None:
    server = Server("--data-dir", str(tmp_path / "new"))
    assert "recovered 0 packets" in server.text()
    server.stop()
    assert (tmp_path / "new" / "FORMAT").read_text() == "pinpriq log format 2\n"


def test_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    for args, expected in [
        (["--fsync", "always"], "--fsync needs --data-dir"),
        (["--check-log"], "--check-log needs --data-dir"),
        (["--log-writes", "pwrite"], "--log-writes needs --data-dir"),
        (["--data-dir", "d", "--log-writes", "mmap"], "invalid choice: 'mmap'"),
        (["--data-dir", "d", "--fsync", "sometimes"], "invalid choice: 'sometimes'"),
        (["--data-dir", "d", "--log-segment-size", "1KiB"], "1024 bytes is below 65536"),
        (["--data-dir", str(tmp_path / "file")], "is not a directory"),
    ]:
        done = run(*args)
        assert done.returncode != 0, args
        assert expected in done.stderr, (args, done.stderr)
        assert done.stderr.count("\n") == 1, done.stderr


def test_a_directory_from_a_newer_format_is_refused(tmp_path: Path) -> None:
    (tmp_path / "FORMAT").write_text("pinpriq log format 7\n")
    done = run("--data-dir", str(tmp_path))
    assert done.returncode == 1
    assert done.stderr == (
        f"pinpriq-server: data directory {tmp_path} was written by a newer pinpriq (log format "
        "7); this one reads format 2: upgrade pinpriq\n"
    )


def test_a_second_server_on_one_directory_is_refused(tmp_path: Path) -> None:
    server = Server("--data-dir", str(tmp_path))
    done = run("--data-dir", str(tmp_path))
    assert done.returncode == 1
    assert done.stderr == (
        f"pinpriq-server: data directory {tmp_path} is in use by another pinpriq-server\n"
    )
    server.stop()


def can_mount() -> bool:
    return os.geteuid() == 0 and sys.platform == "linux"


needs_mount = pytest.mark.skipif(
    not can_mount() and not os.environ.get("CI"),
    reason="mounting a tmpfs needs root on Linux (CI has it, and there this never skips)",
)


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """A directory this process cannot write to: a read-only tmpfs for root (whom file
    modes do not stop), the mode bits for anyone else."""
    if os.geteuid() != 0:
        path.mkdir()
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    with tmpfs(path, "ro,size=1m") as mounted:
        yield mounted


@needs_mount
def test_a_read_only_directory_is_one_line(tmp_path: Path) -> None:
    with read_only(tmp_path / "ro") as path:
        done = run("--data-dir", str(path))
    assert done.returncode == 1
    assert re.fullmatch(
        rf"pinpriq-server: cannot write to data directory {path}: "
        r"(Read-only file system|Permission denied)\n",
        done.stderr,
    ), done.stderr


def first_segment_with_blocks(data: Path) -> tuple[Path, list[int]]:
    for segment in sorted(data.glob("*.log")):
        content = segment.read_bytes()
        starts, offset = [], SEGMENT_HEADER_SIZE
        while (block := read_block(content, offset)) is not None:
            starts.append(offset)
            offset = block.end
        if starts:
            return segment, starts
    raise AssertionError("no blocks")


def test_check_log_and_truncating_at_damage(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = Server("--data-dir", str(data))
    with server.client() as client:
        for i in range(3):
            client.push("q", f"k{i}", f"v{i}", confirm=True)  # one block each
    server.stop()
    done = run("--data-dir", str(data), "--check-log")
    assert done.returncode == 0, done.stderr
    assert "a start recovers 3 packets in 1 queues" in done.stdout
    assert done.stdout.endswith("OK: a start recovers the packets above\n")

    segment, starts = first_segment_with_blocks(data)
    with open(segment, "r+b") as file:  # flip a bit in the middle block
        file.seek(starts[1] + 20)
        byte = file.read(1)[0]
        file.seek(starts[1] + 20)
        file.write(bytes([byte ^ 1]))
    done = run("--data-dir", str(data), "--check-log")
    assert done.returncode == 1
    assert f"DAMAGED: {segment} at offset {starts[1]}: checksum mismatch" in done.stdout
    assert "a start recovers 1 packets" in done.stdout  # what --truncate-damaged-log keeps

    done = run("--data-dir", str(data))
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1
    assert f"damaged log: {segment} at offset {starts[1]}: checksum mismatch" in done.stderr

    server = Server("--data-dir", str(data), "--truncate-damaged-log")
    assert "--truncate-damaged-log: cutting the log" in server.text()
    with server.client() as client:
        assert drain(client, "q") == [[(b"k0", b"v0")]]
    server.stop()
    assert run("--data-dir", str(data), "--check-log").returncode == 0


def test_check_log_of_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    done = run("--data-dir", str(tmp_path / "none"), "--check-log")
    assert done.returncode == 1
    assert done.stderr == (
        f"pinpriq-server: data directory {tmp_path / 'none'} does not exist or is not a directory\n"
    )


@needs_mount
def test_a_full_disk_stops_pushes_keeps_pops_and_loses_nothing(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "size=3m") as data:
        server = Server("--data-dir", str(data), "--log-segment-size", "256KiB")
        confirmed = []
        with server.client() as producer:
            producer.timeout = 2.0
            for i in range(10_000):  # fill the disk until a push is not confirmed
                try:
                    producer.push("q", f"{i:05d}", bytes(1000), confirm=True)
                except PinpriqTimeoutError:
                    unconfirmed = f"{i:05d}".encode()  # read, waiting for room: applied later
                    break
                confirmed.append(f"{i:05d}".encode())
            else:
                raise AssertionError("the disk never filled")
        assert "disk is full" in server.text()
        with server.client() as consumer:  # pops go on, in the reserved segment
            popped = [p.key for packets in iter(lambda: consumer.pop("q"), []) for p in packets]
        assert set(confirmed) <= set(popped)
        with server.client() as producer:  # space again: pushes resume
            producer.push("q", "after", "a", confirm=True)
        server.stop()
        server = Server("--data-dir", str(data), "--log-segment-size", "256KiB")
        with server.client() as client:
            keys = [p[0] for reply in drain(client, "q") for p in reply]
        # The unconfirmed push and "after" both waited for room: either may have gone first.
        assert sorted(keys) in ([b"after"], sorted([b"after", unconfirmed]))
        server.stop()


def test_after_a_kill_leased_jobs_are_back_acked_ones_gone_and_dead_letters_kept(
    tmp_path: Path,
) -> None:
    """Decision 19 across a kill -9: a reserve is not logged, an ack is, a dead-letter move is."""
    data = str(tmp_path / "data")
    server = Server("--data-dir", data, "--fsync", "always", "--max-deliveries", "1")
    with server.client() as client:
        for key in ("acked", "leased", "poison"):
            client.push("jobs", key, key, prio=1)
        poison = client.reserve("jobs")  # newest first
        assert poison.packets[0].key == b"poison"
        assert poison.release()  # its only attempt (--max-deliveries 1): on to jobs.dead
        leased = client.reserve("jobs")
        assert leased.packets[0].key == b"leased"  # held when the server dies
        acked = client.reserve("jobs")
        assert acked.packets[0].key == b"acked"
        assert acked.ack()  # answered: with --fsync always, on disk
        server.process.kill()
        server.process.wait(timeout=30)
    server.log.unlink()
    server = Server("--data-dir", data)
    with server.client() as client:
        assert drain(client, "jobs.dead") == [[(b"poison", b"poison")]]
        assert drain(client, "jobs") == [[(b"leased", b"leased")]]
    server.stop()


ADMIN = re.compile(r"admin listener \(dashboard, /metrics, /stats\) on http://([\d.]+:\d+)/")


@pytest.mark.parametrize("policy", ["always", "everysec", "no"])
def test_an_admin_purge_is_in_the_log_before_its_answer(tmp_path: Path, policy: str) -> None:
    """Purged packets stay gone across a kill -9 that follows the purge's 200 at once, with no
    traffic on the data port to seal the purge's removals (they were in no block before)."""
    data = str(tmp_path / "data")
    server = Server("--data-dir", data, "--fsync", policy, "--http-port", "0")
    match = ADMIN.search(server.text())
    assert match is not None, server.text()
    with server.client() as client:
        for i in range(5):
            client.push("doomed", f"{i}", "x")
        client.push("kept", "k", "v", confirm=True)
    request = urllib.request.Request(
        f"http://{match.group(1)}/queues/doomed/purge",
        method="POST",
        headers={"X-Pinpriq-Action": "1"},  # what a script sends (no cross-site form can)
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert json.load(answer) == {"queue": "doomed", "purged": 5}
    server.process.kill()
    server.process.wait(timeout=30)
    server.log.unlink()
    server = Server("--data-dir", data)
    with server.client() as client:
        assert drain(client, "doomed") == []
        assert drain(client, "kept") == [[(b"k", b"v")]]
    server.stop()


def admin_url(server: Server) -> str:
    match = ADMIN.search(server.text())
    assert match is not None, server.text()
    return f"http://{match.group(1)}"


def admin_json(url: str, method: str = "GET") -> dict[str, object]:
    request = urllib.request.Request(url, method=method, headers={"X-Pinpriq-Action": "1"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        result: dict[str, object] = json.load(answer)
        return result


def delayed_of(server: Server, queue: str) -> object:
    return admin_json(f"{admin_url(server)}/queues/{queue}")["delayed"]


@pytest.mark.parametrize("policy", ["always", "everysec"])
def test_delayed_packets_survive_a_kill_still_delayed(tmp_path: Path, policy: str) -> None:
    """Decision 21 across a kill -9: a delayed push confirmed by a sync is logged with its due
    time and TTL deadline on the wall clock; one due while the server was down arrives at
    once, and one whose TTL deadline passed too is gone (TTL wins)."""
    data = str(tmp_path / "data")
    server = Server("--data-dir", data, "--fsync", policy)
    frames = [
        DelayedPush(b"q", b"later", b"1", 0, 1, 3_600_000),  # still an hour to wait
        DelayedPush(b"q", b"soon", b"2", 60_000, 1, 100),  # due while the server is down
        DelayedPush(b"q", b"gone", b"3", 100, 1, 100),  # and dead at +200 ms, while down
    ]
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as peer:
        peer.sendall(b"".join(map(encode, [*frames, Sync()])))
        assert peer.recv(2, socket.MSG_WAITALL) == b"\x00\x00"  # confirmed: in the log
    server.process.kill()
    server.process.wait(timeout=30)
    server.log.unlink()
    time.sleep(0.3)  # the server stays down past "soon"'s due time and "gone"'s deadline
    server = Server("--data-dir", data, "--http-port", "0")
    assert delayed_of(server, "q") == 1
    with server.client() as client:
        assert drain(client, "q") == [[(b"soon", b"2")]]
    server.stop()


def test_an_admin_move_is_in_the_log_before_its_answer(tmp_path: Path) -> None:
    """Decision 22 across a kill -9 right after the move's 200: the packets are in the target
    queue, as pushes made then (newer than what it held), and not in the source."""
    data = str(tmp_path / "data")
    server = Server("--data-dir", data, "--fsync", "always", "--http-port", "0")
    with server.client() as client:
        client.push("jobs.dead", "a", "1")
        client.push("jobs.dead", "b", "2")
        client.push("jobs", "old", "0", confirm=True)
    answer = admin_json(f"{admin_url(server)}/queues/jobs.dead/move?to=jobs", method="POST")
    assert answer == {"queue": "jobs.dead", "to": "jobs", "moved": 2}
    server.process.kill()
    server.process.wait(timeout=30)
    server.log.unlink()
    server = Server("--data-dir", data)
    with server.client() as client:
        assert drain(client, "jobs.dead") == []
        assert drain(client, "jobs") == [[(b"b", b"2")], [(b"a", b"1")], [(b"old", b"0")]]
    server.stop()


def test_check_log_fails_while_a_server_holds_the_directory(tmp_path: Path) -> None:
    server = Server("--data-dir", str(tmp_path))
    done = run("--data-dir", str(tmp_path), "--check-log")
    server.stop()
    assert done.returncode == 1
    assert done.stdout.splitlines()[-1] == (
        f"A start refuses: data directory {tmp_path} is in use by another pinpriq-server"
    )
    assert run("--data-dir", str(tmp_path), "--check-log").returncode == 0  # once it stopped


@needs_mount
def test_check_log_fails_on_a_read_only_file_system(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "fs", "size=4m") as data:
        server = Server("--data-dir", str(data), "--log-segment-size", "64KiB")
        with server.client() as client:
            client.push("q", "k", "v", confirm=True)
        server.stop()
        assert run("--data-dir", str(data), "--check-log").returncode == 0
        subprocess.run(["mount", "-o", "remount,ro", str(data)], check=True)
        done = run("--data-dir", str(data), "--check-log")
        started = run("--data-dir", str(data))
    assert done.returncode == 1
    assert "a start recovers 1 packets" in done.stdout  # what it holds, still reported
    refusal = f"cannot write to data directory {data}: Read-only file system"
    assert done.stdout.splitlines()[-1] == f"A start refuses: {refusal}"
    assert (started.returncode, started.stderr) == (1, f"pinpriq-server: {refusal}\n")


@needs_mount
def test_no_room_for_the_first_segment_is_the_data_directorys_problem(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "size=256k") as data:
        done = run("--data-dir", str(data), "--log-segment-size", "1MiB")
    assert done.returncode == 1
    assert done.stderr == (
        f"pinpriq-server: cannot write to data directory {data}: No space left on device\n"
    )
