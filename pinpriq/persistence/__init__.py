"""Packets that survive a restart and a crash: the segmented append-only log behind
``pinpriq-server --data-dir``.

Modules, one concept each, imported one way (later ones use earlier ones):

* ``records``: the bytes of blocks and entries, with checksums (pure codec);
* ``segments``: the data directory, its format version and lock, segment files;
* ``recovery``: reading a directory back: live packets, torn tails, damage, ``--check-log``;
* ``compaction``: copying live packets out of the oldest segment so it can be deleted;
* ``journal``: the write side: open block, sealing, writing, segment lifecycle, the reserve;
* ``keeper``: the Trio task that fsyncs, rotates, makes spares and retries, off the loop;
* ``store``: ``LoggedStore``, the store contract on top of ``QueueStore``, logging each change.
"""

from pinpriq.persistence.journal import FsyncPolicy, Journal, JournalStats
from pinpriq.persistence.keeper import Keeper, LogFailure
from pinpriq.persistence.segments import DataDir, DataDirError
from pinpriq.persistence.store import LoggedStore

__all__ = [
    "DataDir",
    "DataDirError",
    "FsyncPolicy",
    "Journal",
    "JournalStats",
    "Keeper",
    "LogFailure",
    "LoggedStore",
]
