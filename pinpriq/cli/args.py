"""Argument types and the parser shared by pinpriq's command lines (server, client, bench).

Each type raises ``argparse.ArgumentTypeError`` with a message that names the value, so a bad
argument is one line from ``OneLineParser``.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from decimal import Decimal
from typing import NoReturn

__all__ = [
    "OneLineParser",
    "byte_size",
    "client_port",
    "duration_ms",
    "http_port",
    "int_in",
    "port_number",
    "positive",
    "seconds",
    "seconds_at_most",
]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``prog: error: message (see --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _port(text: str, low: int) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: not a number") from None
    if not low <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {port}: must be {low}..65535")
    return port


def port_number(text: str) -> int:
    """An argparse type: a TCP port to listen on, 0..65535 (0: any free port)."""
    return _port(text, 0)


def client_port(text: str) -> int:
    """An argparse type: a TCP port to connect to, 1..65535."""
    return _port(text, 1)


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "k": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tib": 1024**4,
}


def byte_size(text: str) -> int:
    """An argparse type: a size in bytes, such as ``512MiB``, ``2GB`` or ``65536``.

    KiB/MiB/GiB/TiB (and K/M/G/T) are powers of 1024; kB/MB/GB/TB powers of 1000; case does not
    matter; a fraction is allowed (``1.5GiB``).
    """
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number) :].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use e.g. 512MiB, 2GB or 65536")
    return int(value * _SIZE_UNITS[unit])


#: Milliseconds per unit of a duration; no unit is milliseconds.
_DURATION_UNITS = {"": 1, "ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ms|s|m|h|d)?")


def duration_ms(most: int, most_means: str, *, least: int = 0) -> Callable[[str], int]:
    """An argparse type: a duration such as ``500ms``, ``10s``, ``5m``, ``2h``, ``1.5d``, or a
    bare number of milliseconds (``60000``), as whole milliseconds in ``least..most``;
    ``most_means`` says ``most`` in words for the error."""

    def parse(text: str) -> int:
        match = _DURATION.fullmatch(text.strip())
        if match is None:
            raise argparse.ArgumentTypeError(
                f"invalid duration {text!r}: use e.g. 500ms, 10s, 5m, 2h, 1d, or a number of "
                "milliseconds"
            )
        number, unit = match.groups()
        # Decimal, not float: 0.3s is 300 ms exactly, and a long number stays exact.
        value = Decimal(number) * _DURATION_UNITS[unit or ""]
        if value != value.to_integral_value():
            raise argparse.ArgumentTypeError(f"{text} is not a whole number of milliseconds")
        if value > most:
            raise argparse.ArgumentTypeError(f"{text} is more than {most_means} ({most} ms)")
        if value < least:
            raise argparse.ArgumentTypeError(f"{text} is less than {least} ms")
        return int(value)

    return parse


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``low..high`` (no upper bound if ``high`` is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
        if high is None and value < low:
            raise argparse.ArgumentTypeError(f"{value} is less than {low}")
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low}..{high}")
        return value

    return parse


def positive(unit: str) -> Callable[[str], float]:
    """An argparse type: a positive, finite number of ``unit`` (messages name the unit)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number of {unit} {text!r}") from None
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"{text} is not a positive number of {unit}")
        return value

    return parse


#: An argparse type: a positive number of seconds.
seconds = positive("seconds")


def http_port(text: str) -> int | None:
    """An argparse type: a port to listen on, or ``off`` (``None``) for no listener."""
    return None if text.strip().lower() == "off" else _port(text, 0)


def seconds_at_most(most: float) -> Callable[[str], float]:
    """An argparse type: a positive number of seconds, at most ``most``."""

    def parse(text: str) -> float:
        value = seconds(text)
        if value > most:
            raise argparse.ArgumentTypeError(f"{text} is more than {most:g} seconds")
        return value

    return parse
