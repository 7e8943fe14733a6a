"""What clients make the server hold, counted against one budget (``--max-client-memory``).

A connection makes the server hold two kinds of bytes that the store's cap does not count:
an incomplete frame (up to 196,615 bytes) and output the client has not read yet (up to the
output bound, 4 MiB). One connection is bounded; a thousand are not. This ledger adds them up,
as Redis 7's ``maxmemory-clients`` does, and picks which connections to close when the total
passes the budget. It knows connections only as keys, and does no I/O: the server tells it what
each connection holds and does the closing.

Theory of operation:

* The server reports a connection's **input** (the bytes of its incomplete frame) after each
  read, only when it changes, so a client that sends whole frames costs nothing; and its
  **output** when a write could not be handed to the kernel at once (the slow path), so a
  client that reads its replies costs nothing either.
* Past the budget, the connections holding the largest incomplete frames are closed until the
  total is back under ``LOW_WATER_FRACTION`` of the budget (so a stream of slow clients closes
  a few at a time, not one per read). A connection holding unsent output is never closed for
  the budget: that output carries packets already taken from the store, and closing would lose
  them. The server stops reading such connections instead, until their output drains.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["LOW_WATER_FRACTION", "MIN_DEFAULT_BUDGET", "ClientMemory", "default_budget"]

#: Closing stops once the total is under this fraction of the budget.
LOW_WATER_FRACTION = 0.9
#: The smallest default budget: room for about 160 maximum-size frames in flight at once.
MIN_DEFAULT_BUDGET = 32 * 1024 * 1024
#: The default budget of a server whose store has no cap.
UNCAPPED_DEFAULT_BUDGET = 256 * 1024 * 1024


#: What the ledger knows a connection as.
Conn = TypeVar("Conn", bound=Hashable)


def default_budget(max_memory: int) -> int:
    """The default client budget for a store capped at ``max_memory`` bytes (0: no cap): a
    quarter of the cap, at least ``MIN_DEFAULT_BUDGET``; 256 MiB with no cap."""
    if not max_memory:
        return UNCAPPED_DEFAULT_BUDGET
    return max(max_memory // 4, MIN_DEFAULT_BUDGET)


class ClientMemory(Generic[Conn]):
    """Bytes held for each connection and in all, against ``budget`` (0: no budget)."""

    def __init__(self, budget: int) -> None:
        self.budget: float = budget or math.inf
        self.low_water = self.budget * LOW_WATER_FRACTION
        #: Bytes of incomplete frames, all connections.
        self.input = 0
        #: Bytes of unsent output, all connections.
        self.output = 0
        self._input: dict[Conn, int] = {}  # connections holding input, and how much
        self._output: dict[Conn, int] = {}

    @property
    def held(self) -> int:
        return self.input + self.output

    @property
    def over(self) -> bool:
        """Whether the total is past the budget."""
        return self.held > self.budget

    def hold_input(self, conn: Conn, size: int) -> None:
        """``conn`` now holds an incomplete frame of ``size`` bytes (0: none)."""
        self.input += size - self._input.get(conn, 0)
        if size:
            self._input[conn] = size
        else:
            self._input.pop(conn, None)

    def hold_output(self, conn: Conn, size: int) -> None:
        """``conn`` now holds ``size`` bytes of output not handed to the kernel (0: none)."""
        self.output += size - self._output.get(conn, 0)
        if size:
            self._output[conn] = size
        else:
            self._output.pop(conn, None)

    def input_of(self, conn: Conn) -> int:
        return self._input.get(conn, 0)

    def output_of(self, conn: Conn) -> int:
        return self._output.get(conn, 0)

    def release(self, conn: Conn) -> None:
        """``conn`` is gone, or going: it holds nothing from now on."""
        self.hold_input(conn, 0)
        self.hold_output(conn, 0)

    def to_close(self) -> list[tuple[Conn, int]]:
        """When over the budget: the connections to close, each with the bytes of its
        incomplete frame, largest first, enough to bring the total under the low-water mark
        if closing can. Connections holding output are never among them. Releases them.

        O(n log n) in the connections holding input, and only called past the budget."""
        if not self.over:
            return []
        chosen = []
        candidates = sorted(
            ((size, conn) for conn, size in self._input.items() if conn not in self._output),
            key=lambda item: item[0],
            reverse=True,
        )
        for size, conn in candidates:
            if self.held < self.low_water:
                break
            chosen.append((conn, size))
            self.release(conn)
        return chosen
