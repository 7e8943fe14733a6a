"""The packed store alone at a depth: what the mix costs when the queue no longer fits in cache.

    python benchmarks/store_depth.py 1000 1000000   # ns per op at each depth

No server, no codec: a queue prefilled to the depth (unique 8-byte keys, 16-byte payloads,
prio 1..255), then batches of 64 pushes and 64 ``pop_reply`` calls, as the server's
``mix-depth`` scenario applies them. Chunks of batches alternate between two arms, without
and with ``prefetch_pushes`` before each batch (a store without it runs the first arm twice),
and each arm reports its fastest chunk: on a machine others load, the fastest chunk is the
one least disturbed, and the two arms saw the same conditions. Wall-clock figures: compare
them within one run (``--compare``'s Python is another checkout's, run right after).
"""

from __future__ import annotations

import argparse
import gc
import random
import subprocess
import sys
import time
from pathlib import Path

BATCH = 64
CHUNK = 10  # batches per timed chunk


def measure(depth: int, batches: int) -> tuple[float, float]:
    """Fastest ns per op without and with ``prefetch_pushes``, at ``depth``."""
    from pinpriq import packed, wire

    store = packed.PackedStore(time.monotonic)
    rng = random.Random(1)
    for i in range(depth):
        store.push(b"q", b"%08d" % i, b"x" * 16, 0, rng.randint(1, 255))
    work = [
        [wire.Push(b"q", rng.randbytes(8), b"y" * 16, 0, rng.randint(1, 255)) for _ in range(BATCH)]
        for _ in range(batches)
    ]
    prefetch = getattr(store, "prefetch_pushes", None)
    output = bytearray()
    gc.freeze()
    gc.disable()

    def run(chunk: list[list[wire.Push]], ahead: bool) -> float:
        started = time.perf_counter()
        for frames in chunk:
            if ahead and prefetch is not None:
                prefetch(frames, 0)
            for frame in frames:
                store.push(*frame)
            for _ in range(BATCH):
                store.pop_reply(b"q", output)
            output.clear()
        return (time.perf_counter() - started) / (len(chunk) * 2 * BATCH) * 1e9

    times: dict[bool, list[float]] = {False: [], True: []}
    for at in range(0, batches - 2 * CHUNK + 1, 2 * CHUNK):
        times[False].append(run(work[at : at + CHUNK], False))
        times[True].append(run(work[at + CHUNK : at + 2 * CHUNK], True))
    return min(times[False]), min(times[True])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("depths", type=int, nargs="*", metavar="DEPTH")
    parser.add_argument("--batches", type=int, default=4000, help="(default: 4000)")
    parser.add_argument("--compare", type=Path, help="another checkout, with its own .venv")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child's one depth
    args = parser.parse_args()
    if args.batches < 2 * CHUNK:
        parser.error(f"--batches must be at least {2 * CHUNK}")
    if not args.depths and args.one is None:
        parser.error("name at least one DEPTH")
    if args.one is not None:
        without, with_prefetch = measure(args.one, args.batches)
        print(f"{without:.0f} {with_prefetch:.0f}")
        return
    pythons = [Path(sys.executable)]
    if args.compare:
        pythons.append(args.compare.resolve() / ".venv" / "bin" / "python")
    for depth in args.depths:
        for python in pythons:  # each depth in a fresh process: no memory left from the last
            command = [str(python), __file__, "--one", str(depth), "--batches", str(args.batches)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            without, with_prefetch = done.stdout.split()
            print(
                f"depth {depth:>9,}  {python}: {without} ns/op, "
                f"{with_prefetch} with prefetch_pushes",
                flush=True,
            )


if __name__ == "__main__":
    main()
