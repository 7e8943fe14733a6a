"""What one client sends: every byte of a client's share of a run, built before the clock
starts, as prefill writes and pipelined batches.

Pure: frames come from the dialect, priorities from a seeded ``random.Random``; nothing here
opens a socket or reads a clock.
"""

from __future__ import annotations

import random

import attrs

from pinpriq.bench.dialects import Dialect, dialect_of
from pinpriq.bench.workload import Workload, share

#: Frames per write when streaming pushes (prefill, push-stream): big writes, and a progress
#: update per write.
STREAM_FRAMES = 4096

#: One pipelined round trip: bytes to send, operations they count as, replies to wait for.
Batch = tuple[bytes, int, int]


@attrs.frozen
class Plan:
    fill: list[bytes]  # prefill, in big writes
    fill_replies: int
    batches: list[Batch]
    barriers: int  # replies in ``batches`` that answer a barrier, not a counted pop


def draw_prios(w: Workload, rng: random.Random, count: int) -> list[int]:
    return rng.choices(range(1, w.prio_levels + 1), k=count)


def _chunks(frames: list[bytes], size: int) -> list[bytes]:
    return [b"".join(frames[i : i + size]) for i in range(0, len(frames), size)]


def _pushes(
    w: Workload, d: Dialect, queue: bytes, first: int, count: int, rng: random.Random
) -> list[bytes]:
    prios = draw_prios(w, rng, count)
    return [d.push(w, queue, first + i, prios[i]) for i in range(count)]


def build_plan(w: Workload, index: int, queue: bytes) -> Plan:
    """Every byte client ``index`` will send, built before the clock starts."""
    d = dialect_of(w)
    rng = random.Random(f"{w.seed}:{index}")
    fill_first, fill_count = share(w.fill, w.clients, index)
    fill = _pushes(w, d, queue, fill_first, fill_count, rng)
    fill_replies = 0 if d.barrier is not None else fill_count
    if fill and d.barrier is not None:
        fill.append(d.barrier)
        fill_replies = 1
    first, count = share(w.ops, w.clients, index)
    first += w.fill  # timed pushes never reuse a prefill key
    ops = _ops(w, d, queue, first, count, rng)
    if w.scenario == "push-stream":
        batches, barriers = _stream_batches(d, ops)
    else:
        batches, barriers = _pipelined_batches(w, d, ops)
    return Plan(_chunks(fill, STREAM_FRAMES), fill_replies, batches, barriers)


def _ops(
    w: Workload, d: Dialect, queue: bytes, first: int, count: int, rng: random.Random
) -> list[tuple[bytes, bool]]:
    """The client's operations in order, as (frame, is a pop)."""
    if w.scenario == "pop":
        return [(d.pop(queue), True)] * count
    if w.scenario == "mix":
        pushes = _pushes(w, d, queue, first, (count + 1) // 2, rng)
        pop = d.pop(queue)
        return [(pushes[i // 2], False) if i % 2 == 0 else (pop, True) for i in range(count)]
    return [(frame, False) for frame in _pushes(w, d, queue, first, count, rng)]


def _pipelined_batches(
    w: Workload, d: Dialect, ops: list[tuple[bytes, bool]]
) -> tuple[list[Batch], int]:
    batches: list[Batch] = []
    barriers = 0
    for i in range(0, len(ops), w.pipeline):
        group = ops[i : i + w.pipeline]
        frames = [frame for frame, _ in group]
        if d.barrier is None:  # Redis answers every request
            replies = len(group)
        else:
            replies = sum(is_pop for _, is_pop in group)
            if not replies:  # pushes alone are not answered: a barrier pop marks them done
                frames.append(d.barrier)
                replies = 1
                barriers += 1
        batches.append((b"".join(frames), len(group), replies))
    return batches, barriers


def _stream_batches(d: Dialect, ops: list[tuple[bytes, bool]]) -> tuple[list[Batch], int]:
    """Big writes with nothing to wait for, then one barrier (pinpriq) or every reply (Redis)."""
    frames = [frame for frame, _ in ops]
    batches: list[Batch] = [
        (chunk, min(STREAM_FRAMES, len(frames) - i * STREAM_FRAMES), 0)
        for i, chunk in enumerate(_chunks(frames, STREAM_FRAMES))
    ]
    if d.barrier is not None:
        batches.append((d.barrier, 0, 1))
        return batches, 1
    batches.append((b"", 0, len(frames)))
    return batches, 0
