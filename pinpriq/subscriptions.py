"""Who receives which packet: subscriptions and delivery credits (decisions 6 and 7).

Pure and synchronous like the store it draws from: it knows connections only as ``Subscriber``
objects whose ``deliver`` method takes what they are given (the broker's ``Session`` is one), and
never touches a socket.

Theory of operation. A subscriber *waits* while it has a credit, at least one subscription, and
is not paused (its connection pauses it while its unsent output is past a bound, so that a client
that stops reading leaves further packets queued for others instead of in its send buffer);
it is stamped with a store-wide counter when it starts waiting, and restamped after each
delivery, so a smaller stamp means it has waited longer. Invariant, true whenever no method is
running: no waiting subscriber has a selectable packet in any queue it subscribes to. Each
method restores it:

* ``offer(queue)`` after a push: the longest-waiting subscriber of that queue gets one pop,
  repeated while the queue still has something selectable and someone waits on it;
* ``ready`` and ``subscribe`` may give one subscriber something to take: it takes the best
  packet across its queues while it has credits. No one else can be waiting for those packets,
  by the invariant, so first come, first served holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sized

from mypy_extensions import mypyc_attr
from sortedcontainers import SortedDict

from pinpriq.store_contract import Store

__all__ = ["Subscriber", "Subscriptions"]


# Compiled by mypyc where a C compiler is present (setup.py); tests subclass both classes in
# interpreted code, which mypyc refuses unless told.
@mypyc_attr(allow_interpreted_subclasses=True)
class Subscriber:
    """One connection's subscriptions and credits. Subclasses say where deliveries go."""

    __slots__ = ("credits", "paused", "queues", "stamp", "take_from")

    def __init__(self) -> None:
        self.queues: set[bytes] = set()
        self.credits = 0
        self.stamp = 0  # 0 while not waiting
        #: Set by the owner (even from inside ``deliver``) to receive nothing for now, credits
        #: kept; ``Subscriptions.resume`` clears it.
        self.paused = False
        #: How this subscriber takes from a queue: ``None`` for the store's pop; a leased
        #: subscriber (decision 17) takes a lease instead, and a session on the packed store
        #: pops straight into its output (returning how many packets it wrote). Whatever it
        #: returns, empty, 0 or None if nothing was selectable, is what ``deliver`` is given.
        self.take_from: Callable[[bytes], Sized | int | None] | None = None

    def deliver(self, packets: Sized | int) -> None:
        """Take one delivery, a credit already spent: a popped packet and its key group, or
        what ``take_from`` returned."""
        raise NotImplementedError


@mypyc_attr(allow_interpreted_subclasses=True)
class Subscriptions:
    """The subscribers of one store."""

    def __init__(self, store: Store) -> None:
        self._store = store
        #: queue -> waiting subscribers of that queue, by stamp (longest waiting first). Read
        #: by the server's hot path to skip ``offer`` when nobody waits on a queue.
        self.waiting_queues: dict[bytes, SortedDict] = {}
        #: queue -> how many subscribers it has, waiting or not (what an operator reads).
        self.subscribers: dict[bytes, int] = {}
        #: Subscribers with at least one subscription.
        self.subscriber_count = 0
        self._stamp = 0

    def waiting(self, queue: bytes) -> list[Subscriber]:
        """Subscribers waiting on a queue, longest waiting first."""
        waiters = self.waiting_queues.get(queue)
        return list(waiters.values()) if waiters else []

    def subscribe(self, sub: Subscriber, queue: bytes) -> None:
        """Add a queue to a subscriber's set; delivers at once if it holds something."""
        if queue in sub.queues:
            return
        if not sub.queues:
            self.subscriber_count += 1
        sub.queues.add(queue)
        self.subscribers[queue] = self.subscribers.get(queue, 0) + 1
        if sub.stamp:
            self._waiters(queue)[sub.stamp] = sub
        self._settle(sub)

    def unsubscribe(self, sub: Subscriber, queue: bytes) -> None:
        """Drop a queue from a subscriber's set; its credits stay (decision 7)."""
        if queue not in sub.queues:
            return
        sub.queues.remove(queue)
        self._count_leaving(queue)
        if not sub.queues:
            self.subscriber_count -= 1
        if sub.stamp:
            self._leave(queue, sub.stamp)
            if not sub.queues:
                sub.stamp = 0

    def ready(self, sub: Subscriber, credits: int = 1) -> None:
        """Grant delivery credits (each 0x41 byte is one); delivers what is already there."""
        sub.credits += credits
        self._settle(sub)

    def pause(self, sub: Subscriber) -> None:
        """Pause a subscriber from outside a delivery (its connection holds too much unsent
        output for the server's client memory budget): it stops waiting, credits kept, and
        receives nothing until ``resume``."""
        sub.paused = True
        if sub.stamp:
            for queue in sub.queues:
                self._leave(queue, sub.stamp)
            sub.stamp = 0

    def resume(self, sub: Subscriber) -> None:
        """Unpause a subscriber; delivers what is already there."""
        sub.paused = False
        self._settle(sub)

    def remove(self, sub: Subscriber) -> None:
        """Forget a subscriber whose connection closed: its subscriptions and credits go."""
        if sub.stamp:
            for queue in sub.queues:
                self._leave(queue, sub.stamp)
        for queue in sub.queues:
            self._count_leaving(queue)
        if sub.queues:
            self.subscriber_count -= 1
        sub.queues.clear()
        sub.credits = 0
        sub.stamp = 0

    def offer(self, queue: bytes) -> None:
        """Serve a queue's waiters after a selectable packet was pushed to it."""
        # Look the waiters up afresh each round: serving the last waiter deletes the queue's
        # SortedDict and, if it still has credits, refiles it in a new one.
        while waiters := self.waiting_queues.get(queue):
            _, sub = waiters.peekitem(0)
            if not self._settle(sub, once=True):
                break

    def _settle(self, sub: Subscriber, *, once: bool = False) -> bool:
        """Deliver to ``sub`` while it has credit and something selectable, then file it as
        waiting or not. Returns whether anything was delivered."""
        served = False
        take = sub.take_from or self._store.pop
        while sub.credits and sub.queues and not sub.paused and not (once and served):
            if len(sub.queues) == 1:  # the common case: nothing to rank, just pop
                packets = take(next(iter(sub.queues)))
                if not packets:
                    break
            else:
                queue = self._best_queue(sub.queues)
                if queue is None:
                    break
                packets = take(queue)
                if not packets:  # the best packet expired between peek and pop: rank again
                    continue
            sub.credits -= 1
            served = True
            sub.deliver(packets)
        self._file(sub, served)
        return served

    def _file(self, sub: Subscriber, served: bool) -> None:
        """File ``sub`` as waiting or not: it waits while it has credit, queues and is not
        paused, stamped by when it began to wait; one just ``served`` waits anew, last in line
        (first come, first served). A store whose deliveries come later (Redis) files the same
        way after each of them."""
        waiting = bool(sub.credits and sub.queues and not sub.paused)
        if sub.stamp and (served or not waiting):
            for q in sub.queues:
                self._leave(q, sub.stamp)
            sub.stamp = 0
        if waiting and not sub.stamp:
            self._stamp += 1
            sub.stamp = self._stamp
            for q in sub.queues:
                self._waiters(q)[sub.stamp] = sub

    def _best_queue(self, queues: set[bytes]) -> bytes | None:
        """The queue whose next pop is best (lowest prio, then newest); ``None`` if none."""
        best_rank: tuple[int, int] | None = None
        best_queue = None
        for queue in queues:
            rank = self._store.peek_rank(queue)
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_queue = rank, queue
        return best_queue

    def _waiters(self, queue: bytes) -> SortedDict:
        waiters = self.waiting_queues.get(queue)
        if waiters is None:
            waiters = self.waiting_queues[queue] = SortedDict()
        return waiters

    def _count_leaving(self, queue: bytes) -> None:
        left = self.subscribers[queue] - 1
        if left:
            self.subscribers[queue] = left
        else:
            del self.subscribers[queue]

    def _leave(self, queue: bytes, stamp: int) -> None:
        waiters = self.waiting_queues[queue]
        del waiters[stamp]
        if not waiters:
            del self.waiting_queues[queue]
