"""The wire fixtures against our server, and against deliberately wrong servers.

Our server must pass every fixture. Each wrong variant below is our server with one fault (a
misreading of the protocol someone could plausibly make) and must fail the fixtures named for
it: the suite can fail, and each of those fixtures checks what it says it checks. Variants are
built by subclassing the store or the subscriptions and handing them to ``PinpriqServer``; the
two decoder faults monkeypatch ``pinpriq.server.FrameDecoder`` for one test (the server builds
a decoder per connection and has no hook to choose another).

The fixtures run on the wall clock (TTLs, "nothing within 100 ms"), but no test here asserts
how long anything took.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import trio

import pinpriq.server
from pinpriq.conformance import DEFAULT_FIXTURES, Result, load_fixtures, run_suite
from pinpriq.server import PinpriqServer
from pinpriq.store import QueuedPacket, QueueStore
from pinpriq.subscriptions import Subscriber, Subscriptions
from pinpriq.wire import FrameDecoder, Pop, ProtocolError, encode_reply

FIXTURES = load_fixtures(DEFAULT_FIXTURES)
HOST = "127.0.0.1"


async def start(nursery: trio.Nursery, server: PinpriqServer) -> int:
    listeners = await nursery.start(partial(server.serve, 0, host=HOST))
    port: int = listeners[0].socket.getsockname()[1]
    return port


def failures(results: list[Result]) -> list[str]:
    return [result.line() for result in results if not result.passed]


async def test_our_server_passes_every_fixture_in_any_order(nursery: trio.Nursery) -> None:
    server = PinpriqServer()
    port = await start(nursery, server)
    assert failures(await run_suite(FIXTURES, HOST, port)) == []
    # Again on the same server, backwards: no fixture depends on another's leftovers...
    assert failures(await run_suite(FIXTURES[::-1], HOST, port)) == []
    # ...because each leaves every queue it used empty.
    assert len(server.store) == 0


# -- wrong variants: the store ----------------------------------------------------------------


class _OldestFirst(dict[int, QueuedPacket]):
    """A priority level whose ``popitem`` takes the oldest entry instead of the newest."""

    def popitem(self) -> tuple[int, QueuedPacket]:
        seq = next(iter(self))
        return seq, self.pop(seq)


class OldestWinsTies(QueueStore):
    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> float:
        deadline = super().push(queue, key, payload, ttl_ms, prio)
        levels = self._queues[queue].levels
        if prio and type(levels[prio]) is dict:
            levels[prio] = _OldestFirst(levels[prio])
        return deadline


class MappedPrio(QueueStore):
    """Stores each packet under another priority: a misread priority scale."""

    def __init__(self, clock: Callable[[], float], mapping: Callable[[int], int]) -> None:
        super().__init__(clock)
        self._mapping = mapping

    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> float:
        return super().push(queue, key, payload, ttl_ms, self._mapping(prio))


class ReorderedGroup(QueueStore):
    """Returns a pop's packets in another order."""

    def __init__(
        self,
        clock: Callable[[], float],
        order: Callable[[list[QueuedPacket]], list[QueuedPacket]],
    ) -> None:
        super().__init__(clock)
        self._order = order

    def pop(self, queue: bytes) -> list[QueuedPacket]:
        return self._order(super().pop(queue))


class MappedTtl(QueueStore):
    def __init__(self, clock: Callable[[], float], mapping: Callable[[int], int]) -> None:
        super().__init__(clock)
        self._mapping = mapping

    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> float:
        return super().push(queue, key, payload, self._mapping(ttl_ms), prio)


class NoExpiry(QueueStore):
    """Never expires anything: TTLs ignored."""

    def expire(self) -> int:
        return 0

    def next_deadline(self) -> float | None:
        return None


class CStringNames(QueueStore):
    """Queue names cut at their first zero byte, as a C string would be."""

    def push(self, queue: bytes, key: bytes, payload: bytes, ttl_ms: int, prio: int) -> float:
        return super().push(queue.split(b"\0")[0], key, payload, ttl_ms, prio)

    def pop(self, queue: bytes) -> list[QueuedPacket]:
        return super().pop(queue.split(b"\0")[0])

    def peek_rank(self, queue: bytes) -> tuple[int, int] | None:
        return super().peek_rank(queue.split(b"\0")[0])


# -- wrong variants: subscriptions ------------------------------------------------------------


class SubscribeGrantsCredit(Subscriptions):
    def subscribe(self, sub: Subscriber, queue: bytes) -> None:
        if queue not in sub.queues:
            sub.credits += 1
        super().subscribe(sub, queue)


class CreditsDoNotAccumulate(Subscriptions):
    def ready(self, sub: Subscriber, credits: int = 1) -> None:
        sub.credits = 0  # "ready" read as a flag, not a count
        super().ready(sub, credits)


class UnsubscribeDropsCredits(Subscriptions):
    def unsubscribe(self, sub: Subscriber, queue: bytes) -> None:
        super().unsubscribe(sub, queue)
        sub.credits = 0


class NewestWaiterFirst(Subscriptions):
    def offer(self, queue: bytes) -> None:
        while waiters := self.waiting(queue):
            if not self._settle(waiters[-1], once=True):
                break


class FirstSubscribedFirst(Subscriptions):
    """Serves the waiter that subscribed first, however late its credit came."""

    def __init__(self, store: QueueStore) -> None:
        super().__init__(store)
        self._subscribed: dict[tuple[int, bytes], int] = {}

    def subscribe(self, sub: Subscriber, queue: bytes) -> None:
        self._subscribed.setdefault((id(sub), queue), len(self._subscribed))
        super().subscribe(sub, queue)

    def offer(self, queue: bytes) -> None:
        while waiters := self.waiting(queue):
            first = min(waiters, key=lambda sub: self._subscribed[id(sub), queue])
            if not self._settle(first, once=True):
                break


class PushWakesNoOne(Subscriptions):
    def offer(self, queue: bytes) -> None:
        pass  # deliveries only happen on ready or subscribe


class DeliversLater(Subscriptions):
    """Serves waiters after the pusher's whole read has been handled, not at once."""

    def offer(self, queue: bytes) -> None:
        trio.lowlevel.current_trio_token().run_sync_soon(super().offer, queue)


class CloseKeepsSubscriptions(Subscriptions):
    def remove(self, sub: Subscriber) -> None:
        pass


class _RecordingStore:
    """A store seen through a window: remembers the queue of the latest pop."""

    def __init__(self, store: QueueStore) -> None:
        self.store = store
        self.last_queue = b""

    def pop(self, queue: bytes) -> list[QueuedPacket]:
        self.last_queue = queue
        return self.store.pop(queue)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


class RequeuesOnClose(Subscriptions):
    """At least once instead of at most once: what a closing connection was sent goes back."""

    def __init__(self, store: QueueStore) -> None:
        self._recording = _RecordingStore(store)
        super().__init__(self._recording)  # type: ignore[arg-type]
        self._sent: dict[int, list[tuple[bytes, list[QueuedPacket]]]] = {}

    def ready(self, sub: Subscriber, credits: int = 1) -> None:
        if id(sub) not in self._sent:
            sent = self._sent[id(sub)] = []
            deliver = sub.deliver

            def record(packets: list[QueuedPacket]) -> None:
                sent.append((self._recording.last_queue, packets))
                deliver(packets)

            sub.deliver = record
        super().ready(sub, credits)

    def remove(self, sub: Subscriber) -> None:
        super().remove(sub)
        for queue, packets in self._sent.pop(id(sub), []):
            for packet in packets:
                self._recording.store.push(queue, packet.key, packet.payload, 0, packet.prio or 1)
            self.offer(queue)


class _QueueNameOrder(_RecordingStore):
    def peek_rank(self, queue: bytes) -> tuple[int, bytes] | None:
        return None if self.store.peek_rank(queue) is None else (0, queue)


class QueuesInNameOrder(Subscriptions):
    """Serves a subscriber's queues in name order instead of by their best packet."""

    def __init__(self, store: QueueStore) -> None:
        super().__init__(_QueueNameOrder(store))  # type: ignore[arg-type]


# -- wrong variants: the server and its decoder -----------------------------------------------


class EmptyPopSilent(PinpriqServer):
    def apply(self, conn: Any, frame: Any) -> None:
        if isinstance(frame, Pop):
            packets = self.store.pop(frame.queue)
            if packets:
                conn.output += encode_reply(packets)
            return
        super().apply(conn, frame)


class SkipsUnknownOpcodes(FrameDecoder):
    def next_frame(self) -> Any:
        while True:
            try:
                return super().next_frame()
            except ProtocolError:
                self._pos += 1  # skip the byte and carry on


class LosesSplitFrames(FrameDecoder):
    def feed(self, data: bytes) -> None:
        self._pos = len(self._data)  # as if every read held whole frames
        super().feed(data)


def clock() -> float:
    return trio.current_time()


def with_subscriptions(kind: type[Subscriptions]) -> Callable[[], PinpriqServer]:
    def build() -> PinpriqServer:
        server = PinpriqServer()
        server.subscriptions = kind(server.store)
        return server

    return build


def with_store(build_store: Callable[[], QueueStore]) -> Callable[[], PinpriqServer]:
    return lambda: PinpriqServer(build_store())


# name -> (how to build it, the decoder it reads with, the fixtures that must catch it)
VARIANTS: dict[str, tuple[Callable[[], PinpriqServer], type[FrameDecoder], set[str]]] = {
    "oldest wins ties": (
        with_store(lambda: OldestWinsTies(clock)),
        FrameDecoder,
        {"newest-wins-ties", "credits-accumulate"},
    ),
    "prio 255 is the highest": (
        with_store(lambda: MappedPrio(clock, lambda p: 256 - p if p else 0)),
        FrameDecoder,
        {"priority-order"},
    ),
    "prio 0 is selectable": (
        with_store(lambda: MappedPrio(clock, lambda p: p or 256)),
        FrameDecoder,
        {"pop-prio0-only", "delivery-is-key-group"},
    ),
    "no key grouping": (
        with_store(lambda: QueueStore(clock, max_pop=1)),
        FrameDecoder,
        {"key-group", "pop-prio0-only", "delivery-is-key-group"},
    ),
    "key group returned newest first": (
        with_store(lambda: ReorderedGroup(clock, lambda r: r[:1] + r[:0:-1])),
        FrameDecoder,
        {"key-group"},
    ),
    "key group in push order, selected not first": (
        with_store(lambda: ReorderedGroup(clock, lambda r: sorted(r, key=lambda p: p.seq))),
        FrameDecoder,
        {"key-group", "pop-prio0-only"},
    ),
    "replies not capped at 65,535 packets": (
        with_store(lambda: QueueStore(clock, max_pop=1 << 20)),
        FrameDecoder,
        {"reply-max-packets"},
    ),
    "ttl 0 expires at once": (
        with_store(lambda: MappedTtl(clock, lambda ttl: ttl or 1)),
        FrameDecoder,
        {"ttl-zero-never-expires"},
    ),
    "ttl in seconds": (
        with_store(lambda: MappedTtl(clock, lambda ttl: min(ttl * 1000, 0xFFFF))),
        FrameDecoder,
        {"ttl-expiry", "ttl-expired-sibling", "ttl-expired-not-delivered"},
    ),
    "ttl ignored": (
        with_store(lambda: NoExpiry(clock)),
        FrameDecoder,
        {"ttl-expiry", "ttl-zero-never-expires"},
    ),
    "queue names are C strings": (
        with_store(lambda: CStringNames(clock)),
        FrameDecoder,
        {"queue-name-bytes"},
    ),
    "subscribe grants a credit": (
        with_subscriptions(SubscribeGrantsCredit),
        FrameDecoder,
        {"subscribe-grants-no-credit"},
    ),
    "credits do not accumulate": (
        with_subscriptions(CreditsDoNotAccumulate),
        FrameDecoder,
        {"credits-accumulate", "fifo-subscribers"},
    ),
    "unsubscribe drops credits": (
        with_subscriptions(UnsubscribeDropsCredits),
        FrameDecoder,
        {"unsubscribe-keeps-credits"},
    ),
    "newest waiter served first": (
        with_subscriptions(NewestWaiterFirst),
        FrameDecoder,
        {"fifo-subscribers"},
    ),
    "first subscriber served first, whenever its credit came": (
        with_subscriptions(FirstSubscribedFirst),
        FrameDecoder,
        {"fifo-wait-starts-with-credit"},
    ),
    "a push wakes no waiting subscriber": (
        with_subscriptions(PushWakesNoOne),
        FrameDecoder,
        {"subscribe-delivers", "delivery-before-next-frame"},
    ),
    "deliveries wait for the pusher's read to be handled": (
        with_subscriptions(DeliversLater),
        FrameDecoder,
        {"delivery-before-next-frame", "delivery-then-reply"},
    ),
    "subscribed queues served in name order": (
        with_subscriptions(QueuesInNameOrder),
        FrameDecoder,
        {"best-across-queues"},
    ),
    "closing keeps subscriptions": (
        with_subscriptions(CloseKeepsSubscriptions),
        FrameDecoder,
        {"close-drops-subscription"},
    ),
    "delivered packets requeued when the connection closes": (
        with_subscriptions(RequeuesOnClose),
        FrameDecoder,
        {"at-most-once"},
    ),
    "empty pop gets no reply": (
        EmptyPopSilent,
        FrameDecoder,
        {"pop-missing-queue", "push-pop"},
    ),
    "unknown opcode skipped": (
        PinpriqServer,
        SkipsUnknownOpcodes,
        {"unknown-opcode-closes", "unknown-opcodes"},
    ),
    "a frame split across reads is lost": (
        PinpriqServer,
        LosesSplitFrames,
        {"split-every-byte"},
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
async def test_wrong_variant_fails_the_fixtures_that_pin_its_fault(
    name: str, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    build, decoder, catchers = VARIANTS[name]
    # The server makes a FrameDecoder per connection and offers no hook to choose another.
    monkeypatch.setattr(pinpriq.server, "FrameDecoder", decoder)
    port = await start(nursery, build())
    fixtures = [fixture for fixture in FIXTURES if fixture.name in catchers]
    assert len(fixtures) == len(catchers), "a variant names a fixture that does not exist"
    # A short step timeout: these fixtures are meant to fail, and a right answer takes
    # milliseconds (our server passes each of them in test_our_server_passes_...).
    results = await run_suite(fixtures, HOST, port, step_timeout=0.5)
    assert [result.line() for result in results if result.passed] == []


# -- the command line, as a subprocess --------------------------------------------------------


async def conformance(*args: str) -> trio.Process:
    return await trio.run_process(
        [sys.executable, "-m", "pinpriq.conformance", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


async def test_command_line_passes_against_our_server(nursery: trio.Nursery) -> None:
    port = await start(nursery, PinpriqServer())
    done = await conformance(f"{HOST}:{port}", "push-pop", "key-group")
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().splitlines()[0].startswith("PASS push-pop (")
    assert done.stdout.decode().splitlines()[-1].startswith("2 fixtures: 2 passed, 0 failed")


async def test_command_line_fails_against_a_wrong_server(nursery: trio.Nursery) -> None:
    port = await start(nursery, PinpriqServer(OldestWinsTies(clock)))
    done = await conformance(f"{HOST}:{port}", "push-pop", "newest-wins-ties")
    assert done.returncode == 1
    lines = done.stdout.decode().splitlines()
    assert lines[1].startswith("FAIL newest-wins-ties (")
    assert "expected" in lines[1]
    assert "received" in lines[1]
    assert lines[-1].startswith("2 fixtures: 1 passed, 1 failed")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["localhost"], "bad address 'localhost'"),
        (["127.0.0.1:99999"], "bad address"),
        (["127.0.0.1:7000", "no-such-fixture"], "no fixture named no-such-fixture"),
        (["127.0.0.1:7000", "--fixtures", "/nonexistent"], "no fixtures"),
    ],
)
async def test_command_line_usage_errors_are_one_line(args: list[str], message: str) -> None:
    done = await conformance(*args)
    assert done.returncode == 2
    assert done.stdout == b""
    [line] = done.stderr.decode().splitlines()
    assert line.startswith("pinpriq-conformance: ")
    assert message in line


async def test_command_line_reports_a_refused_connection() -> None:
    # A port that was free a moment ago: nothing listens there now.
    with trio.socket.socket() as sock:
        await sock.bind((HOST, 0))
        port = sock.getsockname()[1]
    done = await conformance(f"{HOST}:{port}")
    assert done.returncode == 2
    assert done.stderr.decode() == (
        f"pinpriq-conformance: cannot connect to {HOST}:{port}: Connection refused\n"
    )
