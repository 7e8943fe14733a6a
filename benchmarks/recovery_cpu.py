"""CPU time to recover a log in-process, on each log-backed store (issue 21): the same data
directory read back by ``LoggedStore`` (on ``QueueStore``) and ``LoggedPackedStore`` (the C
core's ``_load``), alternately, with the cyclic GC paused as the server pauses it.

    python benchmarks/recovery_cpu.py                  # 1,000,000 packets, 3 runs each
    python benchmarks/recovery_cpu.py --packets 100000 --runs 5

The log is written once by ``LoggedPackedStore`` (8-byte keys, 16-byte payloads, prio
1..255, one block per 64 pushes, as ``persistence.py recovery``'s workload) in a temporary
directory (``--dir``: on a real disk). ``time.process_time()`` around ``recover``: CPU, not
wall clock, so the figure holds on a loaded machine.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

from pinpriq import packed
from pinpriq.persistence.journal import Journal
from pinpriq.persistence.packed_store import LoggedPackedStore
from pinpriq.persistence.segments import DataDir
from pinpriq.persistence.store import LoggedStore


def write_log(path: Path, packets: int) -> None:
    journal = Journal(DataDir.open(path, write=True))
    store = LoggedPackedStore(time.monotonic, journal)
    store.recover(time.monotonic(), time.time_ns() // 1_000_000)
    for i in range(packets):
        store.push(b"bench", b"k%07d" % i, b"p" * 16, 0, 1 + i % 255)
        if i % 64 == 63:
            store.flush()
    store.close()


def recover_seconds(path: Path, store_class: type) -> float:
    journal = Journal(DataDir.open(path, write=True))
    store = store_class(time.monotonic, journal)
    gc.collect()
    gc.disable()
    started = time.process_time()
    store.recover(time.monotonic(), time.time_ns() // 1_000_000)
    seconds = time.process_time() - started
    gc.enable()
    assert len(store) > 0
    store.close()
    del store
    gc.collect()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--packets", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where the data directory goes")
    args = parser.parse_args()
    if not packed.available:
        raise SystemExit("the packed store is not built (or PINPRIQ_PURE_PYTHON is set)")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "data"
        write_log(path, args.packets)
        times: dict[str, list[float]] = {"LoggedStore": [], "LoggedPackedStore": []}
        for run in range(args.runs):
            for store_class in (LoggedStore, LoggedPackedStore):
                seconds = recover_seconds(path, store_class)
                times[store_class.__name__].append(seconds)
                print(f"run {run + 1}: {store_class.__name__} {seconds:.2f} s CPU", flush=True)
    print(f"\nrecovery of {args.packets:,} packets, CPU seconds, median of {args.runs}:")
    for name, values in times.items():
        spread = f"{min(values):.2f}-{max(values):.2f}"
        print(f"  {name:18} {statistics.median(values):.2f} s ({spread})")


if __name__ == "__main__":
    main()
