"""pinpriq: a networked priority queue speaking a small binary protocol."""

from pinpriq.blocking import BlockingPinpriqClient, BlockingSubscription
from pinpriq.client import PinpriqClient, PinpriqConnectionError, Subscription
from pinpriq.wire import Packet, ProtocolError

__all__ = [
    "BlockingPinpriqClient",
    "BlockingSubscription",
    "Packet",
    "PinpriqClient",
    "PinpriqConnectionError",
    "ProtocolError",
    "Subscription",
]
__version__ = "0.1.0"
