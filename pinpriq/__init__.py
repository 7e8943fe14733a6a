"""pinpriq: a networked priority queue speaking a small binary protocol."""

from pinpriq.wire import Packet, ProtocolError

__all__ = ["Packet", "ProtocolError"]
__version__ = "0.1.0"
