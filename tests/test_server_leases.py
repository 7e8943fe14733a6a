"""Leases over real TCP (decisions 13-18): the server's one timer ending leases, closes giving
them back, decision 18's refusals and malformed lease times closing a connection, and worker
processes killed mid-job while others finish every job exactly once.

Frames and expected bytes are built by hand (``tests.rawpeer``); lease times under
``mock_clock`` are virtual, so no test waits for them in real time.
"""

from __future__ import annotations

import collections
import logging
import signal
import subprocess
import sys

import pytest
import trio
import trio.testing

from pinpriq.server import PinpriqServer
from tests.conftest import LiveServer, StartServer
from tests.rawpeer import (
    READY,
    ack,
    lease_reply,
    leased_subscribe,
    pop,
    push,
    release,
    reserve,
    status,
    subscribe,
    touch,
)


async def test_a_lapsed_lease_goes_to_a_waiting_subscriber_with_no_frame_sent(
    live: LiveServer, mock_clock: trio.testing.MockClock
) -> None:
    worker, watcher = await live.connect(), await live.connect()
    await watcher.send(leased_subscribe(b"q", 60_000) + READY)
    await worker.send(push(b"other", b"k", b"v") + reserve(b"other", 1000))
    assert await worker.lease() == (1, 1, [(b"k", b"v")])
    await watcher.send(leased_subscribe(b"other", 60_000))
    await watcher.expect_silence(0.9)  # virtual seconds: the lease is still live
    assert await watcher.lease() == (1, 2, [(b"k", b"v")])  # at 1 s, by the timer alone
    await worker.send(ack(1))
    assert await worker.receive_exactly(11) == status(1, False)


async def test_the_default_lease_time_is_the_servers_lease_default(
    start_server: StartServer, mock_clock: trio.testing.MockClock
) -> None:
    live = await start_server(PinpriqServer(lease_default_ms=2000))
    worker = await live.connect()
    await worker.send(push(b"q", b"k", b"v") + reserve(b"q") + pop(b"q"))
    assert await worker.lease() == (1, 1, [(b"k", b"v")])
    assert await worker.reply() == []
    await trio.sleep(1.9)
    assert await worker.request(pop(b"q")) == []
    await trio.sleep(0.2)
    assert await worker.request(pop(b"q")) == [(b"k", b"v")]


async def test_closing_a_worker_gives_its_leases_to_a_waiting_subscriber_at_once(
    live: LiveServer,
) -> None:
    worker, watcher = await live.connect(), await live.connect()
    await worker.send(push(b"q", b"k", b"v") + reserve(b"q", 60_000))
    assert await worker.lease() == (1, 1, [(b"k", b"v")])
    await watcher.send(subscribe(b"q") + READY)
    await watcher.expect_silence()
    await worker.aclose()
    assert await watcher.reply() == [(b"k", b"v")]


async def test_release_delay_and_touch_over_tcp(
    live: LiveServer, mock_clock: trio.testing.MockClock
) -> None:
    worker = await live.connect()
    await worker.send(push(b"q", b"a", b"") + push(b"q", b"b", b"") + reserve(b"q", 1000))
    await worker.send(reserve(b"q", 1000) + release(1, 3000) + touch(2, 5000))
    assert (await worker.lease())[0] == 1
    assert (await worker.lease())[0] == 2
    assert await worker.receive_exactly(22) == status(1, True) + status(2, True)
    await trio.sleep(2.9)
    assert await worker.request(pop(b"q")) == []  # "b" (lease 1) waits out its delay
    await trio.sleep(0.2)
    assert await worker.request(pop(b"q")) == [(b"b", b"")]
    await trio.sleep(1.8)  # 4.9 s after the touch
    await worker.send(ack(2))
    assert await worker.receive_exactly(11) == status(2, True)


@pytest.mark.parametrize(
    ("opening", "offending", "reason"),
    [
        (leased_subscribe(b"q"), pop(b"q"), "a pop on a leased connection (decision 18)"),
        (leased_subscribe(b"q"), subscribe(b"r"), "a plain subscribe on a leased connection"),
        (leased_subscribe(b"q"), reserve(b"q"), "a reserve on a leased connection"),
        (
            subscribe(b"q"),
            leased_subscribe(b"r"),
            "a leased subscribe on a connection that sent a plain",
        ),
        (subscribe(b"q"), reserve(b"q"), "a reserve on a connection that sent a plain subscribe"),
        (subscribe(b"q"), ack(1), "an ack on a connection that sent a plain subscribe (decision"),
        (reserve(b"none"), subscribe(b"q"), "a plain subscribe on a connection that sent lease"),
        (release(1), subscribe(b"q"), "a plain subscribe on a connection that sent lease"),
    ],
)
async def test_decisions_18_and_20_close_the_connection_after_what_came_before(
    live: LiveServer,
    caplog: pytest.LogCaptureFixture,
    opening: bytes,
    offending: bytes,
    reason: str,
) -> None:
    peer, other = await live.connect(), await live.connect()
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        await peer.send(opening + b"\x21" + offending + push(b"q", b"after", b""))
        # The answers to what came before: a reserve of nothing or a release of no lease has
        # 11 bytes, then the sync's (eleven zero bytes on a leased connection, decision 18).
        owed = {0x53: bytes(11), 0x52: bytes(13), 0x4E: status(1, False) + bytes(2)}
        answers = owed.get(opening[0], bytes(2))
        assert await peer.receive_exactly(len(answers)) == answers
        await peer.expect_closed()
    assert await other.request(pop(b"q")) == []  # the push after it was never applied
    [record] = [r for r in caplog.records if r.name == "pinpriq.server"]
    assert record.levelno == logging.WARNING
    assert "127.0.0.1:" in record.getMessage()
    assert reason in record.getMessage()


@pytest.mark.parametrize(
    "frame",
    [
        b"\x52" + (86_400_001).to_bytes(4, "big") + b"\x00\x01q",
        b"\x53\xff\xff\xff\xff\x00\x00",
        release(1, 86_400_001),
        touch(1, 86_400_001),
    ],
)
async def test_a_lease_time_above_24_hours_closes_the_connection(
    live: LiveServer, caplog: pytest.LogCaptureFixture, frame: bytes
) -> None:
    peer = await live.connect()
    with caplog.at_level(logging.WARNING, logger="pinpriq.server"):
        await peer.send(pop(b"none") + frame)
        assert await peer.reply() == []
        await peer.expect_closed()
    assert "is above the most, 86,400,000 ms (24 h)" in caplog.text


async def test_lease_replies_on_a_leased_connection_interleave_in_order(live: LiveServer) -> None:
    worker, pusher = await live.connect(), await live.connect()
    await worker.send(leased_subscribe(b"q", 60_000) + READY)
    await pusher.send(push(b"q", b"a", b"1"))
    assert await worker.lease() == (1, 1, [(b"a", b"1")])
    await worker.send(ack(1) + READY + b"\x21")
    assert await worker.receive_exactly(22) == status(1, True) + bytes(11)  # the sync: 11 zeros
    await pusher.send(push(b"q", b"b", b"2"))
    delivery = lease_reply(2, 1, (b"b", b"2"))
    assert await worker.receive_exactly(len(delivery)) == delivery


# -- crashing workers -------------------------------------------------------------------------

JOBS = 200
#: A worker: takes jobs on long leases, so that only a close can give one back; reports each
#: job it starts and each it finishes with a successful ack. A doomed worker hangs in the middle
#: of its third job, to be killed there.
WORKER = """
import sys, threading
from pinpriq import BlockingPinpriqClient
port, doomed = int(sys.argv[1]), sys.argv[2] == "doomed"
with BlockingPinpriqClient.connect("127.0.0.1", port) as client:
    with client.subscribe("crash", lease_ms=600_000) as jobs:
        for number, job in enumerate(jobs):
            name = job.packets[0].payload.decode()
            print("start", name, flush=True)
            if doomed and number == 2:
                print("hang", name, flush=True)
                threading.Event().wait()
            if job.ack():
                print("done", name, flush=True)
"""


async def test_jobs_of_killed_workers_are_finished_exactly_once_by_the_others(
    live: LiveServer,
) -> None:
    pusher = await live.connect()
    await pusher.send(b"".join(push(b"crash", b"%d" % i, b"%d" % i) for i in range(JOBS)))
    done: collections.Counter[str] = collections.Counter()
    hung: dict[int, str] = {}
    both_killed = trio.Event()
    workers: list[trio.Process] = []
    with trio.fail_after(60):  # real seconds: the workers are processes
        async with trio.open_nursery() as nursery:

            async def watch(index: int, worker: trio.Process) -> None:
                assert worker.stdout is not None
                async for line in _lines(worker.stdout):
                    what, name = line.split()
                    if what == "done":
                        done[name] += 1
                    elif what == "hang":
                        hung[index] = name
                        worker.send_signal(signal.SIGKILL)  # mid-job: leased, not acked
                        if len(hung) == 2:
                            both_killed.set()
                    if sum(done.values()) == JOBS:
                        nursery.cancel_scope.cancel()

            async def start(kind: str) -> None:
                command = [sys.executable, "-c", WORKER, str(live.port), kind]
                worker = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
                workers.append(worker)
                nursery.start_soon(watch, len(workers) - 1, worker)

            # The doomed workers first, and the survivors once both are dead: otherwise the
            # survivors may finish every job before a doomed worker reaches its third.
            await start("doomed")
            await start("doomed")
            await both_killed.wait()
            await start("survivor")
            await start("survivor")
    for worker in workers:
        if worker.returncode is None:
            worker.kill()
        await worker.wait()
    assert sorted(hung) == [0, 1], "both doomed workers were killed mid-job"
    assert [workers[i].returncode for i in (0, 1)] == [-signal.SIGKILL] * 2
    assert set(done) == {str(i) for i in range(JOBS)}, "a job was lost"
    assert set(done.values()) == {1}, "a job was acked twice"
    assert all(done[name] == 1 for name in hung.values())  # finished by a survivor
    totals = live.broker.lease_totals()
    assert (totals.acked, totals.leased) == (JOBS, 0)
    assert totals.redelivered >= 2  # at least the two jobs in the killed workers' hands
    assert len(live.store) == 0


async def _lines(stream: trio.abc.ReceiveStream) -> collections.abc.AsyncIterator[str]:
    buffer = b""
    while chunk := await stream.receive_some(65536):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode()
