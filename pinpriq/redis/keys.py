"""Key names for a queue, safe for any queue name and for Redis Cluster.

Queue names are arbitrary bytes (decision 5), and Redis Cluster hashes only what lies between
the first ``{`` and the next ``}`` of a key. So a name is escaped (``%`` -> ``%25``, ``{`` ->
``%7B``, ``}`` -> ``%7D``: reversible, and braces never appear) and its hash tag is
``{q`` + the escaped *base* name + ``}``, where the base is the name less every trailing
``.dead``: a queue and its dead-letter queues (decision 16) share a slot, so moving a group
between them stays one script. The ``q`` keeps the tag non-empty for the empty name (an empty
``{}`` would hash the whole key).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PREFIX", "QueueKeys", "decode_name", "encode_name", "hash_tag", "queue_keys"]

#: Every key of the Redis store starts with this.
PREFIX = b"pq:"
_DEAD = b".dead"


def encode_name(name: bytes) -> bytes:
    """``name`` with ``%``, ``{`` and ``}`` escaped: no braces, and reversible."""
    return name.replace(b"%", b"%25").replace(b"{", b"%7B").replace(b"}", b"%7D")


def decode_name(encoded: bytes) -> bytes:
    """The inverse of ``encode_name``."""
    return encoded.replace(b"%7D", b"}").replace(b"%7B", b"{").replace(b"%25", b"%")


def _base(name: bytes) -> bytes:
    while name.endswith(_DEAD):
        name = name[: -len(_DEAD)]
    return name


class QueueKeys(NamedTuple):
    """The keys of one queue, in the order the scripts take them (``lua.py``), and its
    channel."""

    data: bytes
    selectable: bytes
    groups: bytes
    expiry: bytes
    waiting: bytes
    channel: bytes
    leases: bytes  # hash: lease handle -> the lease (its packets, attempt counts)
    lease_due: bytes  # sorted set: lease handle, scored by its deadline (ms, Redis's clock)
    attempts: bytes  # hash: seq -> how many leases of that packet ended other than by ack
    results: bytes  # hash: pop call id -> its result, until the front end confirms it has it
    delayed: bytes  # hash: seq -> a delayed packet's record (decision 21)
    due: bytes  # sorted set: the delayed packets' seqs by due time (ms, Redis's clock)
    moving: bytes  # hash: move id -> a group on its way to another slot (decision 22)
    moved: bytes  # set: move ids this queue took in (a day), so each is applied once


def hash_tag(name: bytes) -> bytes:
    """The hash tag of queue ``name``'s keys: queues with one tag live in one Cluster slot."""
    return b"{q" + encode_name(_base(name)) + b"}"


def queue_keys(name: bytes) -> QueueKeys:
    """The keys of queue ``name``: ``pq:{q<base>}<name>:<suffix>``, both escaped."""
    stem = PREFIX + hash_tag(name) + encode_name(name) + b":"
    return QueueKeys(
        *(
            stem + suffix
            for suffix in (
                b"d",
                b"s",
                b"g",
                b"x",
                b"w",
                b"c",
                b"l",
                b"L",
                b"a",
                b"r",
                b"y",
                b"Y",
                b"m",
                b"M",
            )
        )
    )


def name_of(data_key: bytes, suffix: bytes = b":d") -> bytes | None:
    """The queue whose ``:d`` key (or key with ``suffix``) this is, or ``None`` if it is not
    one of ours."""
    if not data_key.startswith(PREFIX + b"{q") or not data_key.endswith(suffix):
        return None
    close = data_key.find(b"}")
    if close < 0:
        return None
    return decode_name(data_key[close + 1 : -len(suffix)])
