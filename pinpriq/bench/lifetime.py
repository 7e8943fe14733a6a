"""Child processes that do not outlive their parent: Linux's parent-death signal, and its trap.

Owns PR_SET_PDEATHSIG for the tools' children (the bench's client processes, the soak's server):
the child asks the kernel for SIGTERM when its parent dies, even by SIGKILL, so a killed bench
or soak leaves nothing behind. Knows nothing of pinpriq, of trio, or of what the children do.

The trap (prctl(2)): "the parent" is the *thread* that forked the child, not the process. A
child forked from a worker thread is sent SIGTERM when that thread exits, however alive the
process still is. ``trio.lowlevel.open_process`` forks from a worker thread of trio's cache,
and trio ends idle workers after 10 s: the soak's server started that way died 10 s into every
run. So children that die with their parent are forked on the main thread only, which lives as
long as the process does, and ``start_child`` and ``require_main_thread`` refuse any other.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["die_with_parent", "require_main_thread", "start_child"]

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up once in the parent: the child between fork and exec should do
    as little as it can (no dlopen, which takes locks another thread may have held)."""
    if sys.platform != "linux":
        return None
    with contextlib.suppress(OSError, AttributeError):
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    return None


_PRCTL = _load_prctl()


def die_with_parent() -> None:  # pragma: no cover - runs in a child process
    """Ask Linux for SIGTERM when the thread that forked this process exits (on Linux; a no-op
    elsewhere). Call it in the child (``preexec_fn``, or first thing in a ``multiprocessing``
    target), and fork on the main thread (see ``require_main_thread``): a bench client waiting
    on the barrier would otherwise wait ``SETUP_SECONDS``, and the soak's server would serve
    nobody forever."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def require_main_thread(what: str) -> None:
    """Raise ``RuntimeError`` unless called on the main thread: ``what`` forks children that
    die with their parent, and a child forked on another thread dies with that thread."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"{what} must run on the main thread: a child forked on another thread is sent "
            "SIGTERM when that thread exits (PR_SET_PDEATHSIG follows the forking thread)"
        )


def start_child(command: Sequence[str], **options: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(command, **options)`` for a child that is sent SIGTERM when this
    process dies. Forks here, synchronously, so it must be called on the main thread
    (``RuntimeError`` otherwise); in trio, call it directly, never through ``trio.to_thread``
    or ``trio.lowlevel.open_process``. Starting takes a few milliseconds (fork and exec); the
    caller waits for the child itself, e.g. by polling ``Popen.poll()``."""
    require_main_thread("start_child")
    return subprocess.Popen(command, preexec_fn=die_with_parent, **options)
