"""The exceptions pinpriq raises: one base class, each also the built-in it stands for.

Catch ``PinpriqError`` for anything pinpriq raised, or the built-in (``ValueError``,
``TypeError``, ``ConnectionError``, ``TimeoutError``) where that is what the caller means.
Imports nothing, so the codec and every layer above it can use it.
"""

from __future__ import annotations

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "PinpriqConnectionError",
    "PinpriqError",
    "PinpriqTimeoutError",
]


class PinpriqError(Exception):
    """Base class of every error pinpriq raises."""


class ArgumentError(PinpriqError, ValueError):
    """An argument out of range (a field too long, a TTL or port outside its limits). The
    message names the argument; nothing was sent."""


class ArgumentTypeError(PinpriqError, TypeError):
    """An argument of the wrong type (a float TTL, ``None`` for a priority). The message names
    the argument; nothing was sent."""


class PinpriqConnectionError(PinpriqError, ConnectionError):
    """The server could not be reached, or the connection to it broke, was closed, or carried
    something that is not pinpriq.

    The message names the server as ``host:port``; ``host`` and ``port`` hold it too.
    """

    def __init__(self, message: str, host: str, port: int) -> None:
        super().__init__(message)
        self.host = host
        self.port = port


class PinpriqTimeoutError(PinpriqError, TimeoutError):
    """No connection or no answer within the client's timeout; the message names the server."""
