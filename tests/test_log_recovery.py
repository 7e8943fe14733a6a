"""Reading a data directory back (``persistence/recovery.py``, ``segments.py``) on real files:
torn tails cut at every byte, damage in the middle refused or truncated on request, format
versions, empty and foreign directories, the lock, and the offline check's report."""

from __future__ import annotations

import logging
import shutil
import zlib
from pathlib import Path

import pytest

from pinpriq.persistence.journal import MIN_SEGMENT_SIZE
from pinpriq.persistence.records import encode_block, encode_push, encode_remove, read_block
from pinpriq.persistence.recovery import report, scan
from pinpriq.persistence.segments import (
    SEGMENT_HEADER_SIZE,
    DataDir,
    DataDirError,
    create_segment,
)
from pinpriq.persistence.store import LoggedStore
from tests.logtools import FakeClock, commit, open_store

#: Runs a test on each log-backed store (the ``logged_store`` fixture).
each_log_store = pytest.mark.usefixtures("logged_store")

Contents = dict[bytes, list[list[tuple[bytes, bytes]]]]


def contents(store: LoggedStore, queues: tuple[bytes, ...] = (b"q", b"q2")) -> Contents:
    """Every queue's packets, in the order pops give them (draining the store)."""
    found: Contents = {}
    for queue in queues:
        replies = []
        while reply := store.pop(queue):
            replies.append([(p[0], p[1]) for p in reply])
        found[queue] = replies
    return found


def blocks(path: Path) -> list[tuple[int, int]]:
    """(start, end) of each block of a segment file."""
    data = path.read_bytes()
    found = []
    offset = SEGMENT_HEADER_SIZE
    while (block := read_block(data, offset)) is not None:
        found.append((offset, block.end))
        offset = block.end
    return found


def segment_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.log"))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def write_two_batches(path: Path, clock: FakeClock) -> None:
    """Batch 1 pushes A and B to q; batch 2 pushes C to q2 and pops A: its block is last."""
    store = open_store(path, clock, segment_size=MIN_SEGMENT_SIZE)
    store.push(b"q", b"A", b"a", 0, 2)
    store.push(b"q", b"B", b"b", 0, 3)
    commit(store)
    store.push(b"q2", b"C", b"c", 0, 1)
    assert store.pop(b"q")[0][0] == b"A"
    commit(store)
    store.close()


BEFORE_LAST: Contents = {b"q": [[(b"A", b"a")], [(b"B", b"b")]], b"q2": []}
AFTER_LAST: Contents = {b"q": [[(b"B", b"b")]], b"q2": [[(b"C", b"c")]]}


@each_log_store
def test_both_batches_come_back(tmp_path: Path, clock: FakeClock) -> None:
    write_two_batches(tmp_path, clock)
    assert contents(open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)) == AFTER_LAST


@pytest.mark.parametrize("zero_fill", [False, True], ids=["truncated", "zero-filled"])
@each_log_store
def test_a_torn_last_block_is_cut_at_every_byte(
    tmp_path: Path, clock: FakeClock, zero_fill: bool, caplog: pytest.LogCaptureFixture
) -> None:
    original = tmp_path / "original"
    write_two_batches(original, clock)
    newest = segment_files(original)[0]
    start, end = blocks(newest)[-1]
    for cut in range(start + 1, end):
        work = tmp_path / f"cut-{cut}"
        shutil.copytree(original, work)
        segment = work / newest.name
        size = segment.stat().st_size
        with open(segment, "r+b") as file:
            file.truncate(cut)
            if zero_fill:  # as a preallocated segment looks after a torn write
                file.truncate(size)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pinpriq.persistence"):
            store = open_store(work, clock, segment_size=MIN_SEGMENT_SIZE)
        assert contents(store) == BEFORE_LAST, f"cut at {cut}"
        # Zeros at the end of the torn bytes cannot be told from unused space: not counted.
        dropped = len(newest.read_bytes()[start:cut].rstrip(b"\0"))
        assert f"cutting {segment} at offset {start}, dropping {dropped} bytes" in caplog.text
        # Written after the cut, then read back: the log goes on from the cut, cleanly.
        store.push(b"q2", b"D", b"d", 0, 1)
        commit(store)
        store.close()
        store = open_store(work, clock, segment_size=MIN_SEGMENT_SIZE)
        assert contents(store) == {b"q": [], b"q2": [[(b"D", b"d")]]}, f"cut at {cut}"
        store.close()
        shutil.rmtree(work)


def flip_bit(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([byte ^ 0x10]))


def write_three_batches(path: Path, clock: FakeClock) -> None:
    store = open_store(path, clock, segment_size=MIN_SEGMENT_SIZE)
    for key in (b"1", b"2", b"3"):
        store.push(b"q", key, key, 0, 1)
        commit(store)
    store.close()


@each_log_store
def test_a_flipped_bit_in_the_middle_stops_the_start(tmp_path: Path, clock: FakeClock) -> None:
    write_three_batches(tmp_path, clock)
    segment = segment_files(tmp_path)[0]
    second = blocks(segment)[1]
    flip_bit(segment, second[0] + 20)
    with pytest.raises(DataDirError) as caught:
        open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    message = str(caught.value)
    assert f"{segment} at offset {second[0]}: checksum mismatch" in message
    assert "--truncate-damaged-log" in message
    assert "\n" not in message
    assert segment.read_bytes()[second[0] :].rstrip(b"\0"), "a refused start changed the file"
    data_dir = DataDir.open(tmp_path, write=False)
    lines, would_start = report(data_dir, scan(data_dir, now_ms=clock.wall_ms()))
    assert not would_start
    assert any(line.startswith(f"DAMAGED: {segment} at offset {second[0]}") for line in lines)


@each_log_store
def test_truncating_at_damage_keeps_what_came_before(tmp_path: Path, clock: FakeClock) -> None:
    write_three_batches(tmp_path, clock)
    segment = segment_files(tmp_path)[0]
    second = blocks(segment)[1]
    flip_bit(segment, second[0] + 20)
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE, truncate_damaged=True)
    assert contents(store, (b"q",)) == {b"q": [[(b"1", b"1")]]}
    store.close()


@each_log_store
def test_damage_in_an_older_segment_truncates_every_later_one(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    for i in range(40):  # about three segments, all live
        store.push(b"q", b"%02d" % i, bytes(5000), 0, 1)
        commit(store)
    store.close()
    first, *later = segment_files(tmp_path)
    assert len(later) >= 2
    flip_bit(first, blocks(first)[-1][0] + 30)
    with pytest.raises(DataDirError, match=f"{first} at offset"):
        open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE, truncate_damaged=True)
    kept = len(blocks(first))
    assert len(store) == kept
    for path in later:
        assert not path.exists() or path.read_bytes()[SEGMENT_HEADER_SIZE:].strip(b"\0") == b""
    store.close()


@each_log_store
def test_an_empty_directory_starts_a_new_log(tmp_path: Path, clock: FakeClock) -> None:
    store = open_store(tmp_path / "new", clock)
    assert len(store) == 0
    assert (tmp_path / "new" / "FORMAT").read_text() == "pinpriq log format 2\n"
    assert len(segment_files(tmp_path / "new")) == 2  # the active segment and a spare
    store.close()


@each_log_store
def test_a_directory_with_other_files_but_no_log_is_used(tmp_path: Path, clock: FakeClock) -> None:
    (tmp_path / "lost+found").mkdir()  # the root of a mounted volume
    open_store(tmp_path, clock).close()
    assert (tmp_path / "FORMAT").exists()


@each_log_store
def test_a_newer_format_is_refused(tmp_path: Path, clock: FakeClock) -> None:
    open_store(tmp_path, clock).close()
    (tmp_path / "FORMAT").write_text("pinpriq log format 3\n")
    with pytest.raises(DataDirError, match=r"newer pinpriq \(log format 3\).*reads format 2"):
        DataDir.open(tmp_path, write=True)


@each_log_store
def test_a_segment_of_another_format_is_refused(tmp_path: Path, clock: FakeClock) -> None:
    store = open_store(tmp_path, clock)
    store.push(b"q", b"k", b"v", 0, 1)
    commit(store)
    store.close()
    segment = segment_files(tmp_path)[0]
    head = b"PINPRIQL" + (9).to_bytes(4, "big")
    with open(segment, "r+b") as file:
        file.write(head + zlib.crc32(head).to_bytes(4, "big"))
    with pytest.raises(DataDirError, match="written in log format 9; this pinpriq reads formats"):
        open_store(tmp_path, clock)
    with open(segment, "r+b") as file:
        file.seek(8)
        file.write((2).to_bytes(4, "big"))  # the checksum no longer matches
    with pytest.raises(DataDirError, match="not a pinpriq log segment"):
        open_store(tmp_path, clock)


@each_log_store
def test_segments_without_a_format_file_are_refused(tmp_path: Path, clock: FakeClock) -> None:
    open_store(tmp_path, clock).close()
    (tmp_path / "FORMAT").unlink()
    with pytest.raises(DataDirError, match="holds log segments but no FORMAT file"):
        DataDir.open(tmp_path, write=True)


@each_log_store
def test_one_server_per_directory(tmp_path: Path, clock: FakeClock) -> None:
    store = open_store(tmp_path, clock)
    with pytest.raises(DataDirError, match="in use by another pinpriq-server"):
        DataDir.open(tmp_path, write=True)
    store.close()
    DataDir.open(tmp_path, write=True).close()


@each_log_store
def test_a_segment_whose_creation_was_cut_short_is_deleted(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    write_two_batches(tmp_path, clock)
    leftover = tmp_path / "0000000000000003.log"  # the active segment is 1, its spare 2
    leftover.write_bytes(bytes(4096))
    with caplog.at_level(logging.WARNING, logger="pinpriq.persistence"):
        store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    assert not leftover.exists()
    assert "creation was cut short" in caplog.text
    assert contents(store) == AFTER_LAST


@each_log_store
def test_check_report_says_what_a_start_recovers(tmp_path: Path, clock: FakeClock) -> None:
    write_two_batches(tmp_path, clock)
    data_dir = DataDir.open(tmp_path, write=False)
    lines, would_start = report(data_dir, scan(data_dir, now_ms=clock.wall_ms()))
    assert would_start
    assert "a start recovers 2 packets in 2 queues, next seq 4" in lines[-2]
    assert lines[-1] == "OK: a start recovers the packets above"


def write_segments(path: Path, clock: FakeClock, count: int = 40) -> LoggedStore:
    """``count`` packets of 5 kB, each pushed in a block of its own: about three 64 KiB
    segments, every packet live. Returns the store, closed."""
    store = open_store(path, clock, segment_size=MIN_SEGMENT_SIZE)
    for i in range(count):
        store.push(b"q", b"%02d" % i, bytes(5000), 0, 1)
        commit(store)
    store.close()
    return store


def check(path: Path, clock: FakeClock) -> tuple[list[str], bool]:
    data_dir = DataDir.open(path, write=False)
    return report(data_dir, scan(data_dir, now_ms=clock.wall_ms()))


@each_log_store
def test_a_missing_middle_segment_is_damage(tmp_path: Path, clock: FakeClock) -> None:
    """Only the oldest segments are ever deleted: a gap in the numbers lost records (removals
    of older packets among them, which would come back), so a start refuses."""
    write_segments(tmp_path, clock)
    first, second, third, *_ = segment_files(tmp_path)
    second.unlink()
    with pytest.raises(DataDirError) as caught:
        open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    assert f"damaged log: {third} at offset 0: segment {second.name} is missing" in str(
        caught.value
    )
    kept = len(blocks(first))  # one packet per block
    lines, would_start = check(tmp_path, clock)
    assert not would_start
    assert lines[-1].startswith(f"DAMAGED: {third} at offset 0: segment {second.name} is missing")
    assert f"a start recovers {kept} packets" in lines[-2]
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE, truncate_damaged=True)
    assert len(store) == kept
    store.close()
    assert check(tmp_path, clock)[1]


@pytest.mark.parametrize("which", [0, 1], ids=["oldest", "middle"])
@pytest.mark.parametrize("truncate", [False, True], ids=["refused", "truncated"])
@each_log_store
def test_an_older_segment_cut_to_its_header_is_damage(
    tmp_path: Path, clock: FakeClock, which: int, truncate: bool
) -> None:
    write_segments(tmp_path, clock)
    files = segment_files(tmp_path)
    assert len(files) >= 4  # three with blocks, and the spare
    kept = len(blocks(files[0])) if which == 1 else 0  # one packet per block
    files[which].write_bytes(files[which].read_bytes()[:SEGMENT_HEADER_SIZE])
    lines, would_start = check(tmp_path, clock)
    assert not would_start
    reason = "no blocks, though later segments have some"
    assert lines[-1].startswith(f"DAMAGED: {files[which]} at offset 16: {reason}")
    assert f"a start recovers {kept} packets" in lines[-2]
    if not truncate:
        with pytest.raises(DataDirError, match=f"damaged log: {files[which]} at offset 16"):
            open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
        return
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE, truncate_damaged=True)
    assert len(store) == kept
    store.push(b"q", b"after", b"a", 0, 1)  # newest first at prio 1
    commit(store)
    store.close()
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    assert store.pop(b"q")[0][:2] == (b"after", b"a")
    assert len(store) == kept
    store.close()
    assert check(tmp_path, clock)[1]


@each_log_store
def test_a_torn_first_block_of_the_newest_segment_is_cut(tmp_path: Path, clock: FakeClock) -> None:
    """A crash in the first write after a rotation: the newest segment holds one torn block."""
    write_segments(tmp_path, clock, count=13)  # one block in the second segment
    _, second, *_ = segment_files(tmp_path)
    assert len(blocks(second)) == 1
    with open(second, "r+b") as file:
        file.truncate(blocks(second)[0][1] - 1)
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    assert len(store) == 12
    store.push(b"q", b"after", b"a", 0, 1)
    commit(store)
    store.close()
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    assert len(store) == 13
    store.close()


@each_log_store
def test_extra_spares_leave_no_gap_in_the_numbers(tmp_path: Path, clock: FakeClock) -> None:
    """Two spares after a crash (the second made while the first was the active segment,
    before any block): the extra one is deleted, and the next segment takes its number."""
    open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE).close()
    create_segment(tmp_path / "0000000000000003.log", MIN_SEGMENT_SIZE)
    write_segments(tmp_path, clock)  # rotates through new segments
    numbers = [int(path.stem) for path in segment_files(tmp_path)]
    assert numbers == list(range(1, len(numbers) + 1))
    store = open_store(tmp_path, clock, segment_size=MIN_SEGMENT_SIZE)
    assert len(store) == 40
    store.close()


@each_log_store
def test_a_damage_report_does_not_count_the_spare_as_dropped(
    tmp_path: Path, clock: FakeClock
) -> None:
    write_three_batches(tmp_path, clock)
    segment, _spare = segment_files(tmp_path)
    flip_bit(segment, blocks(segment)[1][0] + 20)
    lines, _ = check(tmp_path, clock)
    assert lines[-1].endswith(
        "and 1 later segment files (0 bytes); the counts above are what it would recover"
    ), lines[-1]


def format_1_segment(blocks: list[bytes]) -> bytes:
    """A segment as log format 1 wrote it, from its documented layout."""
    head = b"PINPRIQL" + (1).to_bytes(4, "big")
    return head + zlib.crc32(head).to_bytes(4, "big") + b"".join(blocks) + bytes(1000)


@each_log_store
def test_a_format_1_log_is_read_and_what_follows_is_format_2(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A directory written by the previous version: its packets come back (format 1's copies
    have no push time), its FORMAT says 2 from then on, and nothing is appended to its
    format-1 segment: new blocks go to a new segment of format 2."""
    (tmp_path / "FORMAT").write_text("pinpriq log format 1\n")
    pushes = encode_push(b"q", b"a", b"1", 0, 2) + encode_push(b"q", b"b", b"2", 0, 1)
    old_copy = bytes.fromhex("63 0000000000000001 0000000000000000 03 0001 0001 0001") + b"qa1"
    old = format_1_segment(
        [encode_block(0, clock.wall_ms(), pushes), encode_block(2, 0, old_copy, encode_remove(2))]
    )
    (tmp_path / "0000000000000001.log").write_bytes(old)
    store = open_store(tmp_path, clock)
    assert (tmp_path / "FORMAT").read_text() == "pinpriq log format 2\n"
    store.push(b"q", b"c", b"3", 0, 1)
    commit(store)
    store.close()
    assert (tmp_path / "0000000000000001.log").read_bytes() == old
    newer = segment_files(tmp_path)[1].read_bytes()
    assert newer[8:12] == (2).to_bytes(4, "big")
    store = open_store(tmp_path, clock)
    assert [[p[:2] for p in store.pop(b"q")] for _ in range(3)] == [
        [(b"c", b"3")],
        [(b"a", b"1")],  # prio 3 now, as its copy says
        [],
    ]
    store.close()
