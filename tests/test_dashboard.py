"""The dashboard in a real browser: headless Chromium (Debian's package) loads the page from a
live server holding packets, lets the page's own scripts poll ``/stats`` and draw, and dumps
the resulting DOM, which is checked for what a person would read.

Chromium is installed by the project's set-up (.ci/run), as redis-server is. Without it the
test is skipped, except under CI=true, where it fails: CI must never pass without a browser.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from html.parser import HTMLParser

import pytest
import trio

from pinpriq.admin.stats import Sampler
from pinpriq.display import escape
from pinpriq.server import PinpriqServer
from tests.conftest import StartServer
from tests.rawpeer import READY, ack, lease_reply, push, reserve, status, subscribe
from tests.test_admin import applied, start_admin
from tests.test_load_shapes import wait_until
from tests.test_store import FakeClock

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and os.environ.get("CI") == "true":
    raise RuntimeError("CI=true but chromium is not installed: .ci/run installs it")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")

#: Milliseconds of the page's own (virtual) time before the DOM is dumped: polls run each second.
BUDGET_MS = 4000


class Rendered(HTMLParser):
    """What the page shows: the text of elements with an id, each queue row's cells by class,
    and the attributes of priority bars and chart lines."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.rows: dict[str, dict[str, str]] = {}
        self.prios: dict[str, dict[str, str]] = {}
        self.lines: dict[str, str] = {}
        self.chart: dict[str, str | None] = {}
        self.tags_in_table: list[str] = []
        self._open: list[tuple[str, str | None, str | None]] = []  # tag, id, class
        self._row: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tr" and a.get("data-queue") is not None:
            self._row = a["data-queue"]
            self.rows[self._row or ""] = {}
        if self._row is not None:
            self.tags_in_table.append(tag)
            if tag == "span" and a.get("data-prio") is not None:
                self.prios.setdefault(self._row, {})[a["data-prio"] or ""] = a["data-count"] or ""
        if tag == "svg" and a.get("id") == "chart":
            self.chart = a
        if tag == "polyline":
            self.lines[a.get("class") or ""] = a.get("points") or ""
        self._open.append((tag, a.get("id"), a.get("class")))

    def handle_endtag(self, tag: str) -> None:
        while self._open and self._open.pop()[0] != tag:
            pass
        if tag == "tr":
            self._row = None

    def handle_data(self, data: str) -> None:
        if not self._open:
            return
        _, element_id, element_class = self._open[-1]
        if element_id:
            self.by_id[element_id] = self.by_id.get(element_id, "") + data
        if self._row is not None and element_class:
            cells = self.rows[self._row]
            cells[element_class] = cells.get(element_class, "") + data


async def render(url: str) -> Rendered:
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        command = [
            CHROMIUM,
            "--headless",
            "--no-sandbox",  # runs as root in CI containers
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
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


async def test_the_dashboard_shows_queues_priorities_connections_and_a_chart(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    server, clock = PinpriqServer(), FakeClock()  # the sampler's: the test moves it
    # The test ticks the sampler: a fast browser renders before a second-apart second sample.
    sampler = Sampler(server.broker, clock)
    admin = await start_admin(start_server, nursery, server, sampler=sampler)
    sampler.tick()  # at 0 s: nothing yet
    producer, subscriber = await admin.live.connect(), await admin.live.connect()
    odd = "<b>café</b>\\".encode() + b"\xff"  # markup, a backslash and a byte that is not UTF-8
    frames = [push(b"orders", b"k%d" % i, b"x" * 10, prio=1 + i % 3) for i in range(7)]
    frames += [push(b"orders", b"z", b"", prio=0), push(odd, b"k", b"v", prio=9)]
    await applied(producer, b"".join(frames))
    await subscriber.send(subscribe(b"orders") + subscribe(b"empty") + READY)
    assert await subscriber.reply()  # one delivered: 7 left in orders
    worker = await admin.live.connect()  # two packets leased, one of them acked
    await applied(worker, push(b"jobs", b"a", b"") + push(b"jobs", b"b", b""))
    await worker.send(reserve(b"jobs") + reserve(b"jobs") + ack(1))
    expected = lease_reply(1, 1, (b"b", b"")) + lease_reply(2, 1, (b"a", b"")) + status(1, True)
    assert await worker.receive_exactly(len(expected)) == expected
    await wait_until(lambda: admin.live.broker.subscriptions.subscriber_count == 1, "subscribed")
    for _ in range(2):  # 11 pushes and 1 delivery in the first second, none in the next
        clock.advance(1.0)
        sampler.tick()

    page = await render(f"http://127.0.0.1:{admin.port}/")

    assert page.by_id["status"] == "serving"
    assert page.by_id["connections"] == "3"
    assert page.by_id["leases"] == "1 / 1"
    assert page.by_id["subscribers"] == "1"
    assert page.by_id["packets"] == "8"
    assert page.by_id["queue-count"] == "2"
    assert page.by_id["memory"].endswith("of 1.0 GiB")
    assert list(page.rows) == ["orders", escape(odd), "empty"]  # deepest first
    orders = page.rows["orders"]
    assert (orders["name"], orders["packets"], orders["subscribers"]) == ("orders", "7", "1")
    assert page.prios["orders"] == {"0": "1", "1": "2", "2": "2", "3": "2"}
    assert page.rows[escape(odd)]["name"] == "<b>café</b>\\\\\\xff"  # shown as text
    assert "b" not in page.tags_in_table  # never as markup
    assert page.prios[escape(odd)] == {"9": "1"}
    assert page.rows["empty"]["packets"] == "0"
    assert page.chart["data-samples"] == "2"
    assert page.by_id["chart-scale"] == "last 2.0 s; top: 8 packets, 11/s"
    assert page.lines == {  # 600 x 150 px from y = 158 up, each line scaled to its top
        "packets": "0.0,8.0 600.0,8.0",
        "pushed": "0.0,8.0 600.0,158.0",
        "popped": "0.0,144.4 600.0,158.0",
    }


async def test_the_dashboard_asks_for_the_token_when_the_server_has_one(
    start_server: StartServer, nursery: trio.Nursery
) -> None:
    admin = await start_admin(start_server, nursery, PinpriqServer(token=b"tok"))
    page = await render(f"http://127.0.0.1:{admin.port}/")
    assert page.by_id["status"] == "needs the server's token"
    page = await render(f"http://127.0.0.1:{admin.port}/#token=tok")
    assert page.by_id["status"] == "serving"
