"""The dashboard in a real browser: headless Chromium (Debian's package) loads the page from a
live server holding packets, lets the page's own scripts poll the admin listener and draw, and
the resulting DOM is checked for what a person would read. The overview is dumped once
(``--dump-dom``); the queue page, its purge and move and the token prompt are driven like a person
would, through the DevTools protocol on a pipe (``Browser``): clicks, typing, the dialogs.

The page's figures are made deterministic: the admin listener is given a ``Sampler`` on a fake
clock that the test ticks (``serve_admin(sampler=...)``), so rates and charts are what the test
chose, never what the machine's speed made them.

Chromium is installed by the project's set-up (.ci/run), as redis-server is. Without it the
test is skipped, except under CI=true, where it fails: CI must never pass without a browser.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
from html.parser import HTMLParser
from typing import Any

import pytest
import trio

from pinpriq.admin.stats import Sampler
from pinpriq.display import escape
from pinpriq.server import PinpriqServer
from tests.conftest import StartServer
from tests.rawpeer import (
    READY,
    ack,
    lease_reply,
    pop,
    push,
    push_options,
    reserve,
    status,
    subscribe,
)
from tests.test_admin import Admin, applied, start_admin
from tests.test_load_shapes import wait_until
from tests.test_store import FakeClock

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and os.environ.get("CI") == "true":
    raise RuntimeError("CI=true but chromium is not installed: .ci/run installs it")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")

#: Milliseconds of the page's own (virtual) time before the DOM is dumped: polls run each second.
BUDGET_MS = 4000
#: What the page shows where it has no figure (an en dash).
NO_FIGURE = "\u2013"
#: Seconds a browser test may take in all: a bound on a hang, not a measure of speed.
BROWSER_TIMEOUT = 90
FLAGS = [
    "--headless",
    "--no-sandbox",  # runs as root in CI containers
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


async def start_sampled_admin(
    start_server: StartServer, nursery: trio.Nursery, server: PinpriqServer
) -> tuple[Admin, Sampler, FakeClock]:
    """A server and its admin listener, whose sampler only the test ticks."""
    clock = FakeClock(1000.0)  # the sampler's: the test moves it, so rates are its figures
    sampler = Sampler(server.broker, clock)
    admin = await start_admin(start_server, nursery, server, sampler=sampler)
    return admin, sampler, clock


class Rendered(HTMLParser):
    """What the page shows: the text of elements with an id, each queue row's cells by class,
    and the attributes of priority bars and chart lines."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.rows: dict[str, dict[str, str]] = {}
        self.peers: dict[str, dict[str, str]] = {}
        self.prios: dict[str, dict[str, str]] = {}
        self.lines: dict[str, str] = {}
        self.chart: dict[str, str | None] = {}
        self.tags_in_table: list[str] = []
        self._open: list[tuple[str, str | None, str | None]] = []  # tag, id, class
        self._row: str | None = None
        self._peer: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tr" and a.get("data-queue") is not None:
            self._row = a["data-queue"]
            self.rows[self._row or ""] = {}
        if tag == "tr" and a.get("data-address") is not None:
            self._peer = a["data-address"] or ""
            self.peers[self._peer] = {}
        if self._row is not None:
            self.tags_in_table.append(tag)
            if tag == "span" and a.get("data-prio") is not None:
                self.prios.setdefault(self._row, {})[a["data-prio"] or ""] = a["data-count"] or ""
        if tag == "svg" and a.get("id") == "chart":
            self.chart = a
        if tag == "polyline" and self._open[-1][1] == "chart":  # the overview's chart's
            self.lines[a.get("class") or ""] = a.get("points") or ""
        self._open.append((tag, a.get("id"), a.get("class")))

    def handle_endtag(self, tag: str) -> None:
        while self._open and self._open.pop()[0] != tag:
            pass
        if tag == "tr":
            self._row = self._peer = None

    def handle_data(self, data: str) -> None:
        if not self._open:
            return
        _, element_id, element_class = self._open[-1]
        if element_id:
            self.by_id[element_id] = self.by_id.get(element_id, "") + data
        if self._row is not None and element_class:
            cells = self.rows[self._row]
            cells[element_class] = cells.get(element_class, "") + data
        if self._peer is not None and element_class:
            cells = self.peers[self._peer]
            cells[element_class] = cells.get(element_class, "") + data


async def render(url: str) -> Rendered:
    assert CHROMIUM is not None
    # Chromium's helper processes may outlive the one we wait for by a moment, still writing
    # into the profile: its removal must not fail the test.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        command = [
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--virtual-time-budget={BUDGET_MS}",
            "--dump-dom",
            url,
        ]
        with trio.fail_after(90):
            done = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
    page = Rendered()
    page.feed(done.stdout.decode())
    return page


class Browser:
    """Headless Chromium driven through the DevTools protocol on a pipe
    (``--remote-debugging-pipe``): JSON messages ended by a NUL byte, read by Chromium from its
    file descriptor 3 and written to its 4. One page (``open``); JavaScript dialogs are
    reported on ``dialogs`` and left open until the test answers them (``answer``)."""

    def __init__(self, to_browser: trio.lowlevel.FdStream, from_browser: trio.lowlevel.FdStream):
        self._to = to_browser
        self._from = from_browser
        self._sending = trio.Lock()
        self._last_id = 0
        self._waiting: dict[int, trio.Event] = {}
        self._replies: dict[int, dict[str, Any]] = {}
        self._session: str | None = None
        self._dialogs_in, self.dialogs = trio.open_memory_channel[str](math.inf)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command (to the page once one is open) and return its result."""
        self._last_id += 1
        message: dict[str, Any] = {"id": self._last_id, "method": method, "params": params}
        if self._session is not None:
            message["sessionId"] = self._session
        done = self._waiting[self._last_id] = trio.Event()
        async with self._sending:
            await self._to.send_all(json.dumps(message).encode() + b"\0")
        await done.wait()
        reply = self._replies.pop(message["id"])
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]  # type: ignore[no-any-return]

    async def read(self) -> None:
        """Route replies to their callers and dialogs to ``dialogs``, until the pipe closes."""
        pending = b""
        while chunk := await self._from.receive_some():
            *messages, pending = (pending + chunk).split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message:
                    self._replies[message["id"]] = message
                    self._waiting.pop(message["id"]).set()
                elif message.get("method") == "Page.javascriptDialogOpening":
                    self._dialogs_in.send_nowait(message["params"]["message"])

    async def open(self, url: str) -> None:
        target = await self.call("Target.createTarget", url="about:blank")
        attached = await self.call(
            "Target.attachToTarget", targetId=target["targetId"], flatten=True
        )
        self._session = attached["sessionId"]
        await self.call("Page.enable")  # for dialog events
        await self.call("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if a promise)."""
        result = await self.call(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def until(self, condition: str) -> Any:
        """Wait until a JavaScript expression is truthy in the page (its polls run meanwhile);
        returns its value. Bounded by the test's ``fail_after``, not a measure of speed."""
        return await self.evaluate(
            "new Promise((resolve) => { const check = () => { let v;"
            f" try {{ v = ({condition}); }} catch (e) {{ v = null; }}"
            " if (v) resolve(v); else setTimeout(check, 50); }; check(); })"
        )

    async def text(self, selector: str) -> str:
        return await self.evaluate(  # type: ignore[no-any-return]
            f"document.querySelector({json.dumps(selector)}).textContent"
        )

    async def click(self, selector: str) -> None:
        """Click an element. Dispatched after this returns: a click that opens a dialog blocks
        the page's script until the dialog is answered."""
        await self.evaluate(
            f"setTimeout(() => document.querySelector({json.dumps(selector)}).click(), 0)"
        )

    async def close(self) -> None:
        await self._to.aclose()
        await self._from.aclose()

    async def answer(self, accept: bool, text: str = "") -> None:
        """Close the open dialog: OK (with ``text`` typed into a prompt) or Cancel."""
        await self.call("Page.handleJavaScriptDialog", accept=accept, promptText=text)


async def start_browser(nursery: trio.Nursery) -> Browser:
    """Headless Chromium on a pipe, until the test's nursery is cancelled."""
    assert CHROMIUM is not None
    profile = tempfile.TemporaryDirectory(ignore_cleanup_errors=True)
    commands_read, commands_write = os.pipe()
    events_read, events_write = os.pipe()
    # Chromium reads commands from descriptor 3 and writes to 4: bash puts them there (dash
    # takes one-digit descriptors only).
    command = [
        "bash",
        "-c",
        f'exec "$0" "$@" 3<&{commands_read} 4>&{events_write}',
        CHROMIUM,
        *FLAGS,
        f"--user-data-dir={profile.name}",
        "--remote-debugging-pipe",
        "about:blank",
    ]
    process = await trio.lowlevel.open_process(
        command,
        pass_fds=(commands_read, events_write),
        start_new_session=True,  # its helper processes too are ended with the group
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(commands_read)
    os.close(events_write)
    browser = Browser(trio.lowlevel.FdStream(commands_write), trio.lowlevel.FdStream(events_read))

    async def run() -> None:
        try:
            await browser.read()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with trio.CancelScope(shield=True):
                await process.wait()
                await browser.close()
            profile.cleanup()

    nursery.start_soon(run)
    return browser


async def test_the_dashboard_shows_queues_priorities_connections_and_a_chart(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    admin, sampler, clock = await start_sampled_admin(start_server, nursery, PinpriqServer())
    sampler.watch(b"orders")
    sampler.tick()  # at 1000: nothing yet
    producer, subscriber = await admin.live.connect(), await admin.live.connect()
    odd = "<b>café</b>\\".encode() + b"\xff"  # markup, a backslash and a byte that is not UTF-8
    frames = [push(b"orders", b"k%d" % i, b"x" * 10, prio=1 + i % 3) for i in range(7)]
    frames += [push(b"orders", b"z", b"", prio=0), push(odd, b"k", b"v", prio=9)]
    frames += [push_options(b"orders", b"soon", b"", delay_ms=3_600_000, prio=1)]
    frames += [push_options(b"later", b"k", b"", delay_ms=3_600_000)]  # only delayed packets
    await applied(producer, b"".join(frames))
    await subscriber.send(subscribe(b"orders") + subscribe(b"empty") + READY)
    assert await subscriber.reply()  # one delivered: 7 left in orders
    worker = await admin.live.connect()  # two packets leased, one of them acked
    await applied(worker, push(b"jobs", b"a", b"") + push(b"jobs", b"b", b""))
    await worker.send(reserve(b"jobs") + reserve(b"jobs") + ack(1))
    expected = lease_reply(1, 1, (b"b", b"")) + lease_reply(2, 1, (b"a", b"")) + status(1, True)
    assert await worker.receive_exactly(len(expected)) == expected
    await wait_until(lambda: admin.live.broker.subscriptions.subscriber_count == 1, "subscribed")
    clock.now += 2.0
    sampler.tick()  # at 1002: 13 pushed, 1 delivered, 10 held (2 delayed), 2 leased, 1 acked

    page = await render(f"http://127.0.0.1:{admin.port}/")

    assert page.by_id["status"] == "serving"
    assert page.by_id["connections"] == "3"
    assert page.by_id["leases"] == "1 / 1"
    assert page.by_id["subscribers"] == "1"
    assert page.by_id["packets"] == "10"  # held: 2 of them delayed
    assert page.by_id["queue-count"] == "3"  # later holds only a delayed packet
    assert page.by_id["rates"] == "6.5 / 0.0"  # 13 pushes in the 2 s the test made
    assert page.by_id["memory"].endswith("of 1.0 GiB")
    # Deepest first, then by name those with none queued but subscribers or leased packets.
    assert list(page.rows) == ["orders", escape(odd), "later", "empty", "jobs"]
    orders = page.rows["orders"]
    assert (orders["name"], orders["packets"], orders["subscribers"]) == ("orders", "7", "1")
    assert orders["delayed"] == "1"  # held apart, not among its packets
    assert (orders["pushed"], orders["popped"]) == ("4.5", "0.5")  # 9 pushed, 1 taken, in 2 s
    assert (page.rows["later"]["packets"], page.rows["later"]["delayed"]) == ("0", "1")
    assert page.prios["orders"] == {"0": "1", "1": "2", "2": "2", "3": "2"}
    assert page.rows[escape(odd)]["name"] == "<b>café</b>\\\\\\xff"  # shown as text
    assert page.rows[escape(odd)]["popped"] == NO_FIGURE  # nobody looked at it before: no rates
    assert "b" not in page.tags_in_table  # never as markup
    assert page.prios[escape(odd)] == {"9": "1"}
    assert page.rows["empty"]["packets"] == "0"
    assert (page.rows["jobs"]["packets"], page.rows["jobs"]["leased"]) == ("0", "1")
    assert page.chart["data-samples"] == "1"  # one second between the two ticks
    # One point each, at 158 - value / top * 150: 10 packets of a top of 10; 6.5 pushes per
    # second of a top of 6.5; 0.5 delivered per second.
    assert page.lines == {"packets": "0.0,8.0", "pushed": "0.0,8.0", "popped": "0.0,146.5"}
    assert page.peers["127.0.0.1"] == {
        "address": "127.0.0.1",
        "connections": "3",
        "subscribers": "1",
        "leased": "1",
        "leases": "1",
    }
    assert page.by_id["peers-note"] == "3 connections, 1 subscribing, 1 holding leases."


async def test_the_dashboard_asks_for_the_token_when_the_server_has_one(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    admin = await start_admin(start_server, nursery, PinpriqServer(token=b"tok"))
    page = await render(f"http://127.0.0.1:{admin.port}/")
    assert page.by_id["status"] == "needs the server's token"
    page = await render(f"http://127.0.0.1:{admin.port}/#token=tok")
    assert page.by_id["status"] == "serving"


#: The page has the listener's answer to an action (while it waits it shows an ellipsis).
ANSWERED = "/^(Purged|Moved|not done)/.test(document.getElementById('action-result').textContent)"
PACKET_ROWS = """[...document.querySelectorAll("#packets-table tbody tr")].map(
    (tr) => [...tr.children].map((td) => td.textContent))"""
PRIO_ROWS = """Object.fromEntries([...document.querySelectorAll("#q-prios tbody tr")].map(
    (tr) => [tr.dataset.prio, tr.querySelector(".count").textContent]))"""


async def test_a_queue_page_shows_its_figures_rates_and_next_packets(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    admin, sampler, clock = await start_sampled_admin(start_server, nursery, PinpriqServer())
    sampler.watch(b"orders")
    sampler.tick()
    producer, worker, subscriber = [await admin.live.connect() for _ in range(3)]
    odd = "<i>é</i>".encode() + b"\xfe/%"
    frames = [
        push(b"orders", b"k1", b"first", prio=3),
        push(b"orders", b"k2", b"<b>bold</b>\n\xff", prio=1),
        push(b"orders", b"k3", b"x" * 300, prio=2),
        push(b"orders", b"k3", b"rider", prio=0),  # of k3's group: comes right after it
        push(b"orders", b"gone", b"", prio=1),
        push(odd, b"k", b"v"),
        # Delayed (protocol 1.2): held, counted apart, in no queue yet, so never peeked.
        push_options(b"orders", b"later", b"in an hour", delay_ms=3_600_000, prio=1),
    ]
    await applied(producer, b"".join(frames))
    assert await producer.request(pop(b"orders")) == [(b"gone", b"")]
    await applied(worker, push(b"orders", b"lease-me", b"", prio=1))
    await worker.send(reserve(b"orders"))
    assert await worker.receive_exactly(len(lease_reply(1, 1, (b"lease-me", b"")))) == (
        lease_reply(1, 1, (b"lease-me", b""))
    )
    await applied(subscriber, subscribe(b"orders"))  # no credit: nothing delivered
    clock.now += 10.0
    sampler.tick()  # 7 pushed to orders in 10 s; 2 taken (a pop, a lease); 4 queued, 1 delayed

    browser = await start_browser(nursery)
    with trio.fail_after(BROWSER_TIMEOUT):
        await browser.open(f"http://127.0.0.1:{admin.port}/")
        await browser.until("document.querySelector('#queues tr[data-queue=orders]')")
        await browser.click("#queues tr[data-queue=orders]")  # a click on the row
        await browser.until("!document.getElementById('queue-page').hidden")
        await browser.until("document.getElementById('q-packets').textContent === '4'")
        assert await browser.text("#queue-name") == "orders"
        assert await browser.text("#q-leased") == "1"
        assert await browser.text("#q-subscribers") == "1"
        assert await browser.text("#q-rates") == "0.7 / 0.2"
        assert await browser.text("#q-rates-window") == "over the last 10 s"
        assert await browser.text("#q-delayed") == "1"
        assert (await browser.text("#q-oldest")).endswith(" s")
        assert await browser.evaluate(PRIO_ROWS) == {"0": "1", "1": "1", "2": "1", "3": "1"}
        assert await browser.evaluate(PACKET_ROWS) == [
            ["1", "1", "k2", "<b>bold</b>\\n\\xff", "13"],  # escaped, as text
            ["2", "2", "k3", "x" * 200 + " … (300 bytes)", "300"],  # cut, with its length
            ["3", "0", "k3", "rider", "5"],
            ["4", "3", "k1", "first", "5"],
        ]
        assert await browser.evaluate("document.querySelectorAll('#queue-page b').length") == 0

        await browser.click("#back")
        await browser.until("!document.getElementById('overview').hidden")
        await browser.evaluate(  # a click on the row showing that name
            "[...document.querySelectorAll('#queues tbody tr')]"
            f".find((tr) => tr.dataset.queue === {json.dumps(escape(odd))}).click()"
        )
        # Its bytes went to /queues/NAME percent-encoded, and came back as that name.
        await browser.until(
            f"document.getElementById('queue-name').textContent === {json.dumps(escape(odd))}"
        )
        assert await browser.evaluate(PACKET_ROWS) == [["1", "1", "k", "v", "1"]]


async def test_a_purge_through_the_queue_page_asks_first(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    admin, _, _ = await start_sampled_admin(start_server, nursery, PinpriqServer())
    producer = await admin.live.connect()
    await applied(producer, b"".join(push(b"jobs", b"k%d" % i, b"p") for i in range(3)))
    browser = await start_browser(nursery)
    with trio.fail_after(BROWSER_TIMEOUT):
        await browser.open(f"http://127.0.0.1:{admin.port}/#queue=jobs")
        await browser.until("document.getElementById('q-packets').textContent === '3'")
        await browser.click("#purge")
        question = await browser.dialogs.receive()
        assert question.startswith("Purge queue jobs? Its 3 queued packets are removed")
        await browser.answer(False)  # cancelled: nothing is sent
        assert await browser.text("#action-result") == ""
        assert admin.live.store.queue_info(b"jobs").packets == 3

        await browser.click("#purge")
        assert (await browser.dialogs.receive()).startswith("Purge queue jobs?")
        await browser.answer(True)
        await browser.until(ANSWERED)
        assert await browser.text("#action-result") == "Purged 3 packets."
        assert admin.live.store.queue_info(b"jobs").packets == 0
        await browser.until("document.getElementById('q-packets').textContent === '0'")
        assert await browser.evaluate(PACKET_ROWS) == []


async def test_a_move_through_the_queue_page_asks_where_then_asks_first(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    admin, _, _ = await start_sampled_admin(start_server, nursery, PinpriqServer())
    store = admin.live.store
    producer = await admin.live.connect()
    dead = b"".join(push(b"jobs.dead", b"k%d" % i, b"p%d" % i) for i in range(3))
    await applied(producer, push(b"jobs", b"waiting", b"w") + dead)
    browser = await start_browser(nursery)
    with trio.fail_after(BROWSER_TIMEOUT):
        await browser.open(f"http://127.0.0.1:{admin.port}/#queue=jobs.dead")
        await browser.until("document.getElementById('q-packets').textContent === '3'")
        await browser.click("#move")
        assert await browser.dialogs.receive() == (
            "Move the queued packets of jobs.dead to which queue?"
        )
        await browser.answer(False)  # no queue given: nothing asked or sent
        await browser.click("#move")
        await browser.dialogs.receive()
        await browser.answer(True, "jobs")
        assert await browser.dialogs.receive() == (
            "Move all 3 queued packets of jobs.dead to jobs? They join jobs as new pushes; "
            "leased and delayed packets stay."
        )
        await browser.answer(False)  # cancelled at the confirmation: nothing is sent
        assert await browser.text("#action-result") == ""
        assert store.queue_info(b"jobs.dead").packets == 3

        await browser.click("#move")
        await browser.dialogs.receive()
        await browser.answer(True, "jobs")
        await browser.dialogs.receive()
        await browser.answer(True)
        await browser.until(ANSWERED)
        assert await browser.text("#action-result") == "Moved 3 packets to jobs."
        await browser.until("document.getElementById('q-packets').textContent === '0'")
        assert store.queue_info(b"jobs.dead").packets == 0
        # They joined jobs as pushes made now, in their old order: newer than what was there.
        assert [key for key, *_ in store.peek(b"jobs", 10)] == [b"k2", b"k1", b"k0", b"waiting"]

        # At most one packet, to a name that must be percent-encoded: the newest group goes.
        await browser.open(f"http://127.0.0.1:{admin.port}/#queue=jobs")
        await browser.until("document.getElementById('q-packets').textContent === '4'")
        await browser.evaluate("document.getElementById('move-count').value = '1'")
        await browser.click("#move")
        await browser.dialogs.receive()
        await browser.answer(True, "a b/\u00e9&n=9")
        assert await browser.dialogs.receive() == (
            "Move up to 1 packets (whole key groups) of jobs to a b/\u00e9&n=9? They join "
            "a b/\u00e9&n=9 as new pushes; leased and delayed packets stay."
        )
        await browser.answer(True)
        await browser.until(ANSWERED)
        assert await browser.text("#action-result") == "Moved 1 packets to a b/\u00e9&n=9."
        assert [key for key, *_ in store.peek("a b/\u00e9&n=9".encode(), 10)] == [b"k2"]

        # What the server refuses is said beside the buttons, and nothing moves.
        await browser.click("#move")
        await browser.dialogs.receive()
        await browser.answer(True, "jobs")  # itself
        await browser.dialogs.receive()
        await browser.answer(True)
        await browser.until(ANSWERED)
        assert await browser.text("#action-result") == (
            "not done: to= names the queue moved from, jobs: nothing to move"
        )
        assert store.queue_info(b"jobs").packets == 3


async def test_the_queue_page_asks_for_the_token_and_purges_and_moves_with_it(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    server = PinpriqServer(token=b"tok")
    admin, _, _ = await start_sampled_admin(start_server, nursery, server)
    producer = await admin.live.connect()
    await applied(producer, push(b"jobs", b"a", b"1") + push(b"jobs", b"b", b"2"))
    browser = await start_browser(nursery)
    with trio.fail_after(BROWSER_TIMEOUT):
        await browser.open(f"http://127.0.0.1:{admin.port}/#queue=jobs")
        await browser.until("document.getElementById('login').className === 'shown'")
        assert await browser.text("#status") == "needs the server's token"
        assert await browser.text("#q-packets") == NO_FIGURE  # nothing shown without the token
        await browser.evaluate("document.getElementById('token').value = 'wrong'")
        await browser.click("#login button")
        await browser.until(
            "document.getElementById('status').textContent === 'the server refused that token'"
        )
        await browser.evaluate("document.getElementById('token').value = 'tok'")
        await browser.click("#login button")
        await browser.until("document.getElementById('q-packets').textContent === '2'")
        assert await browser.evaluate("document.getElementById('login').className") == ""

        await browser.click("#purge")  # sent with the token and X-Pinpriq-Action
        await browser.dialogs.receive()
        await browser.answer(True)
        await browser.until(ANSWERED)
        assert await browser.text("#action-result") == "Purged 2 packets."
        assert admin.live.store.queue_info(b"jobs").packets == 0

        await applied(producer, push(b"jobs", b"c", b"3"))
        await browser.until("document.getElementById('q-packets').textContent === '1'")
        await browser.click("#move")  # sent with the token and X-Pinpriq-Action too
        await browser.dialogs.receive()
        await browser.answer(True, "elsewhere")
        await browser.dialogs.receive()
        await browser.answer(True)
        await browser.until("/^Moved/.test(document.getElementById('action-result').textContent)")
        assert admin.live.store.queue_info(b"elsewhere").packets == 1


async def test_a_queue_page_with_a_malformed_name_says_what_the_server_refused(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    admin, _, _ = await start_sampled_admin(start_server, nursery, PinpriqServer())
    page = await render(f"http://127.0.0.1:{admin.port}/#queue=%ZZ")
    assert page.by_id["status"].startswith("the server refused: a malformed percent escape in %ZZ")
