"""One epoll of the server's own for the plain-TCP connections that wait for their next request.

What it owns: a level-triggered ``select.epoll`` and one task that serves, inline, every
connection whose socket it reports readable. What it must not know: frames, sessions, limits,
TLS. A connection is anything with a ``fileno`` and a ``serve_ready()``.

Theory of operation:

* **Why.** At pipeline 1 a request used to cost its connection's task a wait in trio
  (``wait_readable``: a re-arm of trio's one-shot registration, a task switch, a read that often
  found nothing) and a step of that task. Here a connection waiting for its next request is a
  file descriptor in this epoll and nothing else; its task sleeps. The reactor's task waits for
  the epoll (in the epoll itself when trio is idle: the own wait, below), and one wake-up
  serves every connection that has a request, without a task switch per request.
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
* **Fairness.** Each turn serves one chunk per ready connection; then, if anything else in trio
  can run, the reactor takes a checkpoint (``checkpoint_if_cancelled`` and
  ``cancel_shielded_checkpoint``: a full one, as trio's guarantees need) before the next turn:
  the other tasks (connections served by their own tasks, the admin listener, the expiry timer)
  run between two turns, and a flooding connection gets one chunk a turn like every other. The
  epoll is level-triggered: what a connection has left in its socket makes it ready again.
* **The own wait.** When trio has nothing else to run (no task in its run queue or left in its
  current pass, nobody in ``wait_all_tasks_blocked``, no instrument), the reactor does not go
  back to trio's loop at all: it blocks in its own epoll, inside its task step, until a
  connection is ready, and serves it at once. At pipeline 1 a request then costs an
  ``epoll_wait``, a read and a write, as in Redis, and no pass of trio's loop (which would be
  its ``epoll_wait``, a re-arm of its one-shot registration of our epoll, a task step and our
  own ``epoll.poll``). Trio keeps its guarantees because everything that would end trio's own
  idle wait ends ours: trio's epoll is registered in ours once, so any of its I/O (every other
  task's socket, its wake-up socket, written by threads' ``from_thread`` calls, by
  ``run_sync_soon`` and by signals) wakes the wait, and the wait lasts at most until trio's
  next deadline (cancel scopes, sleeps, the expiry timer). Then the reactor takes a full
  checkpoint and trio's loop runs as it would have. The blocking call is KI-protected as trio's
  own wait is: Ctrl-C reaches the main task, not the reactor's. One reactor per run of trio
  waits so (two would find each other runnable and trade checkpoints for ever, busy); another
  waits through trio, in trio's epoll, which wakes the first. The own wait reads trio's
  internals (``_IdleWait``, written against trio 0.35); where they are not as expected, in
  guest mode, or with a clock other than the system's (a ``MockClock``: virtual deadlines must
  never become real sleeps), the reactor waits through trio instead (``_TrioWait``, the
  fallback): on its epoll's descriptor with ``wait_readable``, and, when a turn leaves more to
  serve, with a checkpoint rather than a wait.
* **End of turn.** After serving a turn's ready connections, and before any other task runs,
  the reactor calls its ``end_turn`` hook once: the server seals and writes the log's block of
  the whole turn there, then writes the turn's replies (``server.py``).
"""

from __future__ import annotations

import collections
import enum
import logging
import select
import sys
import types
from collections.abc import Callable
from typing import Any, Protocol

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
        #: How ``run`` waits: in its own epoll when trio is suitable (``_IdleWait``), else in trio.
        self._waits: _TrioWait = _TrioWait(self._epoll)

    @property
    def parked(self) -> int:
        """How many connections wait for their next request here."""
        return len(self._parked)

    @property
    def waits_in_own_epoll(self) -> bool:
        """Whether ``run`` blocks in the reactor's epoll when trio has nothing else to do (the
        own wait), rather than waiting through trio."""
        return isinstance(self._waits, _IdleWait)

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
        waits = self._waits = _IdleWait.start(epoll) or self._waits
        try:
            ready: list[tuple[int, int]] = []
            while True:
                mode = waits.mode(ready)
                if mode is _OWN_WAIT:
                    ready = waits.wait()
                    if not ready:  # trio has something to do: its I/O, or a deadline has come
                        await _checkpoint()
                        waits.switched()
                        continue
                else:
                    if mode is _CHECKPOINT:
                        # More to serve at once, or other tasks to run: a checkpoint, which lets
                        # every other task run, rather than a wait in trio (which would re-arm
                        # trio's one-shot registration of our epoll, then ask the kernel twice).
                        await _checkpoint()
                    else:
                        await waits.wait_in_trio()
                    waits.switched()
                    ready = epoll.poll(0)
                self._serve(ready)
                # What is left after a turn: the own wait finds it first thing (or the
                # checkpoint's poll, if trio has other tasks to run); the wait in trio asks now.
                ready = [] if waits.own else epoll.poll(0)
        finally:
            waits.stop()

    def _serve(self, ready: list[tuple[int, int]]) -> None:
        """One turn: one chunk for each connection ``ready`` names."""
        parked = self._parked
        for fileno, _ in ready:
            entry = parked.get(fileno)
            if entry is None:
                continue  # handed back or cancelled earlier in this turn, or trio's epoll
            try:
                waits = entry[0].serve_ready()
            except Exception as error:  # raised in the connection's task instead
                self._hand_back(fileno, outcome.Error(error))
            else:
                if not waits:
                    self._hand_back(fileno, outcome.Value(None))
        self._end_turn()

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


class _Mode(enum.Enum):
    """How the reactor waits for its next turn."""

    OWN_WAIT = "own"  # trio has nothing else to do: block in our epoll, inside our task step
    CHECKPOINT = "checkpoint"  # something to do at once, here or in other tasks: a checkpoint
    TRIO_WAIT = "trio"  # wait in trio on our epoll's descriptor (the fallback)


_OWN_WAIT, _CHECKPOINT, _TRIO_WAIT = _Mode.OWN_WAIT, _Mode.CHECKPOINT, _Mode.TRIO_WAIT

#: Whether a reactor of this run of trio waits in its own epoll (``_IdleWait.start``).
_OWN_WAIT_TAKEN: trio.lowlevel.RunVar[bool] = trio.lowlevel.RunVar(
    "pinpriq.reactor.own_wait_taken", default=False
)

#: trio's longest wait in its run loop (``_MAX_TIMEOUT``), a day: ours too.
_MAX_WAIT = 24 * 60 * 60


async def _checkpoint() -> None:
    """A full checkpoint, as trio's guarantees need: cancellation, then a turn for every other
    runnable task."""
    await trio.lowlevel.checkpoint_if_cancelled()
    await trio.lowlevel.cancel_shielded_checkpoint()


@trio.lowlevel.enable_ki_protection
def _block(epoll: select.epoll, timeout: float) -> list[tuple[int, int]]:
    """Block in ``epoll``. KI-protected as trio's own wait is: a Ctrl-C here makes trio's
    handler deliver ``KeyboardInterrupt`` to the main task at its next checkpoint (through the
    wake-up socket, which wakes this wait), not raise it in the reactor's task."""
    return epoll.poll(timeout)


class _TrioWait:
    """The reactor's wait through trio, on its epoll's descriptor: the fallback."""

    #: Whether this is the own wait.
    own = False

    def __init__(self, epoll: select.epoll) -> None:
        self._epoll = epoll

    def mode(self, ready: list[tuple[int, int]]) -> _Mode:
        """How to wait for the next turn, ``ready`` being what the last turn left."""
        return _CHECKPOINT if ready else _TRIO_WAIT

    def switched(self) -> None:
        """The reactor's task waited or took a checkpoint: trio may be in another pass."""

    def wait(self) -> list[tuple[int, int]]:
        raise NotImplementedError  # no own wait here

    async def wait_in_trio(self) -> None:
        """Wait in trio until our epoll has something ready."""
        await trio.lowlevel.wait_readable(self._epoll.fileno())

    def stop(self) -> None:
        """``run`` has ended."""


class _IdleWait(_TrioWait):
    """The reactor's wait in its own epoll, when trio has nothing else to do (see the module's
    comment). Reads trio's internals (trio 0.35: the runner's run queue, its deadlines and
    clock, the epoll of its I/O manager, the current batch of its run loop); ``start`` checks
    each once and gives ``None`` if anything is not as expected, and the reactor waits through
    trio as before."""

    own = True

    def __init__(
        self,
        epoll: select.epoll,
        runner: Any,
        loop_frame: types.FrameType,
        task: trio.lowlevel.Task,
    ) -> None:
        super().__init__(epoll)
        self._runner = runner
        self._runq: collections.deque[trio.lowlevel.Task] = runner.runq
        self._deadlines = runner.deadlines
        self._clock = runner.clock
        #: trio's run loop, whose ``batch`` is what it still runs of its current pass.
        self._loop_frame = loop_frame
        self._task: Any = task
        #: trio's own epoll: every other task's I/O, and its wake-up socket (threads, signals).
        self.trio_fileno: int = runner.io_manager._epoll.fileno()
        #: Whether the batch trio runs now, after this task's step, holds other tasks; ``None``
        #: once trio may have started another pass (after each await).
        self._others_in_batch: bool | None = None

    @classmethod
    def start(cls, epoll: select.epoll) -> _IdleWait | None:
        """The own wait for this run of trio, from the reactor's task; ``None`` if trio is not
        what it was written for (another version's internals, another I/O manager, guest mode,
        a clock other than the system's, such as tests' ``MockClock``: virtual time must never
        become a real sleep)."""
        try:
            from trio._core import _run

            runner = _run.GLOBAL_RUN_CONTEXT.runner
            suitable = (
                not runner.is_guest
                and type(runner.clock) is _run.SystemClock
                and isinstance(runner.io_manager._epoll, select.epoll)
                and isinstance(runner.runq, collections.deque)
                and callable(runner.deadlines.next_deadline)
                and runner.waiting_for_idle is not None
                and "_all" in runner.instruments  # so more than one entry: an instrument
                and "batch" in _run.unrolled_run.__code__.co_varnames
            )
            task = trio.lowlevel.current_task()
            suitable = suitable and isinstance(task._cancel_status.effectively_cancelled, bool)
            # One own wait per run of trio: two reactors blocking in turn would each find the
            # other runnable, and take checkpoints back and forth for ever instead of sleeping.
            # Another reactor waits through trio, in trio's epoll, which wakes the own wait.
            suitable = suitable and _OWN_WAIT_TAKEN.get() is False
            loop_frame = _caller_frame(_run.unrolled_run.__code__)
        except (ImportError, AttributeError):
            return None
        if not suitable or loop_frame is None:
            return None
        idle = cls(epoll, runner, loop_frame, task)
        try:
            epoll.register(idle.trio_fileno, select.EPOLLIN)
        except OSError:  # trio's epoll holds ours already (ELOOP)
            return None
        _OWN_WAIT_TAKEN.set(True)
        return idle

    def stop(self) -> None:
        _OWN_WAIT_TAKEN.set(False)
        self._epoll.unregister(self.trio_fileno)

    def switched(self) -> None:
        self._others_in_batch = None

    def mode(self, ready: list[tuple[int, int]]) -> _Mode:
        """The own wait if no other task can run and nothing in trio needs its own loop (what
        ``ready`` holds, the own wait finds again)."""
        runner = self._runner
        if runner.waiting_for_idle or len(runner.instruments) > 1:
            # wait_all_tasks_blocked needs trio's idle wait; instruments (beyond the "_all"
            # entry trio always keeps) watch its I/O waits and task steps.
            return _TRIO_WAIT
        if self._runq or self._task._cancel_status.effectively_cancelled:
            return _CHECKPOINT
        if self._others_in_batch is None:
            # Tasks after ours in trio's current pass are runnable but in no queue we can see:
            # blocking now would hold them up. Asked once per pass: the batch cannot grow.
            self._others_in_batch = bool(self._loop_frame.f_locals["batch"])
        return _CHECKPOINT if self._others_in_batch else _OWN_WAIT

    def wait(self) -> list[tuple[int, int]]:
        """Block in our epoll until a connection is ready (those events), or until trio has
        something to do: its own epoll is ready or its next deadline has come (no events)."""
        timeout = self._clock.deadline_to_sleep_time(self._deadlines.next_deadline())
        if timeout <= 0:
            return []
        events = _block(self._epoll, min(timeout, _MAX_WAIT))
        trio_fileno = self.trio_fileno
        for fileno, _ in events:
            if fileno == trio_fileno:
                return []
        return events

    async def wait_in_trio(self) -> None:
        # Two epolls may not hold each other (the kernel refuses: ELOOP): trio's leaves ours
        # for this wait, and ours leaves trio's afterwards (trio keeps a one-shot registration
        # after a wait; ``notify_closing`` is how trio forgets a descriptor, and no task waits
        # on ours now).
        epoll = self._epoll
        epoll.unregister(self.trio_fileno)
        try:
            await trio.lowlevel.wait_readable(epoll.fileno())
        finally:
            trio.lowlevel.notify_closing(epoll.fileno())
            epoll.register(self.trio_fileno, select.EPOLLIN)


def _caller_frame(code: types.CodeType) -> types.FrameType | None:
    """The frame running ``code`` that this call comes from, if any."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back  # type: ignore[assignment]
    return frame
