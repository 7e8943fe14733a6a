"""The ceiling a pinpriq server on Trio can reach: pinpriq's own socket loop and codec, no store.

Where ``null_server.py`` measures the load generator (a selectors loop that does not even build
frames), this one measures what ``pinpriq-server`` could do with a store that cost nothing: each
connection is one Trio task that reads the socket the way ``server.py`` does (a direct read,
``wait_readable`` only when nothing is there, a checkpoint after a chunk read without waiting),
decodes every frame with ``wire.FrameDecoder``, answers each pop with one stored packet (8-byte
key, 16-byte payload; the generator's barrier queue with ``00 00``, as a real server's empty
barrier queue does) written with ``wire.append_reply`` into one buffer per chunk, and writes the
chunk's replies with one ``os.write``. Pushes are decoded and dropped: it keeps no queue.

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

import trio

from pinpriq.bench.dialects import BARRIER_QUEUE
from pinpriq.cli.args import OneLineParser, port_number
from pinpriq.wire import FrameDecoder, Packet, Pop, append_reply

RECEIVE_SIZE = 256 * 1024  # as server.py
#: The packet every pop gets: the workload's sizes.
STORED = (Packet(bytes(8), bytes(16)),)


async def _read(fd: int) -> tuple[bytes, bool]:
    """The next chunk (``b""`` at the end), and whether it was there without a wait."""
    try:
        return os.read(fd, RECEIVE_SIZE), True
    except BlockingIOError:
        pass
    while True:
        await trio.lowlevel.wait_readable(fd)
        try:
            return os.read(fd, RECEIVE_SIZE), False
        except BlockingIOError:
            continue


async def handle(stream: trio.SocketStream) -> None:
    fd = stream.socket.fileno()
    decoder = FrameDecoder()
    output = bytearray()
    try:
        while True:
            data, owed = await _read(fd)
            if not data:
                return
            decoder.feed(data)
            for frame in decoder.decode():
                if frame.__class__ is Pop:
                    append_reply(output, () if frame[0] == BARRIER_QUEUE else STORED)
            if decoder.error is not None:
                return
            if output:
                sent = os.write(fd, output)
                if sent < len(output):
                    await stream.send_all(memoryview(output)[sent:])
                del output[:]
            if owed:
                await trio.lowlevel.checkpoint()
    except (OSError, trio.BrokenResourceError):
        return
    finally:
        await stream.aclose()


async def serve(port: int) -> None:
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    bound = listeners[0].socket.getsockname()[1]
    print(f"trio null server listening on 127.0.0.1 port {bound}", file=sys.stderr, flush=True)
    await trio.serve_listeners(handle, listeners)


def main(argv: list[str] | None = None) -> None:
    parser: argparse.ArgumentParser = OneLineParser(
        prog="trio_null_server.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--port", type=port_number, default=0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(serve, args.port)


if __name__ == "__main__":
    main()
