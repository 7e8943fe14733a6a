"""The packed packet store: ``store.QueueStore``'s rules with no Python object per packet.

``pinpriq/_packed.c`` holds the queues (its opening comment is the layout's theory): one
malloc'd record per packet, key and payload inline, levels as arrays of record pointers, key
groups in a hash table of intrusive lists, one expiry heap of records. This module is its
Python face: what an operator reads (``queue_info``, ``note_time``), which is off the hot path
and the same code as ``QueueStore``'s, and ``default_store``, the choice the server makes.

The C core is an optional extension (setup.py): without a compiler, or with
``PINPRIQ_PURE_PYTHON`` set, it is not built or not loaded, and ``default_store`` returns the
pure-Python ``QueueStore``, the reference whose tests every backend passes.
"""

from __future__ import annotations

from typing import Any

from pinpriq import _build, store
from pinpriq.store import Clock, QueueStore, age, note_time
from pinpriq.store_contract import QueueInfo, Store

__all__ = [
    "DEFAULT_STORE_OVERHEAD",
    "PACKET_OVERHEAD",
    "PackedStore",
    "available",
    "default_store",
]


#: The C core, or ``None`` where it is not built (no compiler) or not wanted.
_core: Any = _build.optional_extension(_build.PACKED)

#: Whether the C core is built and wanted in this process.
available = _core is not None
#: The packed store's estimate of bytes per packet beyond its key and payload
#: (docs/performance.md: resident memory per queued packet).
PACKET_OVERHEAD: int = _core.PACKET_OVERHEAD if available else 0
#: The estimate of ``default_store``'s store: what the memory cap counts per packet beyond its
#: key and payload, with or without ``--data-dir`` (the log runs on the packed store too:
#: ``persistence/packed_store.py``).
DEFAULT_STORE_OVERHEAD: int = PACKET_OVERHEAD if available else store.PACKET_OVERHEAD

#: The C core's count of a log block's removals by segment (``Journal.count_removals``).
count_removals: Any = _core.count_removals if available else None

_Base: Any = _core.PackedCore if available else object


class PackedStore(_Base):  # type: ignore[misc]
    """The packed store (``store_contract.Store``): ``QueueStore``'s behaviour, in C.

    Beyond the contract, as ``QueueStore``: ``depth``, ``check_invariants``; and for the
    broker: ``pop_reply(queue, output)``, a pop that appends its reply's bytes to ``output``
    (a pop frame), making no object per packet; ``pop_delivery(queue, output)``, the same for
    a subscriber's delivery (nothing written when nothing is selectable);
    ``prefetch_pushes(frames, start)``, which asks the memory for what a batch's pushes will
    read. ``index_bytes(queue)``: what a queue's indexes hold (for tests and tools). And the
    log's hooks (``attach_log``, ``frame_block``, ``frame_into``, ``_load``, ``locate``), which
    ``persistence.packed_store.LoggedPackedStore`` uses.
    """

    def __init__(self, clock: Clock, *, max_pop: int = 0xFFFF) -> None:
        if not available:
            raise RuntimeError("pinpriq._packed is not built (or PINPRIQ_PURE_PYTHON is set)")
        super().__init__(clock, max_pop=max_pop)
        #: ``(seq, time)``: by ``time``, packets up to ``seq`` had been pushed (``note_time``).
        self._time_notes: list[tuple[int, float]] = []

    def note_time(self) -> None:
        """As ``QueueStore.note_time``. O(1) amortised."""
        note_time(self._time_notes, self._seq, self.now())

    def queue_info(self, queue: bytes) -> QueueInfo:
        """What one queue holds (all zero for one that holds nothing). O(levels)."""
        facts = self._facts(queue)
        if facts is None:
            return QueueInfo(0, 0, {}, None, None)
        packets, held, by_priority, oldest_seq, next_deadline, delayed = facts
        now = self.now()
        return QueueInfo(
            packets,
            held,
            by_priority,
            None if oldest_seq is None else age(self._time_notes, oldest_seq, now),
            None if next_deadline is None else max(0.0, next_deadline - now),
            delayed,
        )


def default_store(clock: Clock) -> Store:
    """The in-memory store the server uses: the packed one where it is built and wanted."""
    return PackedStore(clock) if available else QueueStore(clock)
