"""Helpers for the log's tests: a log-backed store on a fake clock in a real directory, and the
keeper's chores done synchronously, so the journal's layer is tested without trio."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pinpriq import packed
from pinpriq.persistence.journal import DEFAULT_SEGMENT_SIZE, FsyncPolicy, Journal
from pinpriq.persistence.packed_store import LoggedPackedStore
from pinpriq.persistence.segments import DataDir, create_segment
from pinpriq.persistence.store import LoggedStore

#: The log-backed stores: ``LoggedStore`` (on ``QueueStore``, the reference) and, where the
#: packed store's C core is built, ``LoggedPackedStore``.
LOGGED_STORES: list[type[LoggedStore]] = [
    LoggedStore,
    *([LoggedPackedStore] if packed.available else []),  # type: ignore[list-item]
]
#: What ``open_store`` opens when not told: the ``logged_store`` fixture runs a test module
#: on each of ``LOGGED_STORES`` by setting it.
default_store_class: type[LoggedStore] = LoggedStore

#: The fake wall clock is the fake monotonic clock plus this (seconds): some day in 2026.
WALL_OFFSET = 1_790_000_000.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + WALL_OFFSET

    def wall_ms(self) -> int:
        return int(self.wall() * 1000)


def settle(journal: Journal) -> None:
    """Do what the keeper would until the journal needs nothing: fsync a rotated segment, make
    a spare, fsync what the policy (or a pending deletion) asks for."""
    for _ in range(1000):
        if journal.rotating is not None:
            assert journal.rotating.fd is not None
            os.fdatasync(journal.rotating.fd)
            journal.rotated(0.0)
        elif journal.spare is None:
            number = journal.next_number
            path = journal.data_dir.segment_path(number)
            journal.spare_ready(number, create_segment(path, journal.segment_size))
        elif journal.sync_due(time.monotonic()):
            position = journal.written_pos
            assert journal.active.fd is not None
            journal.last_sync = time.monotonic()
            os.fdatasync(journal.active.fd)
            journal.synced(position, 0.0)
        else:
            return
    raise AssertionError("the journal never settled")


def open_store(
    path: Path,
    clock: FakeClock,
    *,
    segment_size: int = DEFAULT_SEGMENT_SIZE,
    policy: FsyncPolicy = FsyncPolicy.EVERYSEC,
    truncate_damaged: bool = False,
    store_class: type[LoggedStore] | None = None,
    mapped: bool | None = None,
) -> LoggedStore:
    """A log-backed store on ``path`` (a ``store_class``), recovered and settled, as a server
    has it at start (``mapped``: as ``Journal``'s)."""
    data_dir = DataDir.open(path, write=True)
    journal = Journal(data_dir, policy=policy, segment_size=segment_size, mapped=mapped)
    store_class = store_class or default_store_class
    store = store_class(clock, journal, truncate_damaged=truncate_damaged, wall_clock=clock.wall)
    try:
        store.recover(clock(), clock.wall_ms())
    except BaseException:
        store.close()  # as the server does after a failed start: releases the directory
        raise
    settle(journal)
    return store


def commit(store: LoggedStore) -> None:
    """What the server does after a batch: seal and write, then let the keeper catch up."""
    store.flush()
    settle(store.journal)
