"""A real server on a real data directory, under concurrent producers and consumers, killed
with SIGKILL at random moments, 20 times. After each restart the packets it serves are what a
model says: every push confirmed by a sync is there unless a pop's reply took it, no packet a
received pop reply took ever comes back, nothing expired comes back, and draining each queue
gives exactly the order the model gives for the packets that are there (priorities, newest
first on ties, key groups, prio-0 riders in push order).

The policy changes from round to round: a kill -9 loses nothing acknowledged under any of them.
Segments are as small as allowed, so every round crosses segments, and one queue's packets,
pushed in the first round and checked in the last, live through all 20 restarts and every
compaction. ``PINPRIQ_CRASH_SEED`` replays a run; the seed is printed on failure.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import trio

from pinpriq import PinpriqClient, PinpriqError

SERVER = str(Path(sys.executable).parent / "pinpriq-server")
LISTENING = re.compile(rb"pinpriq listening on \S+ port (\d+)")
ROUNDS = 20
POLICIES = ("everysec", "always", "no")
SEGMENTS = ("--log-segment-size", "64KiB")
KEYS = [b"k%d" % i for i in range(8)]
SHORT_TTL = 30  # ms: certainly expired by the time a killed server has restarted
LONG_TTL = 60_000  # ms: certainly alive until the next round has checked


@attrs.define
class Sent:
    payload: bytes  # unique: names the packet
    key: bytes
    prio: int
    ttl_ms: int
    index: int  # push order within its queue (one producer per queue)
    confirmed: bool = False


@attrs.define
class QueueModel:
    name: bytes
    sent: dict[bytes, Sent] = attrs.Factory(dict)
    popped: set[bytes] = attrs.Factory(set)
    #: Whether a pop was under way when the server died: it may have taken a key group whose
    #: reply never arrived (delivery is at most once).
    pop_in_flight: bool = False

    def expected_drain(self, present: set[bytes]) -> list[list[bytes]]:
        """The replies draining these packets gives: pops while anything is selectable, then
        a prio-1 sweeper per remaining key (sorted), which takes that key's riders along."""
        live = sorted((self.sent[p] for p in present), key=lambda s: s.index)
        replies = []
        while selectable := [s for s in live if s.prio > 0]:
            best = min(selectable, key=lambda s: (s.prio, -s.index))
            group = [best] + [s for s in live if s.key == best.key and s is not best]
            replies.append([s.payload for s in group])
            live = [s for s in live if s.key != best.key]
        for key in sorted({s.key for s in live}):
            riders = [s.payload for s in live if s.key == key]
            replies.append([sweeper_payload(self.name, key), *riders])
        return replies


def sweeper_payload(queue: bytes, key: bytes) -> bytes:
    return b"sweeper:" + queue + b":" + key


class ServerProcess:
    """``pinpriq-server`` on the data directory, its stderr kept in a file."""

    def __init__(self, data: Path, policy: str, log: Path) -> None:
        self.log = log
        self.start = log.stat().st_size if log.exists() else 0  # earlier servers' lines
        self.stderr = open(log, "ab")  # noqa: SIM115 - closed in kill()
        command = [SERVER, "--port", "0", "--http-port", "off", "--data-dir", str(data)]
        self.process = subprocess.Popen(
            [*command, "--fsync", policy, *SEGMENTS],
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
        )
        self.port = self._port()

    def _port(self) -> int:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            tail = self.log.read_bytes()[self.start :]
            if match := LISTENING.search(tail):
                return int(match.group(1))
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited at start: {tail.decode()[-1500:]}")
            time.sleep(0.02)
        raise AssertionError("the server did not listen within 60 s")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)
        self.stderr.close()


@pytest.fixture
def seed() -> Iterator[int]:
    value = int(os.environ.get("PINPRIQ_CRASH_SEED", random.randrange(1 << 32)))
    yield value
    print(f"crash loop seed: {value} (PINPRIQ_CRASH_SEED={value} replays it)")


class CrashLoop:
    def __init__(self, tmp: Path, rng: random.Random) -> None:
        self.data = tmp / "data"
        self.log = tmp / "server.log"
        self.rng = rng
        self.checked = 0  # queues drained and checked so far
        self.models: list[QueueModel] = []
        self.counter = 0

    def payload(self, queue: bytes) -> bytes:
        self.counter += 1
        return b"%s:%d" % (queue, self.counter)

    async def produce(self, port: int, model: QueueModel, ttls: tuple[int, ...]) -> None:
        """Pushes in bursts, each confirmed by a sync, until the server dies."""
        rng = self.rng
        try:
            async with PinpriqClient.connect("127.0.0.1", port, timeout=30) as client:
                for _ in range(10_000):
                    burst = []
                    for _ in range(rng.randint(1, 8)):
                        sent = Sent(
                            self.payload(model.name),
                            rng.choice(KEYS),
                            rng.choice([0, 1, 1, 2, 3, 4]),
                            rng.choice(ttls),
                            len(model.sent),
                        )
                        model.sent[sent.payload] = sent
                        await client.push(
                            model.name, sent.key, sent.payload, ttl_ms=sent.ttl_ms, prio=sent.prio
                        )
                        burst.append(sent)
                    await client.sync()
                    for sent in burst:
                        sent.confirmed = True
        except PinpriqError:
            return  # killed: what was not confirmed may or may not be there

    async def consume(self, port: int, model: QueueModel) -> None:
        """Pops until the server dies; a reply received means its packets are gone."""
        try:
            async with PinpriqClient.connect("127.0.0.1", port, timeout=30) as client:
                for _ in range(100_000):
                    model.pop_in_flight = True
                    packets = await client.pop(model.name)
                    model.pop_in_flight = False
                    model.popped.update(packet.payload for packet in packets)
                    await trio.sleep(self.rng.choice([0, 0, 0.001]))
        except PinpriqError:
            return

    async def load_then_kill(self, server: ServerProcess, round_: int) -> list[QueueModel]:
        models = [QueueModel(b"r%d-q%d" % (round_, i)) for i in range(3)]
        ttl_model = QueueModel(b"r%d-ttl" % round_)
        async with trio.open_nursery() as nursery:
            for model in models:
                nursery.start_soon(self.produce, server.port, model, (0,))
                if model is not models[0]:  # one queue only fills, across the kill
                    nursery.start_soon(self.consume, server.port, model)
            nursery.start_soon(self.produce, server.port, ttl_model, (SHORT_TTL, LONG_TTL))
            await trio.sleep(self.rng.uniform(0.2, 0.9))
            server.kill()  # SIGKILL, wherever the server is
        return [*models, ttl_model]

    async def check(self, port: int, model: QueueModel) -> None:
        """Drain the queue and compare with the model; the queue is empty after."""
        async with PinpriqClient.connect("127.0.0.1", port, timeout=30) as client:
            replies = []
            while packets := await client.pop(model.name):
                replies.append([p.payload for p in packets])
            keys = sorted({model.sent[p].key for reply in replies for p in reply} | set(KEYS))
            for key in keys:  # a sweeper per key takes the riders left behind
                await client.push(model.name, key, sweeper_payload(model.name, key), prio=1)
                packets = await client.pop(model.name)
                if len(packets) > 1:
                    replies.append([p.payload for p in packets])
            assert await client.pop(model.name) == []
        present = {p for reply in replies for p in reply if not p.startswith(b"sweeper:")}
        count = sum(len(reply) for reply in replies) - sum(
            p.startswith(b"sweeper:") for reply in replies for p in reply
        )
        assert count == len(present), f"{model.name!r}: a packet came back twice"
        assert present <= set(model.sent), f"{model.name!r}: packets nobody pushed"
        returned = present & model.popped
        assert not returned, f"{model.name!r}: popped packets came back: {sorted(returned)[:5]}"
        expired = {p for p in present if model.sent[p].ttl_ms == SHORT_TTL}
        assert not expired, f"{model.name!r}: expired packets came back: {sorted(expired)[:5]}"
        missing = {
            s.payload
            for s in model.sent.values()
            if s.confirmed and s.payload not in model.popped and s.ttl_ms != SHORT_TTL
        } - present
        # Only a pop whose reply never arrived may have taken them: one key group at most.
        taken_keys = {model.sent[p].key for p in missing}
        lost = missing if len(taken_keys) > 1 or not model.pop_in_flight else set()
        assert not lost, f"{model.name!r}: confirmed pushes lost: {sorted(lost)[:5]}"
        assert replies == model.expected_drain(present), f"{model.name!r}: pop order differs"
        self.checked += 1
        self.models.append(model)


@pytest.mark.timeout(900)
async def test_twenty_kills_lose_nothing_acknowledged(tmp_path: Path, seed: int) -> None:
    loop = CrashLoop(tmp_path, random.Random(seed))
    lasting = QueueModel(b"lasting")
    pending: list[QueueModel] = []
    for round_ in range(ROUNDS + 1):
        server = ServerProcess(loop.data, POLICIES[round_ % len(POLICIES)], loop.log)
        for model in pending:
            await loop.check(server.port, model)
        if round_ == 0:  # pushed once, checked after every restart
            async with PinpriqClient.connect("127.0.0.1", server.port) as client:
                for i in range(300):
                    sent = Sent(loop.payload(b"lasting"), KEYS[i % 5], i % 4, 0, i, True)
                    lasting.sent[sent.payload] = sent
                    await client.push(b"lasting", sent.key, sent.payload, prio=sent.prio)
                await client.sync()
        if round_ == ROUNDS:
            await loop.check(server.port, lasting)
            server.kill()
            break
        pending = await loop.load_then_kill(server, round_)
    log = loop.log.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    assert "ERROR" not in log, log[-3000:]
    assert loop.checked == ROUNDS * 4 + 1
    confirmed = sum(s.confirmed for model in loop.models for s in model.sent.values())
    assert confirmed > 20 * ROUNDS, f"only {confirmed} confirmed pushes: too little load"
    # The lasting packets were in the first segment: it went, so they were copied forward.
    assert not (loop.data / "0000000000000001.log").exists()
    assert log.count("torn tail") <= ROUNDS  # cut, logged, and the server started anyway
    segments = list(loop.data.glob("*.log"))
    assert len(segments) <= 12, f"{len(segments)} segment files: compaction did not keep up"
