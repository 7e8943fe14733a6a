"""Command-line front ends. Argument errors and startup failures print one line and exit
non-zero; no traceback reaches the user."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from functools import partial
from typing import NoReturn

import trio

from pinpriq import __version__
from pinpriq.server import PinpriqServer

LOG_LEVELS = ("debug", "info", "warning", "error")


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``prog: error: message (see --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0..65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: not a number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {port}: must be 0..65535")
    return port


def server_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="pinpriq-server",
        description="Run a pinpriq priority-queue server.",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: %(default)s; 0.0.0.0 for every interface)",
    )
    parser.add_argument(
        "--port",
        type=port_number,
        default=7000,
        help="TCP port to listen on, 0 for any free port (default: %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="least severe messages to log (default: %(default)s)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


async def run_server(host: str, port: int) -> str | None:
    """Serve until SIGINT or SIGTERM. Returns why the server could not start, if it could not."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(partial(PinpriqServer().serve, port, host=host))
            except OSError as error:
                return f"cannot listen on {host} port {port}: {error.strerror or error}"
            async for signum in signals:
                logging.getLogger("pinpriq.server").info(
                    "received %s; shutting down", signal.Signals(signum).name
                )
                nursery.cancel_scope.cancel()
    return None


def server_main(argv: list[str] | None = None) -> None:
    """Entry point of ``pinpriq-server``."""
    args = server_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        error = trio.run(run_server, args.host, args.port)
    except KeyboardInterrupt:
        error = None  # Ctrl-C before the signal handler was installed
    if error:
        sys.exit(f"pinpriq-server: {error}")


if __name__ == "__main__":
    server_main()
