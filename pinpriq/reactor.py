"""One epoll of the server's own for the plain-TCP connections that wait for their next request.

What it owns: a level-triggered ``select.epoll`` and one task that serves, inline, every
connection whose socket it reports readable. What it must not know: frames, sessions, limits,
TLS. A connection is anything with a ``fileno`` and a ``serve_ready()``.

Theory of operation:

* **Why.** At pipeline 1 a request used to cost its connection's task a wait in trio
  (``wait_readable``: a re-arm of trio's one-shot registration, a task switch, a read that often
  found nothing) and a step of that task. Here a connection waiting for its next request is a
  file descriptor in this epoll and nothing else; its task sleeps. The reactor's task waits in
  trio on the epoll's own descriptor, and one wake-up serves every connection that has a
  request, without a task switch per request.
* **Parking.** A connection's task calls ``park(conn)`` when all that is left to do is wait for
  the next request: its descriptor is registered and the task sleeps. From then on the reactor
  calls ``conn.serve_ready()`` each time the socket is readable; that reads one chunk and serves
  it as far as it goes without a wait, and says whether the connection is waiting for its next
  request again (it stays parked) or needs its task for the rest (a wait of any other kind, a
  close). Then the descriptor is unregistered and the task wakes up: ``park`` returns. An
  exception from ``serve_ready`` is raised in the connection's task, where any error serving a
  connection is handled, never in the reactor's.
* **Cancellation.** A parked task that is cancelled (shutdown, an eviction, its nursery) has
  its descriptor unregistered before trio raises ``Cancelled`` in it: a connection is never in
  the epoll while its task runs, so the task alone closes its socket.
* **Fairness.** Each turn serves one chunk per ready connection, then takes a checkpoint: the
  other tasks (connections served by their own tasks, the admin listener, the expiry timer) run
  between two turns, and a flooding connection gets one chunk a turn like every other. The
  epoll is level-triggered: what a connection has left in its socket makes it ready again. After
  a turn the reactor asks its epoll again at once: if something is ready the checkpoint is
  ``checkpoint_if_cancelled`` and ``cancel_shielded_checkpoint`` (a full checkpoint, as trio's
  guarantees need) and the next turn follows; only when nothing is ready does it wait in trio
  on the epoll's descriptor, which costs trio a re-arm of its one-shot registration and a task
  step. On a busy server most turns take the first way.
* **End of turn.** After serving a turn's ready connections, and before any other task runs,
  the reactor calls its ``end_turn`` hook once: the server seals and writes the log's block of
  the whole turn there, then writes the turn's replies (``server.py``).
"""

from __future__ import annotations

import logging
import select
from collections.abc import Callable
from typing import Protocol

import outcome
import trio

__all__ = ["Reactor", "Servable"]

log = logging.getLogger("pinpriq.server")


class Servable(Protocol):
    """A connection the reactor can serve."""

    @property
    def fileno(self) -> int: ...

    def serve_ready(self) -> bool:
        """Its socket is readable: read one chunk and serve it as far as it goes without a wait.
        ``True`` if it now waits for its next request; ``False`` if its task must go on."""
        ...


def _nothing() -> None:
    """The default ``end_turn``."""


class Reactor:
    """One level-triggered epoll, and the task (``run``) that serves what it reports."""

    def __init__(self, end_turn: Callable[[], None] | None = None) -> None:
        """``end_turn`` is called after each turn's connections are served (see the module's
        comment)."""
        self._epoll = select.epoll()
        self._end_turn = end_turn if end_turn is not None else _nothing
        #: The parked connections' tasks, by file descriptor.
        self._parked: dict[int, tuple[Servable, trio.lowlevel.Task]] = {}

    @property
    def parked(self) -> int:
        """How many connections wait for their next request here."""
        return len(self._parked)

    async def park(self, conn: Servable) -> None:
        """Leave ``conn`` to the reactor until it needs its task again (see the module's
        comment); always a checkpoint."""
        fileno = conn.fileno
        self._epoll.register(fileno, select.EPOLLIN)
        self._parked[fileno] = (conn, trio.lowlevel.current_task())

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            self._unregister(fileno)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def run(self) -> None:
        """Serve parked connections until cancelled."""
        epoll = self._epoll
        parked = self._parked
        end_turn = self._end_turn
        ready: list[tuple[int, int]] = []
        while True:
            if ready:
                # More to serve at once: a checkpoint, which lets every other task run, rather
                # than a wait in trio (which would re-arm trio's one-shot registration of the
                # epoll and then ask the kernel twice, trio's epoll and ours).
                await trio.lowlevel.checkpoint_if_cancelled()
                await trio.lowlevel.cancel_shielded_checkpoint()
            else:
                await trio.lowlevel.wait_readable(epoll.fileno())
                ready = epoll.poll(0)
            for fileno, _ in ready:
                entry = parked.get(fileno)
                if entry is None:
                    continue  # handed back or cancelled earlier in this turn
                try:
                    waits = entry[0].serve_ready()
                except Exception as error:  # raised in the connection's task instead
                    self._hand_back(fileno, outcome.Error(error))
                else:
                    if not waits:
                        self._hand_back(fileno, outcome.Value(None))
            end_turn()
            ready = epoll.poll(0)

    def close(self) -> None:
        """Close the epoll, once no task parks or runs here any more."""
        self._epoll.close()

    def _hand_back(self, fileno: int, result: outcome.Outcome[None]) -> None:
        entry = self._unregister(fileno)
        if entry is not None:
            trio.lowlevel.reschedule(entry[1], result)
        elif isinstance(result, outcome.Error):
            # Its task was cancelled while the reactor served it (the connection was evicted
            # meanwhile): it is closing anyway, so the error is only logged.
            log.error("error serving a closing connection", exc_info=result.error)

    def _unregister(self, fileno: int) -> tuple[Servable, trio.lowlevel.Task] | None:
        entry = self._parked.pop(fileno, None)
        if entry is not None:
            self._epoll.unregister(fileno)
        return entry
