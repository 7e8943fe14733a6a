"""Deliveries on the Redis store: subscribers on any front end, each packet at most once.

Each front end keeps its own subscribers exactly as ``subscriptions.Subscriptions`` does
(credits, stamps, first come first served among them); what differs is where a delivery's pop
runs and who hears of a push:

* A delivery is one pop script, awaited. Whoever's script reaches Redis first takes the group,
  so a packet goes to at most one subscriber across all front ends.
* While a front end has subscribers waiting on a queue, it keeps the queue's ``:w`` key alive
  (30 s, refreshed every 10 s) and listens on the queue's channel; a push of a selectable
  packet publishes that channel only while ``:w`` exists. A waiting front end is woken by the
  message, not by polling: an idle queue costs Redis nothing but the refresh.
* The key and the channel are in place before the first pop attempt of a new waiter, so a push
  landing between "nothing there" and "waiting" still wakes it.
* Pushes and subscribes on this front end are served before the pusher's next frame is read
  (the reader awaits ``serve``), as on the built-in store. A push on another front end is
  served when the message arrives: a millisecond or so on one host.
* A group popped for a subscriber that meanwhile unsubscribed, paused or ran out of credit goes
  back to its queue unchanged (prio, push order, deadline): the pop and the put-back are two
  scripts, so between them another subscriber may take a newer packet first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from coredis.exceptions import ResponseError

from pinpriq.redis.direct import DirectSubscriber
from pinpriq.redis.store import _TRANSIENT, Popped, RedisStore, busy
from pinpriq.subscriptions import Subscriber, Subscriptions

__all__ = ["RedisSubscriptions"]

log = logging.getLogger("pinpriq.redis")

#: How long a queue's ``:w`` key lives, and how often a front end with waiters renews it.
WAITING_TTL_MS = 30_000
REFRESH_SECONDS = 10.0


def _nothing() -> None:
    """The default ``flush``."""


class RedisSubscriptions(Subscriptions):
    """The subscribers of one front end on a ``RedisStore``."""

    def __init__(self, store: RedisStore, subscriber: DirectSubscriber | None = None) -> None:
        """``subscriber``: a direct pub/sub connection (standalone Redis) to listen on instead
        of coredis's (``direct.py`` says why)."""
        super().__init__(store)  # its synchronous pops are never called
        self.redis = store
        self._subscriber = subscriber
        #: Called after deliveries were made, to write them (the server sets it).
        self.flush: Callable[[], None] = _nothing
        self._due_subs: dict[Subscriber, None] = {}
        self._due_queues: dict[bytes, None] = {}
        self._watched: dict[bytes, bytes] = {}  # channel -> queue, for queues we listen to
        self._to_watch: dict[bytes, None] = {}
        self._serving = trio.Lock()
        self._wake = trio.Event()
        self._pubsub: Any = None
        # The store times the delayed packets of queues waited on here, whoever pushed them,
        # and tells when some entered through this front end.
        store.waited = self.waiting_queues
        store.on_arrived = self._arrived

    # -- the synchronous half: what the broker calls -----------------------------------------

    def _settle(self, sub: Subscriber, *, once: bool = False) -> bool:
        """File ``sub`` as waiting or not, and note it for ``serve``; delivers nothing now."""
        self._file(sub, False)
        if sub.stamp:
            self._due_subs[sub] = None
            # Served by the reader right after its frame, or, when the call came from
            # elsewhere (a paused subscriber resumed as its output drained), by the dispatcher.
            self._wake.set()
        return False

    def offer(self, queue: bytes) -> None:
        """A push to a queue with waiters here: ``serve`` will pop it for them."""
        self._due_queues[queue] = None

    def _arrived(self, queue: bytes) -> None:
        """Packets entered ``queue`` outside a batch (delayed ones fell due, a move): served by
        the dispatcher if someone here waits on it."""
        if queue in self.waiting_queues:
            self._due_queues[queue] = None
            self._wake.set()

    @property
    def due(self) -> bool:
        """Whether ``serve`` has anything to do."""
        return bool(self._due_subs or self._due_queues)

    def _file(self, sub: Subscriber, served: bool) -> None:
        """Filed as on the built-in store; and the queues of a waiting subscriber are
        listened to (``_watch_new``)."""
        super()._file(sub, served)
        if sub.stamp:
            for queue in sub.queues:
                if self.redis.keys(queue).channel not in self._watched:
                    self._to_watch[queue] = None

    # -- the asynchronous half ---------------------------------------------------------------

    async def serve(self) -> None:
        """Deliver to every subscriber noted since the last call, and to the waiters of every
        queue offered, while they have credits and their queues something selectable."""
        if not self.due:
            return
        async with self._serving:
            while self.due:
                await self._watch_new()
                subs, self._due_subs = self._due_subs, {}
                for sub in sorted(subs, key=lambda s: s.stamp):
                    while await self._serve_one(sub):
                        pass
                queues, self._due_queues = self._due_queues, {}
                for queue in queues:
                    while waiters := self.waiting_queues.get(queue):
                        _, sub = waiters.peekitem(0)
                        if not await self._serve_one(sub):
                            break
                # Early pops no delivery took (``_heard``) but for queues due next round: their
                # packets go back, offered again.
                returned = await self.redis.drop_early(keep=self._due_queues)
                self._due_queues.update(dict.fromkeys(returned))
        self.flush()

    async def _serve_one(self, sub: Subscriber) -> bool:
        """One delivery to ``sub`` if it waits and its queues hold something; returns whether
        another might follow (one was made, and the queue it came from holds more)."""
        for _ in range(3):  # ranks read, then another front end's pop: rank again, briefly
            if not (sub.credits and sub.queues and not sub.paused):
                return False
            queue = await self._ranked_best(sub)
            if queue is None:
                return False
            if getattr(sub, "leased", False):  # a leased subscriber (decision 17)
                reply, more = await self.redis.reserve_for_delivery(queue, sub.lease_ms)  # type: ignore[attr-defined]
                if reply is not None:
                    handed = await self._hand_over_lease(sub, queue, reply)
                    return handed and (more or len(sub.queues) > 1)
                if len(sub.queues) == 1:
                    return False
                continue
            packets, more = await self.redis.pop_for_delivery(queue)
            if packets:
                handed = await self._hand_over(sub, queue, packets)
                return handed and (more or len(sub.queues) > 1)
            if len(sub.queues) == 1:
                return False  # nothing there: no point asking again
        return False

    async def _ranked_best(self, sub: Subscriber) -> bytes | None:
        queues = list(sub.queues)
        if len(queues) == 1:
            return queues[0]
        ranks = await self.redis.ranks(queues)
        ranked = [(rank, queue) for rank, queue in zip(ranks, queues, strict=True) if rank]
        return min(ranked)[1] if ranked else None

    async def _hand_over(self, sub: Subscriber, queue: bytes, packets: list[Popped]) -> bool:
        if not (sub.credits and queue in sub.queues and not sub.paused):
            # It stopped waiting while the pop ran: put the group back as it was.
            await self.redis.put_back(queue, packets)
            self._due_queues[queue] = None
            return False
        sub.credits -= 1
        sub.deliver([(p.key, p.payload) for p in packets])
        self._file(sub, True)
        self.flush()
        return True

    async def _hand_over_lease(
        self, sub: Subscriber, queue: bytes, reply: tuple[bytes, int, list[Any]]
    ) -> bool:
        leases = self.redis.leases
        assert leases is not None
        if not (sub.credits and queue in sub.queues and not sub.paused) or sub.closed:  # type: ignore[attr-defined]
            # It stopped waiting while the reserve ran: the group goes back, not an attempt.
            await self.redis.unreserve(queue, reply[0])
            self._due_queues[queue] = None
            return False
        sub.credits -= 1
        sub.deliver(leases.made(sub.holder, queue, reply))  # type: ignore[attr-defined]
        self._file(sub, True)
        self.flush()
        return True

    async def _watch_new(self) -> None:
        """Listen to the channels of queues that just got waiters, then mark them waited on."""
        if not self._to_watch:
            return
        queues, self._to_watch = list(self._to_watch), {}
        channels = [self.redis.keys(q).channel for q in queues]
        for queue, channel in zip(queues, channels, strict=True):
            self._watched[channel] = queue
        try:
            if self._pubsub is not None:
                await self._pubsub.subscribe(*channels)
            await self._mark_waiting(queues, due_times=True)
        except (*_TRANSIENT, ResponseError) as error:
            if isinstance(error, ResponseError) and not busy(error):
                raise
            # Redis went away (or is busy with a long script): the subscription is remade with
            # every watched channel, and the marks renewed (``_refresh_loop``), once it is
            # back; pops wait for it meanwhile.
            log.warning("cannot mark queues waited on in Redis now (%s); retrying", error)

    async def _mark_waiting(self, queues: list[bytes], *, due_times: bool = False) -> None:
        """Mark ``queues`` waited on (pushes then publish); with ``due_times``, time the
        promotion of the delayed packets they already hold (later ones are published)."""
        async with self.redis.client.pipeline(transaction=False) as pipe:
            for queue in queues:
                pipe.set(self.redis.keys(queue).waiting, b"1", px=WAITING_TTL_MS)
            heads = [
                pipe.zrange(self.redis.keys(queue).due, 0, 0, withscores=True)
                for queue in (queues if due_times else ())
            ]
        for queue, head in zip(queues, heads, strict=False):
            if first := await head:
                self.redis.schedule_sweep(queue, float(first[0][1]))

    # -- background tasks --------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen for pushes on other front ends, serve what they make due, and keep the
        waiting marks alive; until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._refresh_loop)
            nursery.start_soon(self._dispatch_loop)
            await nursery.start(self._listen_loop)
            task_status.started()

    async def _listen_loop(self, task_status: trio.TaskStatus[None]) -> None:
        if self._subscriber is not None:
            await self._listen_direct(self._subscriber, task_status)
            return
        started = False
        while True:
            try:
                async with self.redis.client.pubsub() as pubsub:
                    self._pubsub = pubsub
                    await pubsub.subscribe(b"pq:-", *self._watched)  # never empty
                    # Whatever was pushed while we were not listening: look again.
                    self._due_queues.update(dict.fromkeys(self.waiting_queues))
                    if not started:
                        started = True
                        task_status.started()
                    self._wake.set()
                    async for message in pubsub:
                        if message["type"] == "message":
                            self._heard(message["channel"], message["data"])
            except _TRANSIENT as error:
                log.warning("lost the Redis subscription (%s); resubscribing", error)
                self._pubsub = None
                await trio.sleep(0.1)

    async def _listen_direct(
        self, subscriber: DirectSubscriber, task_status: trio.TaskStatus[None]
    ) -> None:
        """``_listen_loop`` on a direct connection: the task that reads a message notes it."""
        started = False

        def subscribed() -> None:
            nonlocal started
            self._pubsub = subscriber
            # Whatever was pushed while we were not listening: look again.
            self._due_queues.update(dict.fromkeys(self.waiting_queues))
            self._wake.set()
            if not started:
                started = True
                task_status.started()

        while True:
            try:
                await subscriber.run(lambda: [b"pq:-", *self._watched], self._heard, subscribed)
            except _TRANSIENT as error:
                log.warning("lost the Redis subscription (%s); resubscribing", error)
                self._pubsub = None
                await trio.sleep(0.1)

    def _heard(self, channel: bytes, data: bytes) -> None:
        """A message on a queue's channel: packets entered it (empty), or delayed packets were
        pushed to it, due at the time it carries (ms on Redis's clock), which this front end
        times too, so that its waiters get them even if their pusher dies first."""
        queue = self._watched.get(channel)
        if queue is None or queue not in self.waiting_queues:
            return
        if data:
            self.redis.schedule_sweep(queue, float(data))
            return
        self._due_queues[queue] = None
        self._wake.set()
        # Its first waiter's delivery will pop this queue (it waits on no other, so nothing
        # to rank first): send that pop now, from this task (``RedisStore.pop_early``).
        _, first = self.waiting_queues[queue].peekitem(0)
        if len(first.queues) == 1 and not getattr(first, "leased", False):
            self.redis.pop_early(queue)

    async def _dispatch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            await self.serve()

    async def _refresh_loop(self) -> None:
        """Every ``REFRESH_SECONDS``: renew the marks of queues still waited on here, forget the
        channels of queues no longer waited on, and look again at the waited ones (a safety
        net for a message lost while the subscription was being remade)."""
        while True:
            await trio.sleep(REFRESH_SECONDS)
            waited = list(self.waiting_queues)
            stale = [c for c, q in self._watched.items() if q not in self.waiting_queues]
            try:
                if waited:
                    await self._mark_waiting(waited)
                if stale and self._pubsub is not None:
                    for channel in stale:
                        del self._watched[channel]
                    await self._pubsub.unsubscribe(*stale)
            except (*_TRANSIENT, ResponseError) as error:
                if isinstance(error, ResponseError) and not busy(error):
                    raise
                log.warning("cannot renew waiting marks in Redis (%s); retrying", error)
                continue
            self._due_queues.update(dict.fromkeys(waited))
            self._wake.set()
