"""Leases on the Redis store (decisions 13-19): the lease table lives in Redis.

A lease is a record in its queue's ``:l`` hash under a *handle* (this front end's id and a
counter), with its deadline in the queue's ``:L`` sorted set, on Redis's clock; ``lua.py``'s
reserve, lease_op and lease_sweep functions make, change and end them atomically, and a group
that used up its attempts goes to the dead-letter queue (same slot) in the same script. So a
lease outlives the front end that made it: whichever front end sweeps the queue after the
deadline (its timer, a reserve of the queue, or the periodic scan) sends it back.

What stays here is what may be lost with the front end: each connection's wire ids (``Holder``)
mapped to handles, and counters of this front end's lease traffic. ``RedisLeases`` answers the
broker's ``Leases`` calls synchronously with the results ``RedisStore.run_leases`` got from
Redis just before ``Session.receive`` applied the frame; the broker's own timer never runs for
them (their ``due`` is infinite: the store's ``lease_loop`` keeps time on Redis's clock). It
imports nothing of the store: a closed connection's leases go to the ``release_later`` it was
given.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from pinpriq.leases import Holder, Lease, Leases
from pinpriq.store_contract import Store

__all__ = ["RedisLease", "RedisLeases"]


class RedisLease(Lease):
    """One lease as this front end knows it: its wire id, queue, handle and first packets."""

    __slots__ = ("handle",)

    def __init__(
        self,
        lease_id: int,
        holder: Holder,
        queue: bytes,
        packets: Sequence[Any],
        attempt: int,
        handle: bytes,
    ) -> None:
        self.lease_id = lease_id
        self.holder = holder
        self.queue = queue
        self.packets = packets
        self.attempt = attempt
        self.due = math.inf  # kept in Redis: never the broker's timer
        self.handle = handle


class RedisLeases(Leases):
    """This front end's view of the leases in Redis."""

    def __init__(
        self,
        store: Store,
        *,
        default_ms: int,
        max_deliveries: int,
        release_later: Callable[[list[tuple[bytes, bytes]]], None],
    ) -> None:
        """``release_later`` takes the leases of a closed connection, ``(queue, handle)``
        each, for the store to release in Redis (this module knows no Redis)."""
        super().__init__(store, default_ms=default_ms, max_deliveries=max_deliveries)
        self.release_later = release_later
        #: What Redis answered to the lease frames each connection's ``receive`` is applying
        #: (by its holder), in order: a reserve's reply (or ``None``), or an ack's, release's
        #: or touch's liveness.
        self.results: dict[Holder, deque[Any]] = {}
        #: Live leases made here, by handle: a sweep that ends one forgets its wire id.
        self.mine: dict[bytes, RedisLease] = {}
        self.packets_leased = 0

    # -- what the session calls, with ``results`` ready ------------------------------------

    def reserve(self, holder: Holder, queue: bytes, lease_ms: int) -> Lease | None:
        answers = self.results.get(holder)
        reply = answers.popleft() if answers else None
        if reply is None:
            return None
        return self.made(holder, queue, reply)

    def made(self, holder: Holder, queue: bytes, reply: tuple[bytes, int, list[Any]]) -> Lease:
        """File a lease RESERVE made under ``holder``'s next wire id."""
        handle, attempt, packets = reply
        holder.last_id += 1
        lease = RedisLease(holder.last_id, holder, queue, packets, attempt, handle)
        self._file(lease)
        self.mine[handle] = lease
        return lease

    def ack(self, holder: Holder, lease_id: int) -> bool:
        lease = holder.leases.get(lease_id)
        live = self._answer(holder, lease_id, ends=True)
        if live and lease is not None:
            self._acked += len(lease.packets)
        return live

    def release(self, holder: Holder, lease_id: int, delay_ms: int) -> bool:
        return self._answer(holder, lease_id, ends=True)

    def touch(self, holder: Holder, lease_id: int, lease_ms: int) -> bool:
        return self._answer(holder, lease_id, ends=False)

    def close(self, holder: Holder) -> None:
        """The connection closed: its leases go back now (the store's ``lease_loop`` runs the
        scripts; until then, and if this front end dies first, their deadlines hold)."""
        self.results.pop(holder, None)
        closing = []
        for lease in list(holder.leases.values()):
            assert isinstance(lease, RedisLease)
            self.forget(lease)
            closing.append((lease.queue, lease.handle))
        if closing:
            self.release_later(closing)

    # -- time is the store's: nothing for the broker's timer ------------------------------

    def soonest(self) -> float:
        return math.inf

    def next_deadline(self) -> float | None:
        return None

    def expire(self) -> None:
        """Nothing: ``RedisStore.lease_loop`` sweeps due leases on Redis's clock."""

    # -- inside ----------------------------------------------------------------------------

    def counted(self, back: int, dead: int, dropped: int) -> None:
        """Packets a script sent back, to the dead, or dropped."""
        self._redelivered += back
        self._dead_lettered += dead
        self._dropped += dropped

    def forget(self, lease: RedisLease) -> None:
        """The lease is over (or no longer this front end's to answer for): out of its
        holder and the counts, once (a sweep and a frame may both end it)."""
        if self.mine.pop(lease.handle, None) is not None:
            self._close(lease)

    def _answer(self, holder: Holder, lease_id: int, *, ends: bool) -> bool:
        answers = self.results.get(holder)
        live: bool = answers.popleft() if answers else False
        lease = holder.leases.get(lease_id)
        if lease is not None and (ends or not live):
            assert isinstance(lease, RedisLease)
            self.forget(lease)
        if not live:
            self._unknown += 1
        return live
