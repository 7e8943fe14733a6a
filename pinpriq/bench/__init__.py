"""``pinpriq-bench``: load generator and timer for a pinpriq (or Redis) server.

The pinpriq counterpart of redis-benchmark. It owns the measuring side only: what each client
sends, how fast the server answers, and how the figures are aggregated and shown. Frames come
from ``pinpriq.wire.encode``; subscription deliveries are read with ``wire.ReplyDecoder``.

Theory of operation. Every client connection runs in a process of its own (``multiprocessing``),
so the generator has as many cores as the machine gives it and is not what is measured. A
client builds every request it will send as bytes *before* the clock starts (P frames joined
per batch), connects with a plain blocking socket, queues its share of the prefill, and waits
on a barrier shared with its siblings and the parent. After the barrier it only writes
precomputed batches and counts replies. Each client reports its start and end (``monotonic_ns``,
which is system-wide on Linux, so the processes' clocks agree), its CPU time, and its batch
round-trip times; the parent aggregates: ops/s over the union of the clients' windows, latency
percentiles over all batches (one op per batch at ``-P 1``).

One module per concept, imports going one way (each imports only those listed after it):

    cli        the command line: arguments, table or JSON, ``main``
    runner     the parent: start the client processes, show progress, aggregate
    clients    the client processes: throughput clients, publishers, subscribers
    plans      what one client sends, built before the clock starts
    dialects   pinpriq frames vs Redis RESP, and counting replies
    workload   the scenarios, ``Workload``, ``BenchError``
    lifetime   child processes that die with their parent, forked on the main thread

Beside the bench, and sharing only ``lifetime`` with it, ``soak`` churns a server for minutes
and watches its memory (``python -m pinpriq.soak``, through the shim ``pinpriq/soak.py``).
"""

from pinpriq.bench.cli import main
from pinpriq.bench.dialects import ReplyShape, count_pinpriq_replies, resp_command
from pinpriq.bench.runner import run_scenario
from pinpriq.bench.workload import SCENARIOS, BenchError, Workload

__all__ = [
    "SCENARIOS",
    "BenchError",
    "ReplyShape",
    "Workload",
    "count_pinpriq_replies",
    "main",
    "resp_command",
    "run_scenario",
]
