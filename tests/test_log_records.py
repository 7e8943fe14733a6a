"""The log's codec (``persistence/records.py``): hand-checked bytes, round trips, and the
invariant that any bytes either read as blocks and entries or raise ``LogFormatError``."""

from __future__ import annotations

import contextlib
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pinpriq.persistence.records import (
    Block,
    Entries,
    Kind,
    LogFormatError,
    decode_entries,
    encode_block,
    encode_copy,
    encode_moved,
    encode_options,
    encode_push,
    encode_remove,
    read_block,
    zeros_from,
)


def entries(data: bytes, offset: int = 0, *, old_copies: bool = False) -> list[tuple[object, ...]]:
    block = read_block(data, offset)
    assert block is not None
    return flat(decode_entries(data, block, old_copies=old_copies), block.base_ms)


def flat(decoded: Entries, base_ms: int) -> list[tuple[object, ...]]:
    """A block's entries as one list, in the order replay applies them (pushes, copies,
    removes): ``(kind, seq, deadline_ms, prio, queue, key, payload, pushed_ms)`` or
    ``(REMOVE, seq)``; a push's push time is its block's ``base_ms``."""
    deadlines = dict(decoded.push_deadlines)
    found: list[tuple[object, ...]] = [
        (Kind.PUSH, seq, deadlines.get(seq, 0), prio, queue, key, payload, base_ms)
        for queue, key, payload, prio, seq in decoded.pushes
    ]
    found += [
        (Kind.COPY, seq, deadline_ms, prio, queue, key, payload, pushed_ms)
        for (queue, key, payload, prio, seq), deadline_ms, pushed_ms in zip(
            decoded.copies, decoded.copy_deadlines, decoded.copy_times, strict=True
        )
    ]
    return found + [(Kind.REMOVE, seq) for seq in decoded.removed]


def test_a_block_byte_by_byte() -> None:
    push = encode_push(b"q", b"k", b"pl", 500, 3)
    assert push == bytes.fromhex("70 01f4 03 0001 0001 0002") + b"qkpl"
    block = encode_block(41, 1_000_000, push, encode_remove(7))
    body = (
        (41).to_bytes(8, "big")
        + (1_000_000).to_bytes(8, "big")
        + push
        + bytes.fromhex("72 0000000000000007")
    )
    length = len(body).to_bytes(4, "big")
    crc = zlib.crc32(length + body).to_bytes(4, "big")
    assert block == b"PQLB" + length + crc + body


def test_push_seqs_follow_the_block_and_ttls_count_from_its_base() -> None:
    data = encode_block(
        99,
        5_000,
        encode_push(b"q", b"a", b"", 0, 1),
        encode_push(b"q", b"b", b"x", 250, 0),
        encode_copy(3, 7_777, 4_000, 2, b"r", b"c", b"y"),
        encode_remove(100),
    )
    assert entries(data) == [
        (Kind.PUSH, 100, 0, 1, b"q", b"a", b"", 5_000),  # TTL 0: no deadline
        (Kind.PUSH, 101, 5_250, 0, b"q", b"b", b"x", 5_000),  # pushed at or after base_ms
        (Kind.COPY, 3, 7_777, 2, b"r", b"c", b"y", 4_000),  # its own seq, deadline, push time
        (Kind.REMOVE, 100),
    ]


def test_a_copy_entry_byte_by_byte_in_both_formats() -> None:
    """Format 2's copy carries its push time; format 1's (read, never written) does not."""
    copy = encode_copy(9, 7_000, 6_000, 4, b"q", b"k", b"v")
    assert copy == (
        bytes.fromhex("63 0000000000000009 0000000000001b58 0000000000001770 04 0001 0001 0001")
        + b"qkv"
    )
    assert entries(encode_block(20, 0, copy)) == [(Kind.COPY, 9, 7_000, 4, b"q", b"k", b"v", 6_000)]
    old = bytes.fromhex("63 0000000000000009 0000000000001b58 04 0001 0001 0001") + b"qkv"
    assert entries(encode_block(20, 0, old), old_copies=True) == [
        (Kind.COPY, 9, 7_000, 4, b"q", b"k", b"v", 0)  # push time unknown
    ]
    for cut in range(1, len(old)):
        cut_data = encode_block(20, 0, old[:cut])
        cut_block = read_block(cut_data, 0)
        assert cut_block is not None
        with pytest.raises(LogFormatError, match="cut short"):
            decode_entries(cut_data, cut_block, old_copies=True)


def test_protocol_1_2_entries_byte_by_byte() -> None:
    """Format 2's kinds for decisions 21-22: a push with options (u32 TTL, u32 delay, both
    counted from the block's base_ms, the TTL from the due time), a moved push (an absolute
    deadline) and a delayed copy (its due time beside its deadline)."""
    options = encode_options(b"q", b"k", b"v", 100_000, 3, 2_000)
    assert options == bytes.fromhex("71 000186a0 000007d0 03 0001 0001 0001") + b"qkv"
    moved = encode_moved(b"r", b"m", b"", 9_999, 2)
    assert moved == bytes.fromhex("6d 000000000000270f 02 0001 0001 0000") + b"rm"
    delayed_copy = encode_copy(7, 8_000, 6_000, 1, b"q", b"d", b"", due_ms=7_500)
    assert delayed_copy == (
        bytes.fromhex(
            "64 0000000000000007 0000000000001d4c 0000000000001f40 0000000000001770 01"
            " 0001 0001 0000"
        )
        + b"qd"
    )
    long_ttl = encode_options(b"q", b"t", b"", 70_000, 1, 0)
    data = encode_block(40, 5_000, options, moved, long_ttl, delayed_copy, encode_remove(7))
    block = read_block(data, 0)
    assert block is not None
    decoded = decode_entries(data, block)
    assert decoded.pushes == [
        (b"q", b"k", b"v", 3, 41),
        (b"r", b"m", b"", 2, 42),
        (b"q", b"t", b"", 1, 43),
    ]
    # Due at base + delay, dead at due + TTL; the moved push's deadline as logged; the long
    # TTL with no delay counts from base_ms.
    assert decoded.push_dues == [(41, 7_000)]
    assert decoded.push_deadlines == [(41, 107_000), (42, 9_999), (43, 75_000)]
    assert decoded.copies == [(b"q", b"d", b"", 1, 7)]
    assert (decoded.copy_dues, decoded.copy_deadlines, decoded.copy_times) == (
        [7_500],
        [8_000],
        [6_000],
    )
    assert decoded.removed == [7]
    for entry in (options, moved, delayed_copy):
        for cut in range(1, len(entry)):
            with pytest.raises(LogFormatError, match="cut short"):
                entries(encode_block(0, 0, entry[:cut]))
    with pytest.raises(LogFormatError, match="unknown entry kind 0x64"):  # format 1 had none
        entries(encode_block(0, 0, delayed_copy), old_copies=True)


def test_largest_fields_round_trip() -> None:
    big = bytes(range(256)) * 256
    field = big[:65535]
    data = encode_block(0, 0, encode_push(field, field, field, 65535, 255))
    assert entries(data) == [(Kind.PUSH, 1, 65535, 255, field, field, field, 0)]


def test_blocks_follow_each_other_and_zeros_end_the_data() -> None:
    first = encode_block(0, 0, encode_remove(1))
    second = encode_block(0, 0, encode_remove(2))
    data = first + second + bytes(100)
    block = read_block(data, 0)
    assert block is not None
    assert block.end == len(first)
    block = read_block(data, block.end)
    assert block is not None
    assert block.end == len(first) + len(second)
    assert read_block(data, block.end) is None  # the unused, zeroed rest of a segment
    assert read_block(data, len(data)) is None


@pytest.mark.parametrize("at", [0, 1, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, (3 << 20) - 1])
def test_zeros_from_finds_one_non_zero_byte_anywhere(at: int) -> None:
    """Compared a megabyte at a time: a byte in any chunk, or on a chunk's edge, counts."""
    data = bytearray(3 << 20)
    assert zeros_from(bytes(data), 0)
    data[at] = 1
    assert not zeros_from(bytes(data), 0)
    assert not zeros_from(bytes(data), at)
    assert zeros_from(bytes(data), at + 1)


@pytest.mark.parametrize("cut", range(1, 40))
def test_a_block_cut_anywhere_is_an_error(cut: int) -> None:
    data = encode_block(0, 0, encode_push(b"q", b"k", b"payload", 0, 1))
    assert len(data) == 12 + 16 + 10 + 9
    if cut >= len(data):
        return
    with pytest.raises(LogFormatError):
        read_block(data[:cut], 0)
    with pytest.raises(LogFormatError):  # cut short, then zeros: a torn preallocated write
        read_block(data[:cut] + bytes(len(data)), 0)


def test_every_flipped_bit_is_caught() -> None:
    data = encode_block(5, 6, encode_push(b"q", b"k", b"v", 9, 1), encode_remove(3))
    for index in range(len(data)):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[index] ^= 1 << bit
            with pytest.raises(LogFormatError):
                read_block(bytes(damaged), 0)


def test_an_entry_of_unknown_kind_in_a_sound_block_is_an_error() -> None:
    data = encode_block(0, 0, b"\x99")
    with pytest.raises(LogFormatError, match="unknown entry kind 0x99"):
        entries(data)


@pytest.mark.parametrize(
    "entry",
    [
        encode_push(b"q", b"k", b"v", 0, 1),
        encode_copy(1, 2, 0, 3, b"q", b"k", b"v"),
        encode_remove(1),
    ],
    ids=["push", "copy", "remove"],
)
def test_an_entry_cut_short_in_a_sound_block_is_an_error(entry: bytes) -> None:
    for cut in range(1, len(entry)):
        with pytest.raises(LogFormatError, match="cut short"):
            entries(encode_block(0, 0, entry[:cut]))


def test_a_damaged_length_is_an_error_and_allocates_nothing() -> None:
    with pytest.raises(LogFormatError, match="cut short"):  # the data is sliced, not sized
        read_block(b"PQLB" + (2**32 - 1).to_bytes(4, "big") + bytes(8), 0)
    with pytest.raises(LogFormatError, match="impossible"):
        read_block(b"PQLB" + (3).to_bytes(4, "big") + bytes(8), 0)


def test_garbage_is_not_a_block() -> None:
    with pytest.raises(LogFormatError, match="bad magic"):
        read_block(b"\x00\x00\x00\x01", 0)


def _read_all(data: bytes) -> list[object]:
    """Read every block and entry, as recovery does."""
    found: list[object] = []
    offset = 0
    while (block := read_block(data, offset)) is not None:
        assert isinstance(block, Block)
        found.extend(flat(decode_entries(data, block), block.base_ms))
        offset = block.end
    return found


@given(st.binary(max_size=300))
def test_any_bytes_read_or_raise_the_one_error(data: bytes) -> None:
    with contextlib.suppress(LogFormatError):
        _read_all(data)


@given(st.binary(max_size=200), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_any_body_in_a_sound_block_reads_or_raises_the_one_error(
    body: bytes, seq_base: int, base_ms: int
) -> None:
    """The checksum is right, so only the entries' layout can be wrong."""
    with contextlib.suppress(LogFormatError):
        _read_all(encode_block(seq_base, base_ms, body))


@given(
    st.lists(
        st.tuples(
            st.binary(max_size=20),
            st.binary(max_size=20),
            st.binary(max_size=20),
            st.integers(0, 65535),
            st.integers(0, 255),
        ),
        max_size=10,
    ),
    st.integers(0, 2**40),
    st.integers(0, 2**50),
)
def test_pushes_round_trip(
    pushes: list[tuple[bytes, bytes, bytes, int, int]], seq_base: int, base_ms: int
) -> None:
    data = encode_block(seq_base, base_ms, *(encode_push(*push) for push in pushes))
    assert entries(data) == [
        (
            Kind.PUSH,
            seq_base + i + 1,
            base_ms + ttl if ttl else 0,
            prio,
            queue,
            key,
            payload,
            base_ms,
        )
        for i, (queue, key, payload, ttl, prio) in enumerate(pushes)
    ]
