"""The Trio server with a log (``server.py`` with ``LoggedStore``, ``persistence/keeper.py``):
the ordering rule (no reply or delivery before its records are stored as the policy promises),
group commit, fsyncs off the event loop, the disk-full reserve, and the recovering state."""

from __future__ import annotations

import errno
import gc
import os
import select
import threading
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import cast

import pytest
import trio

from pinpriq import server as server_module
from pinpriq.admin import serve_admin
from pinpriq.persistence import keeper as keeper_module
from pinpriq.persistence.journal import MIN_SEGMENT_SIZE, FsyncPolicy, Hold, Journal
from pinpriq.persistence.keeper import Keeper, LogFailure
from pinpriq.persistence.records import Entries, decode_entries, read_block
from pinpriq.persistence.segments import SEGMENT_HEADER_SIZE, DataDir
from pinpriq.persistence.store import LoggedStore
from pinpriq.server import PinpriqServer
from tests.conftest import LiveServer
from tests.logtools import FakeClock, commit, open_store
from tests.rawpeer import READY, Peer, pop, push, subscribe
from tests.test_admin import ACTION, Admin
from tests.test_limits import server_side

SYNC = b"\x21"


class Running:
    """An in-process server on a data directory, which a test can stop and start again."""

    def __init__(self, nursery: trio.Nursery, path: Path) -> None:
        self.nursery = nursery
        self.path = path
        self.peers: list[Peer] = []
        self.server: PinpriqServer
        self.port = 0
        self._done = trio.Event()

    async def start(
        self,
        policy: FsyncPolicy = FsyncPolicy.EVERYSEC,
        segment_size: int = MIN_SEGMENT_SIZE,
        store_class: type[LoggedStore] = LoggedStore,
        mapped: bool | None = None,
    ) -> None:
        data_dir = DataDir.open(self.path, write=True)
        journal = Journal(data_dir, policy=policy, segment_size=segment_size, mapped=mapped)
        self.server = PinpriqServer(store_class(trio.current_time, journal))
        self._done = trio.Event()
        done = self._done

        async def serve(task_status: trio.TaskStatus[list[trio.SocketListener]]) -> None:
            try:
                await self.server.serve(0, host="127.0.0.1", task_status=task_status)
            finally:
                done.set()

        listeners = await self.nursery.start(serve)
        self.port = listeners[0].socket.getsockname()[1]

    async def connect(self) -> Peer:
        peer = Peer(await trio.open_tcp_stream("127.0.0.1", self.port))
        self.peers.append(peer)
        return peer

    async def stop(self) -> None:
        for peer in self.peers:
            await trio.aclose_forcefully(peer.stream)
        self.peers.clear()
        self.server.shutdown()
        await self._done.wait()

    @property
    def journal(self) -> Journal:
        assert self.server.journal is not None
        return self.server.journal


@pytest.fixture
async def running(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[Running]:
    run = Running(nursery, tmp_path / "data")
    yield run
    if not run._done.is_set() and run.port:
        await run.stop()


class Gate:
    """Stands in for ``os.fdatasync``: each call blocks its worker thread until opened."""

    def __init__(self, real: Callable[[int], None]) -> None:
        self.real = real
        self.opened = threading.Event()
        self.calls = 0

    def __call__(self, fd: int) -> None:
        self.calls += 1
        self.opened.wait(30)
        self.real(fd)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gate]:
    gate = Gate(os.fdatasync)
    monkeypatch.setattr(os, "fdatasync", gate)
    yield gate
    gate.opened.set()  # never leave a worker thread blocked


async def eventually(predicate: Callable[[], bool], seconds: float = 5.0) -> None:
    """Wait until ``predicate()`` holds (something a worker thread or the keeper does)."""
    for _ in range(int(seconds / 0.01)):
        if predicate():
            return
        await trio.sleep(0.01)
    raise AssertionError(f"still not true after {seconds} s")


def wait_readable(fds: list[int]) -> None:
    """Block until every one of ``fds`` has something to read (what a peer sent has reached
    the server's socket: loopback may hand it over in a kernel thread)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    for _ in range(1000):
        if len(poller.poll(10)) == len(fds):
            return
    raise AssertionError("the peers' requests did not arrive")


def logged_entries(path: Path) -> list[Entries]:
    """The entries of every block in the segment files: what the log holds now."""
    blocks = []
    for segment in sorted(path.glob("*.log")):
        data = segment.read_bytes()
        offset = SEGMENT_HEADER_SIZE
        while (block := read_block(data, offset)) is not None:
            blocks.append(decode_entries(data, block))
            offset = block.end
    return blocks


def logged_removals(path: Path) -> list[int]:
    """The seqs of every remove entry in the segment files."""
    return [seq for entries in logged_entries(path) for seq in entries.removed]


async def test_confirmed_pushes_survive_a_restart(running: Running) -> None:
    await running.start()
    peer = await running.connect()
    await peer.send(push(b"q", b"a", b"1", prio=2) + push(b"q", b"b", b"2", prio=1))
    assert await peer.request(SYNC) == []
    await running.stop()
    await running.start()
    peer = await running.connect()
    assert await peer.request(pop(b"q")) == [(b"b", b"2")]
    assert await peer.request(pop(b"q")) == [(b"a", b"1")]


async def test_a_pop_reply_is_sent_only_once_its_removal_is_in_the_log(
    running: Running,
) -> None:
    await running.start()
    peer = await running.connect()
    await peer.send(push(b"q", b"k", b"v"))
    assert await peer.request(SYNC) == []
    assert logged_removals(running.path) == []
    assert await peer.request(pop(b"q")) == [(b"k", b"v")]
    assert logged_removals(running.path) == [1]


async def test_a_delivery_is_sent_only_once_its_removal_is_in_the_log(running: Running) -> None:
    await running.start()
    subscriber, pusher = await running.connect(), await running.connect()
    await subscriber.send(subscribe(b"q") + READY)
    assert await subscriber.request(SYNC) == []
    await pusher.send(push(b"q", b"k", b"v"))
    assert await subscriber.reply() == [(b"k", b"v")]
    assert logged_removals(running.path) == [1]


async def test_always_waits_for_the_fsync_and_commits_many_batches_in_one(
    running: Running, gate: Gate
) -> None:
    await running.start(FsyncPolicy.ALWAYS)
    peers = [await running.connect() for _ in range(10)]
    await peers[0].send(push(b"q", b"first", b"") + SYNC)
    await eventually(lambda: gate.calls > 0)  # the first batch's fsync is under way, and held
    for i, peer in enumerate(peers[1:]):
        await peer.send(push(b"q", b"%d" % i, b"") + SYNC)
    await trio.sleep(0.2)  # the event loop serves every connection meanwhile
    assert len(running.server.broker.store) == 10
    for peer in peers:
        await peer.expect_silence(0.01)  # but no reply goes out before its fsync
    gate.opened.set()
    with trio.fail_after(5):
        for peer in peers:
            assert await peer.reply() == []
    assert running.journal.fsyncs <= 3, "one fsync per batch: no group commit"


async def test_always_holds_deliveries_until_the_fsync(running: Running, gate: Gate) -> None:
    await running.start(FsyncPolicy.ALWAYS)
    subscriber, pusher = await running.connect(), await running.connect()
    gate.opened.set()
    await subscriber.send(subscribe(b"q") + READY)
    assert await subscriber.request(SYNC) == []
    gate.opened.clear()
    await pusher.send(push(b"q", b"k", b"v"))
    await subscriber.expect_silence(0.2)
    gate.opened.set()
    with trio.fail_after(5):
        assert await subscriber.reply() == [(b"k", b"v")]


async def test_everysec_replies_do_not_wait_for_fsyncs(running: Running, gate: Gate) -> None:
    await running.start(FsyncPolicy.EVERYSEC)
    peer = await running.connect()
    with trio.fail_after(5):
        for i in range(3):  # across a second: an fsync starts, and blocks
            await peer.send(push(b"q", b"%d" % i, b""))
            assert await peer.request(SYNC) == []
            assert await peer.request(pop(b"q")) == [(b"%d" % i, b"")]
            await trio.sleep(0.6)
    assert gate.calls >= 1
    gate.opened.set()


async def test_everysec_replies_go_straight_to_the_socket_once_written(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under everysec a batch's replies go out from the read loop, as without a log, once
    ``after_batch`` has written the batch's block: not through the connection's writer task,
    a task switch and a second seal per request at -P 1 (issue 21)."""
    sends: list[object] = []
    real = server_module._Connection._send_output

    async def counted(self: object) -> None:
        sends.append(self)
        await real(self)  # type: ignore[arg-type]

    monkeypatch.setattr(server_module._Connection, "_send_output", counted)
    await running.start(FsyncPolicy.EVERYSEC)
    peer = await running.connect()
    with trio.fail_after(5):
        for i in range(5):
            await peer.send(push(b"q", b"%d" % i, b"v"))
            assert await peer.request(SYNC) == []
            assert await peer.request(pop(b"q")) == [(b"%d" % i, b"v")]
    assert sends == []


async def test_a_batch_served_by_its_own_task_is_written_right_after_it(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame split across reads is finished by the connection's own task, outside any
    reactor turn: ``_serve_now`` must still have ``after_batch`` write the batch's block
    before the sync reply confirms the push, and the reply then goes straight to the
    socket."""
    sends: list[object] = []
    real = server_module._Connection._send_output

    async def counted(self: object) -> None:
        sends.append(self)
        await real(self)  # type: ignore[arg-type]

    monkeypatch.setattr(server_module._Connection, "_send_output", counted)
    await running.start(FsyncPolicy.EVERYSEC)
    peer = await running.connect()
    request = push(b"q", b"k", b"v") + SYNC
    await peer.send(request[:5])
    conn = server_side(running.server, peer)
    await eventually(lambda: conn.decoder.pending == 5)
    await peer.send(request[5:])
    with trio.fail_after(5):
        assert await peer.reply() == []
    assert [len(entries.pushes) for entries in logged_entries(running.path)] == [1]
    assert sends == []


async def test_a_full_disk_stops_pushes_and_keeps_pops_going(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reserve: no new segment can be made, so pushes wait (as at the memory cap), while
    the segment just rotated into takes the pops' removals."""
    full = threading.Event()
    real_create = keeper_module.create_segment

    def create(path: Path, size: int) -> int:
        if full.is_set():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_create(path, size)

    monkeypatch.setattr(keeper_module, "create_segment", create)
    await running.start(segment_size=MIN_SEGMENT_SIZE)
    producer, consumer = await running.connect(), await running.connect()
    await eventually(lambda: running.journal.spare is not None)  # made at start, before...
    full.set()  # ...the disk fills
    with trio.fail_after(5):
        while len(running.journal.segments) < 2:  # rotate into the spare...
            await producer.send(push(b"q", b"%d" % len(running.server.broker.store), bytes(4000)))
            assert await producer.request(SYNC) == []
    await eventually(lambda: running.server.broker.disk_full)  # ...and fail to make another
    held = len(running.server.broker.store)
    await producer.send(push(b"q", b"waits", b"") + SYNC)
    await producer.expect_silence(0.2)
    assert len(running.server.broker.store) == held, "a push went in while the disk was full"
    with trio.fail_after(5):
        for _ in range(held):
            assert len(await consumer.request(pop(b"q"))) == 1
    full.clear()  # space again: the keeper makes a spare at its next try, and pushes resume
    with trio.fail_after(5):
        assert await producer.reply() == []
    assert not running.server.broker.disk_full
    assert await consumer.request(pop(b"q")) == [(b"waits", b"")]


async def test_a_move_answers_503_while_the_disk_is_full(
    running: Running, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decision 22: a move logs its packets again, as pushes, which wait for disk space; the
    operator gets a 503 at once instead, and nothing moves. Once there is space, it moves."""
    full = threading.Event()
    real_create = keeper_module.create_segment

    def create(path: Path, size: int) -> int:
        if full.is_set():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_create(path, size)

    monkeypatch.setattr(keeper_module, "create_segment", create)
    await running.start(segment_size=MIN_SEGMENT_SIZE)
    (listener,) = await nursery.start(partial(serve_admin, running.server, 0))
    admin = Admin(cast(LiveServer, None), listener.socket.getsockname()[1])
    producer = await running.connect()
    await eventually(lambda: running.journal.spare is not None)
    await producer.send(push(b"jobs.dead", b"dead", b"") + SYNC)
    assert await producer.reply() == []
    full.set()
    with trio.fail_after(5):
        while len(running.journal.segments) < 2:  # rotate into the spare, and make no other
            await producer.send(push(b"q", b"%d" % len(running.server.broker.store), bytes(4000)))
            assert await producer.request(SYNC) == []
    await eventually(lambda: running.server.broker.disk_full)
    move = "/queues/jobs.dead/move?to=jobs"
    status, _, body = await admin.request("POST", move, ACTION)
    assert (status, b"disk is full" in body) == (503, True)
    assert running.server.broker.store.queue_info(b"jobs.dead").packets == 1
    full.clear()
    await eventually(lambda: not running.server.broker.disk_full)
    assert await admin.json(move, "POST", **ACTION) == {
        "queue": "jobs.dead",
        "to": "jobs",
        "moved": 1,
    }


async def test_when_even_the_reserve_is_full_pops_wait_too(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write meets ENOSPC (a file system without space reservation, whose segments are
    written with pwrite, not mapped): nothing goes out, pops' replies included, until the
    write succeeds; then in order, nothing lost."""
    full = threading.Event()
    real_pwrite = os.pwrite

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if full.is_set():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    await running.start(mapped=False)
    peer = await running.connect()
    await peer.send(push(b"q", b"a", b"1") + push(b"q", b"b", b"2"))
    assert await peer.request(SYNC) == []
    full.set()
    await peer.send(pop(b"q"))
    await peer.expect_silence(0.3)
    assert running.server.broker.disk_full
    full.clear()
    with trio.fail_after(5):
        assert await peer.reply() == [(b"b", b"2")]
    await running.stop()
    await running.start()
    peer = await running.connect()
    assert await peer.request(pop(b"q")) == [(b"a", b"1")]
    assert await peer.request(pop(b"q")) == []


async def test_recovering_is_visible_while_the_log_is_read(running: Running) -> None:
    reading = threading.Event()
    proceed = threading.Event()

    class SlowRecovery(LoggedStore):
        def recover(self, now: float, now_ms: int) -> None:
            reading.set()
            proceed.wait(10)
            super().recover(now, now_ms)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(running.start, store_class=SlowRecovery))
        await eventually(reading.is_set)
        assert running.server.recovering  # the event loop runs: an admin listener could say so
        proceed.set()
    assert not running.server.recovering
    assert running.journal.stats().recovery_seconds > 0


async def push_and_see_the_server_stop(
    journal: Journal, before_push: Callable[[PinpriqServer], object] = lambda server: None
) -> None:
    """Serve ``journal``'s log, push and sync: the log fails (``LogFailure`` stops the server),
    and the connection closes with no reply sent."""
    server = PinpriqServer(LoggedStore(trio.current_time, journal))

    async def serve_and_push() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(server.serve, 0)
            port = listeners[0].socket.getsockname()[1]
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                peer = Peer(stream)
                before_push(server)
                await peer.send(push(b"q", b"k", b"v") + SYNC)
                with pytest.raises(EOFError):
                    await peer.reply()

    with trio.fail_after(10), pytest.raises(ExceptionGroup) as caught:
        await serve_and_push()
    assert caught.group_contains(LogFailure, depth=2)


async def test_a_failed_write_stops_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO from a write: nothing more can be promised, so the server stops (LogFailure, which
    pinpriq-server turns into one line and exit status 1), and no reply goes out first."""
    failing = threading.Event()
    real_pwrite = os.pwrite

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if failing.is_set():
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    journal = Journal(DataDir.open(tmp_path, write=True), mapped=False)
    await push_and_see_the_server_stop(journal, lambda server: failing.set())
    assert "Input/output error" in str(journal.failure)
    DataDir.open(tmp_path, write=True).close()  # the directory was released


async def test_a_failed_inline_fsync_at_a_turns_end_stops_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under always with fsyncs inline, the reactor's turn fsyncs its block itself
    (``Keeper.commit``): EIO there fails the journal, the keeper stops the server with
    ``LogFailure`` as after a failed fsync in the thread, and the turn's reply never goes out."""
    failing = threading.Event()
    real_fdatasync = os.fdatasync

    def fdatasync(fd: int) -> None:
        if failing.is_set():
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fdatasync(fd)

    def go_inline_and_fail(server: PinpriqServer) -> None:
        assert server.keeper is not None
        server.keeper.inline = True
        failing.set()

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    journal = Journal(DataDir.open(tmp_path, write=True), policy=FsyncPolicy.ALWAYS)
    await push_and_see_the_server_stop(journal, go_inline_and_fail)
    assert (
        journal.failure == f"fsync of the log failed: {OSError(errno.EIO, os.strerror(errno.EIO))}"
    )
    assert journal.hold is Hold.FAILED


async def test_the_admin_listener_says_recovering_then_shows_the_log(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """/readyz and every data path answer 503 while the log is read back (the store is being
    filled in a worker thread); then /stats and /metrics show the log's figures."""
    first = Running(nursery, tmp_path / "data")
    await first.start()
    peer = await first.connect()
    await peer.send(push(b"q", b"k", b"v") + SYNC)
    assert await peer.receive_exactly(2) == b"\x00\x00"
    await first.stop()

    proceed = threading.Event()

    class SlowRecovery(LoggedStore):
        def recover(self, now: float, now_ms: int) -> None:
            proceed.wait(10)
            super().recover(now, now_ms)

    journal = Journal(DataDir.open(tmp_path / "data", write=True), policy=FsyncPolicy.EVERYSEC)
    server = PinpriqServer(SlowRecovery(trio.current_time, journal))
    (listener,) = await nursery.start(partial(serve_admin, server, 0))
    admin = Admin(cast(LiveServer, None), listener.socket.getsockname()[1])
    assert (await admin.request("GET", "/readyz"))[0] == 503
    status, _, body = await admin.request("GET", "/stats")
    assert (status, b"reading the log back" in body) == (503, True)
    assert (await admin.request("GET", "/healthz"))[0] == 200
    serving = trio.Event()

    async def serve() -> None:
        await server.serve(0, host="127.0.0.1")
        serving.set()

    nursery.start_soon(serve)
    proceed.set()
    await eventually(lambda: server.ready)
    stats = await admin.json("/stats")
    assert stats["packets"] == 1
    assert stats["log"]["segments"] >= 1
    assert stats["log"]["live_packets"] == 1
    assert stats["log"]["recovering"] is False
    samples = await admin.metrics()
    assert samples["pinpriq_log_live_packets"][()] == 1
    assert samples["pinpriq_log_recovering"][()] == 0
    assert samples["pinpriq_log_written_bytes_total"][()] >= 0
    server.shutdown()
    await serving.wait()


async def test_a_failed_read_by_compaction_stops_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO while compaction reads an old segment (inside the seal of a connection's batch) is
    the log failing, not that connection's bug: the server stops, and no reply goes out."""
    store = open_store(tmp_path, FakeClock(), segment_size=MIN_SEGMENT_SIZE)
    store.journal.compactor = None  # dead segments pile up behind a pinned packet
    store.push(b"keep", b"pinned", b"x", 0, 255)
    for _ in range(6):
        for i in range(30):
            store.push(b"q", b"%d" % i, bytes(2000), 0, 1)
        commit(store)
        while store.pop(b"q"):
            pass
        commit(store)
    store.close()

    def pread(fd: int, length: int, offset: int) -> bytes:  # only compaction reads so
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "pread", pread)
    journal = Journal(DataDir.open(tmp_path, write=True), segment_size=MIN_SEGMENT_SIZE)
    await push_and_see_the_server_stop(journal)
    assert journal.failure is not None
    assert "compaction's read of" in journal.failure
    assert "Input/output error" in journal.failure


def test_a_spare_that_cannot_be_made_for_want_of_space_waits_any_other_error_fails(
    tmp_path: Path,
) -> None:
    store = open_store(tmp_path, FakeClock())
    journal = store.journal
    journal.spare_failed(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert journal.disk_full  # pushes wait; the keeper tries again
    assert journal.hold is None
    journal.spare_failed(OSError(errno.EIO, os.strerror(errno.EIO)))
    assert journal.hold is Hold.FAILED
    assert journal.failure is not None
    assert "Input/output error" in journal.failure
    store.close()


def keeper_store(path: Path) -> LoggedStore:
    """A log-backed store under ``always``, recovered (empty) as a server has it at start."""
    journal = Journal(DataDir.open(path, write=True), policy=FsyncPolicy.ALWAYS)
    store = LoggedStore(trio.current_time, journal)
    store.recover(trio.current_time(), 0)
    return store


async def test_always_syncs_a_lone_clients_batches_at_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Group commit waits for no timer: each batch of a lone client is fsynced as soon as it is
    written, back to back. Under the autojump clock any sleep would move trio's clock."""
    store = keeper_store(tmp_path)
    keeper = Keeper(store.journal)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keeper.run)
            for i in range(10):
                store.push(b"q", b"%d" % i, b"", 0, 1)
                store.flush()
                await keeper.wait_released()
            nursery.cancel_scope.cancel()
    finally:
        store.close()
    assert store.journal.fsyncs >= 10
    assert trio.current_time() == 0.0, "the keeper slept before an fsync"


class TimedFsync:
    """Stands in for ``os.fdatasync``: each call takes the next of ``seconds`` on a fake clock
    and records whether it ran in the event loop's thread."""

    def __init__(self, seconds: list[float]) -> None:
        self.seconds = seconds
        self.now = 0.0
        self.inline: list[bool] = []

    def clock(self) -> float:
        return self.now

    def __call__(self, fd: int) -> None:
        self.inline.append(threading.current_thread() is threading.main_thread())
        self.now += self.seconds[min(len(self.inline), len(self.seconds)) - 1]


async def test_always_fsyncs_inline_on_a_fast_disk_and_in_a_thread_after_a_slow_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the worker thread first; inline once ``FAST_FSYNCS`` in a row were fast; back to the
    thread after one slow inline fsync, so a slow disk stalls the event loop once at most."""
    fast, slow, runs = keeper_module.INLINE_FSYNC_SECONDS / 2, 0.05, keeper_module.FAST_FSYNCS
    timed = TimedFsync([fast] * runs + [fast, slow] + [fast] * (runs + 1))
    store = keeper_store(tmp_path)
    keeper = Keeper(store.journal, clock=timed.clock)
    monkeypatch.setattr(os, "fdatasync", timed)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keeper.run)
            with trio.fail_after(10):
                for i in range(2 * runs + 3):
                    store.push(b"q", b"%d" % i, b"", 0, 1)
                    store.flush()
                    await keeper.wait_released()
            nursery.cancel_scope.cancel()
    finally:
        monkeypatch.undo()
        store.close()
    thread, inline = [False], [True]
    assert timed.inline[: 2 * runs + 3] == (thread * runs + inline * 2 + thread * runs + inline), (
        "inline after the fast ones, back to the thread after the slow one, inline again"
    )


async def test_the_garbage_collector_pauses_while_the_log_is_read(running: Running) -> None:
    """Recovery's millions of long-lived objects are no work for the cyclic collector: it is
    paused while the log is read, and runs again after (the recovered packets frozen)."""
    collecting: list[bool] = []

    class WatchedRecovery(LoggedStore):
        def recover(self, now: float, now_ms: int) -> None:
            collecting.append(gc.isenabled())
            super().recover(now, now_ms)

    await running.start(store_class=WatchedRecovery)
    assert collecting == [False]
    assert gc.isenabled()


@pytest.mark.parametrize("policy", [FsyncPolicy.EVERYSEC, FsyncPolicy.ALWAYS])
async def test_a_reactor_turn_writes_one_block_then_its_replies_with_no_task_switch(
    running: Running, monkeypatch: pytest.MonkeyPatch, policy: FsyncPolicy
) -> None:
    """The connections the reactor serves in one turn log into one block, sealed and written
    once at the turn's end; under always (fsyncs inline: a fast disk) it is fsynced there too;
    only then are the turn's replies and deliveries written, by the reactor's task itself
    (issue 21). Order is observed through the log's system calls, not timed: so with
    ``pwrite``, not a mapped segment (whose copies the next test watches)."""
    await running.start(policy, mapped=False)
    subscriber = await running.connect()
    await subscriber.send(subscribe(b"d") + READY)
    peers = [await running.connect() for _ in range(5)]
    for peer in [subscriber, *peers]:
        assert await peer.request(SYNC) == []  # served: each now waits in the reactor
    await eventually(lambda: running.journal.spare is not None)  # no segment made meanwhile
    keeper = running.server.keeper
    assert keeper is not None
    if policy is FsyncPolicy.ALWAYS:
        monkeypatch.setattr(keeper_module, "INLINE_FSYNC_SECONDS", float("inf"))
        keeper.inline = True  # as after FAST_FSYNCS fast ones
    ports = {f"127.0.0.1:{peer.local_port}" for peer in peers[1:]}
    others = [c.fileno for c in running.server._connections.values() if c.peer in ports]
    journal = running.journal
    blocks, fsyncs = journal.blocks_written, journal.fsyncs
    events: list[str] = []
    real_pwrite, real_fdatasync, real_write = os.pwrite, os.fdatasync, os.write

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        events.append("pwrite")
        if events.count("pwrite") == 1:  # in the first turn, the other peers' requests arrive
            for i, peer in enumerate(peers[1:]):
                real_write(peer.stream.socket.fileno(), push(b"q", b"%d" % i, b"") + SYNC)
            wait_readable(others)  # all in the server's sockets before the next turn
        return real_pwrite(fd, data, offset)

    def fdatasync(fd: int) -> None:
        if threading.current_thread() is threading.main_thread():
            events.append("fsync")  # inline (everysec's own fsyncs, in the thread, may come)
        real_fdatasync(fd)

    def write(fd: int, data: bytes | bytearray) -> int:
        task = trio.lowlevel.current_task().name
        events.append("reply by the reactor" if task.endswith("Reactor.run") else f"by {task}")
        return real_write(fd, data)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "write", write)
    with trio.fail_after(10):
        await peers[0].send(push(b"d", b"k", b"v") + SYNC)
        assert await subscriber.reply() == [(b"k", b"v")]
        for peer in peers:
            assert await peer.reply() == []
    monkeypatch.undo()
    commit = ["pwrite", "fsync"] if policy is FsyncPolicy.ALWAYS else ["pwrite"]
    replies = ["reply by the reactor"]
    assert events == commit + replies * 2 + commit + replies * 4, (
        "a turn's block written (and fsynced) once, then its replies, from the reactor's task"
    )
    assert journal.blocks_written == blocks + 2
    if policy is FsyncPolicy.ALWAYS:
        assert journal.fsyncs == fsyncs + 2


async def test_a_mapped_segment_holds_each_block_before_its_replies_go_out(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under everysec blocks are copied into a shared mapping of the active segment, no
    ``pwrite``: each reply is written to its socket only once the block it confirms is in
    the segment file, as a reader of the file (recovery after a kill -9) sees it."""
    await running.start(FsyncPolicy.EVERYSEC, segment_size=1 << 20)
    journal = running.journal
    active = journal.active
    assert active.mapping is not None
    assert active.fd is not None
    peer = await running.connect()
    assert await peer.request(SYNC) == []
    server_fds = {conn.fileno for conn in running.server._connections.values()}
    real_write, real_pwrite = os.write, os.pwrite
    pushed: list[bytes] = []
    in_file_at_reply: list[bool] = []

    def write(fd: int, data: bytes | bytearray) -> int:
        if fd in server_fds:
            with open(active.path, "rb") as segment_file:  # not the mapping: the file
                in_file_at_reply.append(pushed[-1] in segment_file.read())
        return real_write(fd, data)

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        # Only the active segment: the keeper may make a spare meanwhile, whose header
        # create_segment writes with pwrite in the worker thread.
        if fd == active.fd:
            raise AssertionError("a mapped segment is written with pwrite")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "pwrite", pwrite)
    with trio.fail_after(10):
        for i in range(20):
            pushed.append(b"key-%04d" % i)
            assert await peer.request(push(b"q", pushed[-1], b"v") + SYNC) == []
    monkeypatch.undo()
    assert journal.active is active, "the 20 blocks fit the one segment"
    assert in_file_at_reply == [True] * 20
    await running.stop()
    await running.start(FsyncPolicy.EVERYSEC, segment_size=1 << 20)
    peer = await running.connect()
    popped = [await peer.request(pop(b"q")) for _ in range(20)]
    assert sorted(key for ((key, _),) in popped) == pushed
