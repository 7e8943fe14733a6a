"""pinpriq: a networked priority queue speaking a small binary protocol.

The Trio client (``PinpriqClient``, ``Subscription``, ``Lease``, ``LeasedSubscription``) is
imported on first use, so that ``import pinpriq`` and the blocking client do not load trio.
"""

from typing import TYPE_CHECKING, Any

from pinpriq import _build

# Before anything imports a module that may be compiled: once loaded, a module stays what it is.
if _build.pure_python_requested():
    _build.force_pure_python()

from pinpriq.blocking import (
    BlockingLease,
    BlockingLeasedSubscription,
    BlockingPinpriqClient,
    BlockingSubscription,
)
from pinpriq.errors import (
    ArgumentError,
    ArgumentTypeError,
    PinpriqConnectionError,
    PinpriqError,
    PinpriqTimeoutError,
)
from pinpriq.wire import Packet, ProtocolError

if TYPE_CHECKING:
    from pinpriq.client import Lease, LeasedSubscription, PinpriqClient, Subscription

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BlockingLease",
    "BlockingLeasedSubscription",
    "BlockingPinpriqClient",
    "BlockingSubscription",
    "Lease",
    "LeasedSubscription",
    "Packet",
    "PinpriqClient",
    "PinpriqConnectionError",
    "PinpriqError",
    "PinpriqTimeoutError",
    "ProtocolError",
    "Subscription",
]
__version__ = "0.1.0"

_TRIO_CLIENT = {"PinpriqClient", "Subscription", "Lease", "LeasedSubscription"}


def __getattr__(name: str) -> Any:
    if name in _TRIO_CLIENT:
        from pinpriq import client

        return getattr(client, name)
    raise AttributeError(f"module 'pinpriq' has no attribute {name!r}")
