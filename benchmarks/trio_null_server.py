"""The ceiling a pinpriq server on Trio can reach: pinpriq's own socket loop and codec, no store.

Where ``null_server.py`` measures the load generator (a selectors loop that does not even build
frames), this one measures what ``pinpriq-server`` could do with a store that cost nothing, with
the same socket loop: a connection waiting for its next request waits in ``pinpriq.reactor``'s
one epoll, whose task reads each ready socket, decodes every frame with ``wire.FrameDecoder``,
answers each pop with one stored packet (8-byte key, 16-byte payload; the generator's barrier
queue with ``00 00``, as a real server's empty barrier queue does) written with
``wire.append_reply`` into one buffer per chunk, and writes the chunk's replies with one
``os.write``; what the kernel does not take, the connection's own task sends. Pushes are decoded
and dropped: it keeps no queue.

    python benchmarks/trio_null_server.py [--port 0]

prints ``trio null server listening on 127.0.0.1 port N`` on stderr and serves until SIGTERM or
SIGINT. ``compare_redis.py`` runs it for its ``trio-ceiling-*`` scenarios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from functools import partial

import trio

from pinpriq.bench.dialects import BARRIER_QUEUE
from pinpriq.cli.args import OneLineParser, port_number
from pinpriq.reactor import Reactor
from pinpriq.wire import FrameDecoder, Packet, Pop, append_reply

RECEIVE_SIZE = 64 * 1024  # as server.py
#: The packet every pop gets: the workload's sizes.
STORED = (Packet(bytes(8), bytes(16)),)


class _Connection:
    """One client: its decoder and unsent replies; served by the reactor while it waits for
    its next request, by its own task (``handle``) when the kernel did not take its output."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.fileno = stream.socket.fileno()
        self.decoder = FrameDecoder()
        self.output = bytearray()
        self.ended = False

    def serve_ready(self) -> bool:
        """The reactor's call: read a chunk, answer it, write the answers; whether that was
        all (``False``: the client has gone, or output is left for ``handle`` to send)."""
        try:
            data = os.read(self.fileno, RECEIVE_SIZE)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        decoder, output = self.decoder, self.output
        decoder.feed(data)
        for frame in decoder.decode():
            if frame.__class__ is Pop:
                append_reply(output, () if frame[0] == BARRIER_QUEUE else STORED)
        if not data or decoder.error is not None:
            self.ended = True
            return False
        if output:
            with contextlib.suppress(BlockingIOError):
                del output[: os.write(self.fileno, output)]
        return not output


async def handle(reactor: Reactor, stream: trio.SocketStream) -> None:
    conn = _Connection(stream)
    try:
        while not conn.ended:
            if conn.output:
                await stream.send_all(conn.output)
                del conn.output[:]
            else:
                await reactor.park(conn)
    except (OSError, trio.BrokenResourceError):
        return
    finally:
        await stream.aclose()


async def serve(port: int) -> None:
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    bound = listeners[0].socket.getsockname()[1]
    print(f"trio null server listening on 127.0.0.1 port {bound}", file=sys.stderr, flush=True)
    reactor = Reactor()
    try:
        # Signals through trio, as pinpriq-server's: a KeyboardInterrupt raised wherever the
        # process happens to be (in the reactor's task, say) would end it in a traceback.
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reactor.run)
                nursery.start_soon(trio.serve_listeners, partial(handle, reactor), listeners)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break
    finally:
        reactor.close()


def main(argv: list[str] | None = None) -> None:
    parser: argparse.ArgumentParser = OneLineParser(
        prog="trio_null_server.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--port", type=port_number, default=0)
    args = parser.parse_args(argv)
    trio.run(serve, args.port)


if __name__ == "__main__":
    main()
