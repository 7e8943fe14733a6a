"""A server that speaks just enough pinpriq to measure the load generator's ceiling.

It keeps no queue: pushes are skipped, each pop is answered at once with a canned reply (empty,
or one packet of the workload's sizes so that the generator's reply counting is exercised as
against a real server), and subscribe, unsubscribe and ready are ignored. In ``--discard`` mode
it does not even walk the frames: it drops what it reads and answers ``00 00`` whenever a read
ends with pinpriq-bench's barrier pop, the cheapest server a streamed push can meet.

Frames are walked here with ``struct`` rather than ``wire.FrameDecoder``, on purpose: building a
frame object per request would make this stub cost more than the generator it measures.

    python benchmarks/null_server.py [--port 0] [--reply-packet] [--discard]

prints ``null server listening on 127.0.0.1 port N`` on stderr and serves one process, one
thread, until SIGTERM, SIGINT or ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import contextlib
import selectors
import signal
import socket
import struct
import sys
import time

from pinpriq.bench.dialects import BARRIER_QUEUE
from pinpriq.cli.args import OneLineParser, port_number
from pinpriq.wire import Opcode, Packet, Pop, encode, encode_reply

_PUSH_HEADER = struct.Struct(">HHBHH")  # after the opcode: queue, ttl, prio, key, payload
_NAME_HEADER = struct.Struct(">H")
_BARRIER = encode(Pop(BARRIER_QUEUE))
_EMPTY = encode_reply([])


def walk(buf: bytearray, pop_reply: bytes) -> tuple[int, bytes]:
    """Skip the complete frames at the start of ``buf``; returns (bytes used, replies)."""
    pos, end = 0, len(buf)
    replies: list[bytes] = []
    while pos < end:
        opcode = buf[pos]
        if opcode == Opcode.PUSH:
            if pos + 1 + _PUSH_HEADER.size > end:
                break
            queue_len, _, _, key_len, payload_len = _PUSH_HEADER.unpack_from(buf, pos + 1)
            size = 1 + _PUSH_HEADER.size + key_len + payload_len + queue_len
        elif opcode == Opcode.READY:
            size = 1
        elif opcode in (Opcode.POP, Opcode.SUBSCRIBE, Opcode.UNSUBSCRIBE):
            if pos + 3 > end:
                break
            size = 3 + _NAME_HEADER.unpack_from(buf, pos + 1)[0]
        else:
            raise ValueError(f"unknown opcode 0x{opcode:02x}")
        if pos + size > end:
            break
        if opcode == Opcode.POP:
            # The barrier queue is always empty on a real server; keep it so here.
            barrier = buf[pos : pos + size] == _BARRIER
            replies.append(_EMPTY if barrier else pop_reply)
        pos += size
    return pos, b"".join(replies)


def serve(port: int, pop_reply: bytes, discard: bool, max_seconds: float) -> None:
    listener = socket.create_server(("127.0.0.1", port))
    print(f"null server listening on 127.0.0.1 port {listener.getsockname()[1]}", file=sys.stderr)
    sys.stderr.flush()
    pending: dict[socket.socket, bytearray] = {}
    deadline = time.monotonic() + max_seconds
    with listener, selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            for key, _ in selector.select(1.0):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is listener:
                    conn, _ = listener.accept()
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    selector.register(conn, selectors.EVENT_READ)
                    pending[conn] = bytearray()
                    continue
                data = sock.recv(256 * 1024)
                if not data:
                    selector.unregister(sock)
                    del pending[sock]
                    sock.close()
                elif discard:
                    if data.endswith(_BARRIER):
                        sock.sendall(_EMPTY)
                else:
                    _answer(sock, pending[sock], data, pop_reply)


def _answer(sock: socket.socket, buf: bytearray, data: bytes, pop_reply: bytes) -> None:
    buf += data
    while buf:
        used, replies = walk(buf, pop_reply)
        if replies:
            sock.sendall(replies)
        if not used:
            return
        del buf[:used]


def main(argv: list[str] | None = None) -> None:
    parser: argparse.ArgumentParser = OneLineParser(
        prog="null_server.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--port", type=port_number, default=0)
    parser.add_argument(
        "--reply-packet",
        action="store_true",
        help="answer pops with one packet (8-byte key, 16-byte payload), not 00 00",
    )
    parser.add_argument("--discard", action="store_true", help="do not walk frames at all")
    parser.add_argument("--max-seconds", type=float, default=3600.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    reply = encode_reply([Packet(bytes(8), bytes(16))]) if args.reply_packet else _EMPTY
    with contextlib.suppress(KeyboardInterrupt):
        serve(args.port, reply, args.discard, args.max_seconds)


if __name__ == "__main__":
    main()
