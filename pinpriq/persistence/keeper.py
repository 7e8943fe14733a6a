"""The journal's Trio side: everything about the log that waits, done off the event loop.

One task (``Keeper.run``) does, in this order, whatever the journal needs:

1. after a rotation, fsync the full segment, then let writes into the new one go on;
2. make the next spare segment (created and its space reserved in a worker thread); when the
   disk is full, tell the journal (pushes wait) and try again every ``RETRY_SECONDS``, or as
   soon as a deleted segment has freed space;
3. after a write met a full disk, try it again every ``RETRY_SECONDS``;
4. fsync the active segment when the policy asks: under ``always`` whenever something written
   is not yet synced (group commit: everything written during one fsync goes into the next,
   whatever the number of connections), under ``everysec`` once a second, and under any
   policy once compaction's copies must be on disk before their old segment can go.

Group commit waits for no timer: under ``always`` the keeper, woken by the write of a batch,
fsyncs at its next turn of the event loop, so the batches of every connection read in the same
turn share the fsync, the batches applied while it runs go into the next one, and a lone
client's request is synced at once.

A reactor turn's block (``commit``). The connections the server's reactor serves in one turn
log into one open block, which the server seals and writes at the end of the turn through
``commit``; under ``always``, with fsyncs inline, ``commit`` fsyncs it there and then, so the
turn's replies are written next, in the same step of the event loop: per turn one ``pwrite``
and one ``fdatasync``, and no task switch (what Redis does in ``beforeSleep``). The keeper's
task is woken only for what ``commit`` did not do (an fsync in the thread, a rotation, a
spare).

Where an fsync runs. A worker thread (``trio.to_thread``) keeps the event loop serving every
connection while the disk works, but the hand-off costs tens of microseconds of CPU and a
wake-up on each side, which on a disk that syncs in tens of microseconds is most of the cost
of a request. So under ``always``, once ``FAST_FSYNCS`` fsyncs in a row have taken at most
``INLINE_FSYNC_SECONDS``, the keeper fsyncs inline, in the event loop, as Redis does; the
first inline fsync that takes longer sends it back to the thread, so a slow disk stalls the
loop (``/healthz``, every connection's reads) for one fsync at most. Everything else that
waits on the disk (``everysec``'s fsync of a second of writes, rotations, new segments) always
runs in the thread. Only the output that waits on an fsync is held (``wait_released``).

A failed fsync or write stops the server (``LogFailure``): after a failed fsync the kernel may
have dropped the data, so no later fsync could be trusted to mean anything. The journal is
marked failed (``Journal.fail``) first, so no output waiting on the log is ever written.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable

import trio

from pinpriq.persistence.journal import FsyncPolicy, Hold, Journal
from pinpriq.persistence.segments import create_segment

__all__ = ["FAST_FSYNCS", "INLINE_FSYNC_SECONDS", "RETRY_SECONDS", "Keeper", "LogFailure"]

log = logging.getLogger("pinpriq.persistence")

#: How often a full disk is tried again.
RETRY_SECONDS = 1.0
#: The longest an fsync may take to be run inline, in the event loop (under ``always``).
INLINE_FSYNC_SECONDS = 0.001
#: Fsyncs in a row, each at most ``INLINE_FSYNC_SECONDS``, before the keeper fsyncs inline.
FAST_FSYNCS = 8


class LogFailure(Exception):
    """The log cannot be written or synced: the server must stop. One line for the operator."""


class Keeper:
    """Runs a journal's fsyncs, rotations, spares and retries, and wakes output waiting on
    them."""

    def __init__(self, journal: Journal, *, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` (seconds, monotonic) times fsyncs and schedules everysec and retries."""
        self.journal = journal
        self._clock = clock
        self._wake = trio.Event()
        self._progress = trio.Event()
        self._retry_at = -math.inf  # when to try making a spare, or writing, again
        self._deleted = 0  # segments deleted when the disk was last found full
        #: Whether the active segment's fsyncs run inline, and how many fast ones in a row
        #: the worker thread has made (see the module's docstring).
        self.inline = False
        self._fast = 0
        #: While ``commit`` runs, the journal's wake-ups are noted here instead of waking
        #: the task; and how many tasks wait in ``wait_released``.
        self._committing = False
        self._asked = False
        self._waiting = 0
        journal.wake = self._wake_up

    def _wake_up(self) -> None:
        if self._committing:
            self._asked = True
        else:
            self._wake.set()

    async def wait_released(self) -> None:
        """Return once every block sealed before the call is stored as the policy promises."""
        journal = self.journal
        target = journal.sealed_pos
        self._waiting += 1
        try:
            while journal.reached < target:
                await self._progress.wait()
        finally:
            self._waiting -= 1

    def commit(self, flush: Callable[[], None]) -> None:
        """Seal and write a reactor turn's block (``flush``) and, under ``always`` with fsyncs
        inline, fsync it here, so that the turn's output may be written at once (see the
        module's docstring). Never raises for the log: a failed fsync fails the journal, and
        the keeper's task stops the server."""
        self._committing = True
        try:
            flush()
        finally:
            self._committing = False
        if not self._asked:
            return
        self._asked = False
        journal = self.journal
        if (
            self.inline
            and journal.policy is FsyncPolicy.ALWAYS
            and journal.hold is None
            and journal.rotating is None
            and journal.written_pos > journal.synced_pos
        ):
            # Every byte not yet synced is in the active segment: the keeper's own ``_work``
            # fsyncs a rotated segment before the active one, and no rotation is under way.
            # A failed fsync fails the journal (``_has_work``): the task stops the server.
            with contextlib.suppress(LogFailure):
                self._sync_active_inline()
            self._progressed()
            if not self._has_work():
                return
        self._wake.set()

    def _has_work(self) -> bool:
        """Whether ``_work`` would find something to do now (retries aside: they wait)."""
        journal = self.journal
        return (
            journal.hold is not None
            or journal.rotating is not None
            or journal.spare is None
            or journal.sync_due(self._clock())
        )

    def _progressed(self) -> None:
        """Wake the tasks waiting for the log to reach further."""
        if self._waiting:
            self._progress.set()
            self._progress = trio.Event()

    async def run(self) -> None:
        """Serve the journal until cancelled. Raises ``LogFailure`` if the log fails."""
        journal = self.journal
        while True:
            if journal.hold is Hold.FAILED:
                raise LogFailure(journal.failure)
            worked = await self._work()
            self._progressed()
            if not worked:
                with trio.move_on_at(self._next_time()):
                    await self._wake.wait()
                self._wake = trio.Event()

    async def _work(self) -> bool:
        """Do the most urgent thing the journal needs, if any; returns whether it did."""
        journal = self.journal
        now = self._clock()
        if journal.rotating is not None:
            seconds = await self._fsync(journal.rotating.fd)
            journal.rotated(seconds)
            return True
        # A deleted segment may have freed the space a full disk lacked: try again at once.
        retry = now >= self._retry_at or journal.segments_deleted != self._deleted
        if journal.spare is None and retry:
            await self._make_spare()
            return True
        if journal.hold is Hold.SPACE and retry:
            journal.retry()
            self._failed_at_retry()
            return True
        if journal.sync_due(now):
            await self._sync_active()
            return True
        return False

    async def _sync_active(self) -> None:
        """Fsync the active segment, inline or in the worker thread, and choose where the
        next one runs."""
        if self.inline:
            self._sync_active_inline()
            return
        journal = self.journal
        position = journal.written_pos
        seconds = await self._fsync(journal.active.fd)
        self._synced(position, seconds)

    def _sync_active_inline(self) -> None:
        journal = self.journal
        position = journal.written_pos
        self._synced(position, self._fsync_inline(journal.active.fd))

    def _synced(self, position: int, seconds: float) -> None:
        """An fsync of the active segment from ``position`` took ``seconds``: tell the
        journal, and choose where the next one runs."""
        journal = self.journal
        if seconds > INLINE_FSYNC_SECONDS:
            self.inline = False
            self._fast = 0
        elif not self.inline and journal.policy is FsyncPolicy.ALWAYS:
            self._fast += 1
            self.inline = self._fast >= FAST_FSYNCS
        journal.synced(position, seconds)

    def _next_time(self) -> float:
        """When to look again without being woken (trio's clock): the next everysec fsync or
        retry."""
        journal = self.journal
        now = self._clock()
        due = math.inf
        if journal.written_pos > journal.synced_pos and journal.policy is FsyncPolicy.EVERYSEC:
            due = journal.last_sync + 1.0
        if journal.spare is None or journal.hold is Hold.SPACE:
            due = min(due, self._retry_at)
        return trio.current_time() + max(0.0, due - now) if due != math.inf else math.inf

    async def _fsync(self, fd: int | None) -> float:
        """Fsync ``fd`` in the worker thread; returns how long the fsync itself took."""
        self.journal.last_sync = self._clock()
        try:
            return await trio.to_thread.run_sync(self._timed_fsync, fd)
        except OSError as error:
            raise self._fsync_failed(error) from None

    def _fsync_inline(self, fd: int | None) -> float:
        """Fsync ``fd`` here, in the event loop; returns how long it took."""
        self.journal.last_sync = self._clock()
        try:
            return self._timed_fsync(fd)
        except OSError as error:
            raise self._fsync_failed(error) from None

    def _timed_fsync(self, fd: int | None) -> float:
        assert fd is not None
        started = self._clock()
        os.fdatasync(fd)
        return self._clock() - started

    def _fsync_failed(self, error: OSError) -> LogFailure:
        """Fail the journal (it logs why, and holds all waiting output for ever)."""
        self.journal.fail("fsync of the log failed", error)
        return LogFailure(self.journal.failure)

    async def _make_spare(self) -> None:
        journal = self.journal
        number = journal.next_number
        path = journal.data_dir.segment_path(number)
        try:
            fd = await trio.to_thread.run_sync(create_segment, path, journal.segment_size)
        except OSError as error:
            journal.spare_failed(error)
            self._failed_at_retry()
            return
        journal.spare_ready(number, fd)

    def _failed_at_retry(self) -> None:
        self._retry_at = self._clock() + RETRY_SECONDS
        self._deleted = self.journal.segments_deleted
