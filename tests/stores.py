"""The built-in stores, for tests that run on each: ``store.QueueStore`` (the reference, and
the pure-Python build's store) and, where its C core is built, ``packed.PackedStore`` (the
compiled build's)."""

from __future__ import annotations

from pinpriq import packed
from pinpriq.store import PACKET_OVERHEAD, QueueStore

#: Every in-memory backend built here; not the packed store in the plain-Python run.
BUILT_IN_STORES: list[type[QueueStore]] = [
    QueueStore,
    *([packed.PackedStore] if packed.available else []),
]


def store_id(store_class: type[QueueStore]) -> str:
    return store_class.__name__


def overhead(store: object) -> int:
    """The bytes_held estimate per packet of this store's layout."""
    return packed.PACKET_OVERHEAD if isinstance(store, packed.PackedStore) else PACKET_OVERHEAD
