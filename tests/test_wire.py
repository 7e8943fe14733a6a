"""The wire codec against the protocol table (docs/protocol.md, "Frames").

Expected bytes are written out by hand from the frame layouts, never produced by the encoder;
the round-trip and chunking properties then lean on those pinned bytes.
"""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise
from types import FrameType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pinpriq import wire
from pinpriq.errors import ArgumentError
from pinpriq.wire import (
    LEASED_EMPTY,
    MAX_FIELD,
    READY,
    SYNC,
    Ack,
    Auth,
    ClientFrame,
    DelayedPush,
    FrameDecoder,
    LeasedSubscribe,
    LeaseReply,
    MalformedFrame,
    Packet,
    Pop,
    ProtocolError,
    Push,
    Release,
    ReplyDecoder,
    Reserve,
    Subscribe,
    Touch,
    Unsubscribe,
    append_reply,
    encode,
    encode_lease_reply,
    encode_lease_status,
    encode_reply,
)

OPCODES = {0x70, 0x50, 0x73, 0x75, 0x41, 0x21, 0x61, 0x52, 0x4B, 0x4E, 0x54, 0x53, 0x71}

# (frame, its bytes as written from the layout table). Spaces separate the fields.
PINNED_FRAMES: list[tuple[ClientFrame, str]] = [
    # 70 | queue_len | ttl_ms | prio | key_len | payload_len | key | payload | queue
    (
        Push(queue=b"q1", key=b"k", payload=b"hey", ttl_ms=1500, prio=3),
        "70 0002 05dc 03 0001 0003 6b 686579 7131",
    ),
    (Push(queue=b"", key=b"", payload=b"", ttl_ms=0, prio=0), "70 0000 0000 00 0000 0000"),
    (
        Push(queue=b"x", key=b"", payload=b"\x00\xff", ttl_ms=65535, prio=255),
        "70 0001 ffff ff 0000 0002 00ff 78",
    ),
    (
        Push(queue=b"jobs", key=b"id-7", payload=b"", ttl_ms=256, prio=1),
        "70 0004 0100 01 0004 0000 69642d37 6a6f6273",
    ),
    (Pop(b"jobs"), "50 0004 6a6f6273"),
    (Pop(b""), "50 0000"),
    (Subscribe(b"jobs"), "73 0004 6a6f6273"),
    (Subscribe(b""), "73 0000"),
    (Unsubscribe(b"jobs"), "75 0004 6a6f6273"),
    (Unsubscribe(b""), "75 0000"),
    (READY, "41"),
    (SYNC, "21"),
    # 61 | token_len | token
    (Auth(b"s3cret"), "61 0006 733363726574"),
    (Auth(b""), "61 0000"),
    # 52 | lease_ms u32 | queue_len | queue: the time before the name
    (Reserve(b"jobs", 30_000), "52 00007530 0004 6a6f6273"),
    (Reserve(b""), "52 00000000 0000"),
    (Reserve(b"q", 86_400_000), "52 05265c00 0001 71"),
    # 4B | lease_id u64
    (Ack(1), "4b 0000000000000001"),
    (Ack(0xFFFF_FFFF_FFFF_FFFF), "4b ffffffffffffffff"),
    # 4E | lease_id u64 | delay_ms u32
    (Release(2, 1500), "4e 0000000000000002 000005dc"),
    (Release(258), "4e 0000000000000102 00000000"),
    # 54 | lease_id u64 | lease_ms u32
    (Touch(3, 60_000), "54 0000000000000003 0000ea60"),
    # 53 | lease_ms u32 | queue_len | queue
    (LeasedSubscribe(b"jobs", 100), "53 00000064 0004 6a6f6273"),
    (LeasedSubscribe(b""), "53 00000000 0000"),
    # 71 | queue_len | ttl_ms u32 | delay_ms u32 | prio | key_len | payload_len | key | payload
    # | queue (decision 21): a push with a delay, or with a TTL a u16 cannot hold
    (
        DelayedPush(b"jobs", b"id-7", b"x", 7_200_000, 3, 10_000),
        "71 0004 006ddd00 00002710 03 0004 0001 69642d37 78 6a6f6273",
    ),
    (Push(b"q", b"k", b"", ttl_ms=65536, prio=1), "71 0001 00010000 00000000 01 0001 0000 6b 71"),
    (
        DelayedPush(b"", b"", b"", 0xFFFF_FFFF, 0, 2_592_000_000),
        "71 0000 ffffffff 9a7ec800 00 0000 0000",
    ),
]

MAX_PUSH = Push(queue=b"q" * 65535, key=b"k" * 65535, payload=b"p" * 65535, ttl_ms=65535, prio=255)
MAX_PUSH_HEADER = bytes.fromhex("70 ffff ffff ff ffff ffff")


def decode_frames(chunks: Iterable[bytes]) -> list[ClientFrame]:
    """Feed chunks to one FrameDecoder, collecting every frame as soon as it completes."""
    decoder = FrameDecoder()
    frames: list[ClientFrame] = []
    for chunk in chunks:
        decoder.feed(chunk)
        frames.extend(decoder)
    return frames


def decode_replies(chunks: Iterable[bytes]) -> list[list[Packet]]:
    decoder = ReplyDecoder()
    replies: list[list[Packet]] = []
    for chunk in chunks:
        decoder.feed(chunk)
        replies.extend(decoder)
    return replies


def one_byte_at_a_time(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def split_at(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    points = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in pairwise(points)]


# --- pinned bytes ----------------------------------------------------------------------------


@pytest.mark.parametrize(("frame", "hex_bytes"), PINNED_FRAMES)
def test_encode_gives_the_bytes_of_the_layout_table(frame: ClientFrame, hex_bytes: str) -> None:
    assert encode(frame) == bytes.fromhex(hex_bytes)


@pytest.mark.parametrize(("frame", "hex_bytes"), PINNED_FRAMES)
def test_decoder_reads_the_layout_table_bytes(frame: ClientFrame, hex_bytes: str) -> None:
    data = bytes.fromhex(hex_bytes)
    assert decode_frames([data]) == [frame]
    assert decode_frames(one_byte_at_a_time(data)) == [frame]


@pytest.mark.parametrize(("frame", "hex_bytes"), PINNED_FRAMES)
def test_decoder_leaves_trailing_partial_frame_pending(frame: ClientFrame, hex_bytes: str) -> None:
    partial_push = bytes.fromhex("70 0001 0000 01 0000")  # header cut short
    decoder = FrameDecoder()
    decoder.feed(bytes.fromhex(hex_bytes) + partial_push)
    assert list(decoder) == [frame]
    assert decoder.pending == len(partial_push)


def test_push_carries_packet_before_queue_name() -> None:
    # Same lengths for queue and key, so only the order tells them apart.
    data = bytes.fromhex("70 0003 0000 01 0003 0000") + b"KEY" + b"QUE"
    assert decode_frames([data]) == [Push(queue=b"QUE", key=b"KEY", payload=b"", prio=1)]


def test_push_defaults_are_no_ttl_and_prio_one() -> None:
    assert encode(Push(b"q", b"k", b"v")) == bytes.fromhex("70 0001 0000 01 0001 0001 6b 76 71")


def test_empty_reply_is_two_zero_bytes() -> None:
    assert encode_reply([]) == bytes.fromhex("00 00")
    assert decode_replies([bytes.fromhex("00 00")]) == [[]]


def test_two_packet_reply_bytes() -> None:
    packets = [Packet(b"k", b"ab"), Packet(b"", b"z")]
    data = bytes.fromhex("0002 0001 0002 6b 6162 0000 0001 7a")
    assert encode_reply(packets) == data
    assert decode_replies([data]) == [packets]
    assert decode_replies(one_byte_at_a_time(data)) == [packets]


def test_encode_reply_takes_any_tuples_that_start_with_key_and_payload() -> None:
    queued = (b"kk", b"", 7, 42)  # the store's (key, payload, prio, seq)
    assert encode_reply([queued]) == bytes.fromhex("0001 0002 0000 6b6b")
    assert encode_reply([queued, Packet(b"k", b"v")]) == bytes.fromhex(
        "0002 0002 0000 6b6b 0001 0001 6b 76"
    )


def test_reply_decoder_separates_consecutive_replies() -> None:
    data = bytes.fromhex("0000 0001 0000 0000 0000")
    assert decode_replies([data]) == [[], [Packet(b"", b"")], []]


# --- the largest frame -------------------------------------------------------------------------


def test_max_size_push_is_196615_bytes_and_decodes_whole() -> None:
    data = encode(MAX_PUSH)
    assert len(data) == 196_615 == wire.MAX_FRAME - 6  # a push with options is 6 bytes longer
    assert data[:10] == MAX_PUSH_HEADER
    assert data[10:] == b"k" * 65535 + b"p" * 65535 + b"q" * 65535
    assert decode_frames([data]) == [MAX_PUSH]


@settings(max_examples=15, deadline=None)
@given(cuts=st.lists(st.integers(0, wire.MAX_FRAME), max_size=30))
def test_max_size_push_decodes_in_any_chunks(cuts: list[int]) -> None:
    data = encode(MAX_PUSH) + encode(READY)
    assert decode_frames(split_at(data, cuts)) == [MAX_PUSH, READY]


def test_max_size_push_fed_one_byte_at_a_time_decodes_once_at_the_last_byte() -> None:
    # Linear cost, bounded by count: 196,615 feeds, each answered "need more" until the last.
    data = encode(MAX_PUSH)
    decoder = FrameDecoder()
    early = 0
    for i in range(len(data) - 1):
        decoder.feed(data[i : i + 1])
        early += decoder.next_frame() is not None
    assert early == 0
    assert decoder.pending == len(data) - 1
    decoder.feed(data[-1:])
    assert decoder.next_frame() == MAX_PUSH
    assert decoder.pending == 0
    assert decoder.next_frame() is None


def test_max_size_reply_packet_decodes_one_byte_at_a_time() -> None:
    packet = Packet(b"k" * 65535, b"p" * 65535)
    data = encode_reply([packet])
    assert data[:6] == bytes.fromhex("0001 ffff ffff")
    assert decode_replies(one_byte_at_a_time(data)) == [[packet]]


def _wire_line_events(work: Callable[[], None]) -> int:
    """How many lines of pinpriq/wire.py run during work(): a deterministic measure of cost."""
    count = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def global_(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == wire.__file__ else None

    previous = sys.gettrace()
    sys.settrace(global_)
    try:
        work()
    finally:
        sys.settrace(previous)
    return count


def test_frame_decoding_cost_is_linear_in_bytes_fed_singly() -> None:
    def decode_push_of(size: int) -> Callable[[], None]:
        chunks = one_byte_at_a_time(encode(Push(b"q", b"k", b"p" * size)))

        def work() -> None:
            assert len(decode_frames(chunks)) == 1

        return work

    small = _wire_line_events(decode_push_of(2_000))
    large = _wire_line_events(decode_push_of(8_000))
    assert large <= 4.4 * small  # 4x the bytes: about 4x the work; quadratic would be ~16x


def test_reply_decoding_cost_is_linear_in_bytes_fed_singly() -> None:
    # A long reply must not be re-parsed from its start on every chunk.
    def decode_reply_of(count: int) -> Callable[[], None]:
        chunks = one_byte_at_a_time(encode_reply([Packet(b"k", b"v")] * count))

        def work() -> None:
            assert decode_replies(chunks) == [[Packet(b"k", b"v")] * count]

        return work

    small = _wire_line_events(decode_reply_of(300))
    large = _wire_line_events(decode_reply_of(1_200))
    assert large <= 4.4 * small


# --- any chunking --------------------------------------------------------------------------------

fields = st.binary(max_size=12)
pushes = st.builds(
    Push,
    queue=fields,
    key=fields,
    payload=fields,
    ttl_ms=st.one_of(st.integers(0, 65535), st.integers(0, wire.MAX_TTL_MS)),
    prio=st.integers(0, 255),
)
delayed_pushes = st.builds(
    DelayedPush,
    queue=fields,
    key=fields,
    payload=fields,
    ttl_ms=st.integers(0, wire.MAX_TTL_MS),
    prio=st.integers(0, 255),
    delay_ms=st.integers(1, wire.MAX_DELAY_MS),
)
client_frames: st.SearchStrategy[ClientFrame] = st.one_of(
    pushes,
    delayed_pushes,
    st.builds(Pop, fields),
    st.builds(Subscribe, fields),
    st.builds(Unsubscribe, fields),
    st.just(READY),
    st.just(SYNC),
    st.builds(Auth, fields),
    st.builds(Reserve, fields, st.integers(0, wire.MAX_LEASE_MS)),
    st.builds(LeasedSubscribe, fields, st.integers(0, wire.MAX_LEASE_MS)),
    st.builds(Ack, st.integers(0, wire.MAX_LEASE_ID)),
    st.builds(Release, st.integers(0, wire.MAX_LEASE_ID), st.integers(0, wire.MAX_LEASE_MS)),
    st.builds(Touch, st.integers(0, wire.MAX_LEASE_ID), st.integers(0, wire.MAX_LEASE_MS)),
)
packets = st.builds(Packet, fields, fields)
replies = st.lists(packets, max_size=5)


@st.composite
def chunked(draw: st.DrawFn, data: bytes) -> list[bytes]:
    cuts = draw(st.lists(st.integers(0, len(data)), max_size=max(1, len(data) // 2)))
    return split_at(data, cuts)


@settings(max_examples=150, deadline=None)
@given(frames=st.lists(client_frames, max_size=12), data=st.data())
def test_any_chunking_of_frames_decodes_to_the_same_frames(
    frames: list[ClientFrame], data: st.DataObject
) -> None:
    stream = b"".join(encode(frame) for frame in frames)
    assert decode_frames([stream]) == frames
    assert decode_frames(one_byte_at_a_time(stream)) == frames
    assert decode_frames(data.draw(chunked(stream))) == frames


@settings(max_examples=150, deadline=None)
@given(sent=st.lists(replies, max_size=8), data=st.data())
def test_any_chunking_of_replies_decodes_to_the_same_replies(
    sent: list[list[Packet]], data: st.DataObject
) -> None:
    stream = b"".join(encode_reply(reply) for reply in sent)
    assert decode_replies([stream]) == sent
    assert decode_replies(one_byte_at_a_time(stream)) == sent
    assert decode_replies(data.draw(chunked(stream))) == sent


# --- bad input -----------------------------------------------------------------------------------

# Valid frames with junk spliced in, so errors land after real frames as well as at offset 0.
streams = st.one_of(
    st.binary(max_size=64),
    st.lists(
        st.one_of(client_frames.map(encode), st.binary(min_size=1, max_size=3)), max_size=10
    ).map(b"".join),
)


def _expected_length(prefix: bytes) -> int | None:
    """The full length of a valid frame starting with prefix, if its header is complete."""
    opcode = prefix[0]
    if opcode in (0x41, 0x21):
        return 1
    if opcode == 0x4B:
        return 9
    if opcode in (0x4E, 0x54):
        return 13
    if opcode in (0x52, 0x53):
        return 7 + int.from_bytes(prefix[5:7], "big") if len(prefix) >= 7 else None
    if opcode == 0x70:
        if len(prefix) < 10:
            return None
        queue_len = int.from_bytes(prefix[1:3], "big")
        key_len = int.from_bytes(prefix[6:8], "big")
        payload_len = int.from_bytes(prefix[8:10], "big")
        return 10 + key_len + payload_len + queue_len
    if opcode == 0x71:
        if len(prefix) < 16:
            return None
        lengths = (prefix[1:3], prefix[12:14], prefix[14:16])  # queue, key, payload
        return 16 + sum(int.from_bytes(length, "big") for length in lengths)
    return 3 + int.from_bytes(prefix[1:3], "big") if len(prefix) >= 3 else None


@settings(max_examples=300, deadline=None)
@given(stream=streams, data=st.data())
def test_any_bytes_give_frames_then_at_most_a_protocol_error(
    stream: bytes, data: st.DataObject
) -> None:
    decoder = FrameDecoder()
    frames: list[ClientFrame] = []
    error: ProtocolError | None = None
    for chunk in data.draw(chunked(stream)):
        decoder.feed(chunk)
        try:
            frames.extend(decoder)
        except ProtocolError as exc:  # anything else fails the test
            error = exc
            break
    decoded = b"".join(encode(frame) for frame in frames)
    if isinstance(error, MalformedFrame):
        # A known opcode whose time field (the last field of release and touch, the first of
        # reserve and leased subscribe) is above 24 h, or a push with options whose delay is
        # above 30 days.
        assert stream[error.offset] == error.byte
        assert decoded == stream[: error.offset]
        frame = stream[error.offset :]
        if error.byte == 0x71:
            assert int.from_bytes(frame[7:11], "big") > wire.MAX_DELAY_MS
        else:
            at = 9 if error.byte in (0x4E, 0x54) else 1
            assert int.from_bytes(frame[at : at + 4], "big") > wire.MAX_LEASE_MS
    elif error is not None:
        # Every frame before the bad byte was yielded, and the error names that very byte.
        assert stream[error.offset] == error.byte
        assert error.byte not in OPCODES
        assert decoded == stream[: error.offset]
    else:
        assert decoded == stream[: len(decoded)]
        rest = stream[len(decoded) :]
        assert decoder.pending == len(rest)
        if rest:  # the start of a valid frame that has not fully arrived
            assert rest[0] in OPCODES
            needed = _expected_length(rest)
            assert needed is None or needed > len(rest)


# --- the C decoder of push and pop (pinpriq/_codec.c) against the Python one ---------------

# Streams heavy in the frames the C decoder reads (pushes and pops naming a few queues, one
# longer than the names a decoder shares), with every other frame, junk bytes and 71s whose
# delay is over the most (malformed: the C decoder leaves them to wire.py) spliced in.
hot_names = st.sampled_from([b"", b"q", b"jobs", b"n" * 257])
hot_frames = st.one_of(
    st.builds(Push, hot_names, fields, fields, st.integers(0, 65535), st.integers(0, 255)),
    st.builds(
        DelayedPush,
        hot_names,
        fields,
        fields,
        st.integers(0, wire.MAX_TTL_MS),
        st.integers(0, 255),
        st.integers(0, wire.MAX_DELAY_MS),
    ),
    st.builds(Pop, hot_names),
)
too_long_delays = st.integers(wire.MAX_DELAY_MS + 1, 0xFFFF_FFFF).map(
    lambda delay: bytes.fromhex("71 0000 00000000") + delay.to_bytes(4, "big") + bytes(5)
)
hot_streams = st.lists(
    st.one_of(
        hot_frames.map(encode),
        client_frames.map(encode),
        too_long_delays,
        st.binary(min_size=1, max_size=3),
    ),
    max_size=24,
).map(b"".join)


def decode_all(chunks: list[bytes], *, native: bool) -> tuple[Any, ...]:
    """Everything a decoder makes of ``chunks``: each chunk's frames and their classes, what it
    holds pending after each, and the error it stops at."""
    decoder = FrameDecoder(native=native)
    assert (decoder._native is not None) == native  # the decoder this test means to compare
    seen = []
    for chunk in chunks:
        decoder.feed(chunk)
        frames = decoder.decode()
        seen.append((frames, [frame.__class__ for frame in frames], decoder.pending))
    error = decoder.error
    stop = None if error is None else (error.__class__, error.offset, error.byte, str(error))
    return seen, stop


@pytest.mark.skipif(wire._codec is None, reason="the C decoder (pinpriq/_codec.c) is not built")
@settings(max_examples=300, deadline=None)
@given(stream=hot_streams, data=st.data())
def test_the_c_decoder_gives_the_python_decoders_frames_and_errors(
    stream: bytes, data: st.DataObject
) -> None:
    for chunks in ([stream], one_byte_at_a_time(stream), data.draw(chunked(stream))):
        assert decode_all(chunks, native=True) == decode_all(chunks, native=False)


@pytest.mark.skipif(wire._codec is None, reason="the C decoder (pinpriq/_codec.c) is not built")
def test_the_c_decoder_shares_one_queue_name_and_one_pop_frame() -> None:
    # What the Python decoder does for the store's sake (one name object, hashed once; one
    # frame for a pipelined run of pops), across chunks too.
    decoder = FrameDecoder()
    decoder.feed(encode(Push(b"jobs", b"k", b"p")) + encode(Pop(b"jobs")) * 2)
    push, pop, again = decoder.decode()
    decoder.feed(encode(Pop(b"jobs")) + encode(Push(b"jobs", b"k", b"p")))
    later, push2 = decoder.decode()
    assert push.queue is pop.queue is push2.queue
    assert pop is again is later


def test_unknown_opcode_at_stream_start() -> None:
    decoder = FrameDecoder()
    decoder.feed(b"\x00")
    with pytest.raises(ProtocolError) as info:
        decoder.next_frame()
    assert (info.value.offset, info.value.byte) == (0, 0x00)


def test_unknown_opcode_offset_counts_from_stream_start_across_chunks() -> None:
    decoder = FrameDecoder()
    decoder.feed(bytes.fromhex("50 0002 6162 41"))  # pop "ab", ready: 6 bytes
    assert list(decoder) == [Pop(b"ab"), READY]
    decoder.feed(bytes.fromhex("41 ff"))
    frames: list[ClientFrame] = []
    with pytest.raises(ProtocolError) as info:
        frames.extend(decoder)
    assert frames == [READY]
    assert (info.value.offset, info.value.byte) == (7, 0xFF)
    assert "0xff" in str(info.value)


def test_bytes_inside_a_frame_are_not_taken_for_opcodes() -> None:
    # 0xff in the key and the payload is data, not an unknown opcode.
    data = bytes.fromhex("70 0000 0000 01 0001 0001 ff ff")
    assert decode_frames([data]) == [Push(b"", b"\xff", b"\xff", 0, 1)]


def test_protocol_error_is_a_value_error() -> None:
    assert issubclass(ProtocolError, ValueError)


# --- limits --------------------------------------------------------------------------------------

TOO_LONG = b"x" * 65536


@pytest.mark.parametrize(
    ("frame", "field"),
    [
        (Push(queue=TOO_LONG, key=b"", payload=b""), "queue"),
        (Push(queue=b"", key=TOO_LONG, payload=b""), "key"),
        (Push(queue=b"", key=b"", payload=TOO_LONG), "payload"),
        (Push(queue=b"", key=b"", payload=b"", ttl_ms=-1), "ttl_ms"),
        (Push(queue=b"", key=b"", payload=b"", ttl_ms=1 << 32), "ttl_ms"),
        (DelayedPush(b"", b"", b"", 0, 1, 2_592_000_001), "delay_ms"),
        (DelayedPush(b"", b"", b"", 0, 1, -1), "delay_ms"),
        (DelayedPush(TOO_LONG, b"", b"", 0, 1, 1), "queue"),
        (Push(queue=b"", key=b"", payload=b"", prio=-1), "prio"),
        (Push(queue=b"", key=b"", payload=b"", prio=256), "prio"),
        (Pop(TOO_LONG), "queue"),
        (Subscribe(TOO_LONG), "queue"),
        (Unsubscribe(TOO_LONG), "queue"),
        (Auth(TOO_LONG), "token"),
    ],
)
def test_encode_rejects_out_of_range_field_naming_it(frame: ClientFrame, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        encode(frame)


@pytest.mark.parametrize("frame_type", [Pop, Subscribe, Unsubscribe, Auth])
def test_encode_accepts_longest_queue_name(
    frame_type: type[Pop | Subscribe | Unsubscribe | Auth],
) -> None:
    data = encode(frame_type(b"n" * 65535))
    assert data[1:3] == b"\xff\xff"
    assert len(data) == 3 + 65535


def test_an_auth_frame_never_shows_its_token() -> None:
    frame = Auth(b"hunter2")
    assert "hunter2" not in repr(frame)
    assert "hunter2" not in str(frame)
    assert repr(frame) == "Auth(<7 bytes>)"


def test_an_auth_frame_is_not_a_pop_of_the_same_bytes() -> None:
    assert Auth(b"q") != Pop(b"q")
    assert decode_frames([b"\x61\x00\x01q\x50\x00\x01q"]) == [Auth(b"q"), Pop(b"q")]


def test_encode_reply_rejects_more_than_65535_packets() -> None:
    with pytest.raises(ValueError, match="65535"):
        encode_reply([Packet(b"", b"")] * 65536)


def test_encode_reply_accepts_65535_packets() -> None:
    packets: Sequence[Packet] = [Packet(b"", b"")] * 65535
    data = encode_reply(packets)
    assert data[:2] == b"\xff\xff"
    assert len(data) == 2 + 4 * 65535
    assert decode_replies([data]) == [list(packets)]


# --- leases (protocol 1.1, decisions 13-18) ------------------------------------------------------


@pytest.mark.parametrize(
    ("hex_bytes", "message"),
    [
        (
            "52 05265c01 0001 71",
            "malformed reserve frame (0x52) at stream offset 0: lease time "
            "86,400,001 ms is above the most, 86,400,000 ms (24 h)",
        ),
        (
            "53 ffffffff 0000",
            "malformed leased subscribe frame (0x53) at stream offset 0: lease time",
        ),
        (
            "4e 0000000000000001 05265c01",
            "malformed release frame (0x4e) at stream offset 0: release delay 86,400,001 ms",
        ),
        ("54 0000000000000001 ffffffff", "malformed touch frame (0x54) at stream offset 0: lease"),
    ],
)
def test_a_time_above_24_hours_makes_the_frame_malformed(hex_bytes: str, message: str) -> None:
    for chunks in ([bytes.fromhex(hex_bytes)], one_byte_at_a_time(bytes.fromhex(hex_bytes))):
        decoder = FrameDecoder()
        decoder.feed(bytes.fromhex("41"))
        frames = decoder.decode()
        for chunk in chunks:
            decoder.feed(chunk)
            frames += decoder.decode()
        assert frames == [READY]  # the frame before it, and nothing after
        assert isinstance(decoder.error, MalformedFrame)
        assert str(decoder.error).startswith(message.replace("offset 0", "offset 1"))
        with pytest.raises(ProtocolError):  # iterating raises it, as any protocol error
            decoder.next_frame()


def test_a_malformed_reserve_is_refused_from_its_header_without_waiting_for_the_name() -> None:
    decoder = FrameDecoder()
    decoder.feed(bytes.fromhex("52 ffffffff ffff"))  # a 65,535-byte name announced, none sent
    assert decoder.decode() == []
    assert isinstance(decoder.error, MalformedFrame)


# --- push with options (protocol 1.2, decision 21) --------------------------------------------


def test_a_push_with_options_and_no_delay_is_a_push() -> None:
    frame = bytes.fromhex("71 0001 0000ea60 00000000 07 0001 0002 6b 7676 71")
    assert decode_frames([frame]) == [Push(b"q", b"k", b"vv", ttl_ms=60_000, prio=7)]
    assert decode_frames([frame])[0].__class__ is Push


def test_a_push_that_fits_1_0_is_encoded_as_70_for_old_servers() -> None:
    assert encode(Push(b"q", b"k", b"", ttl_ms=65535))[0] == 0x70
    assert encode(DelayedPush(b"q", b"k", b"", 65535, 1, 0))[0] == 0x70
    assert encode(Push(b"q", b"k", b"", ttl_ms=65536))[0] == 0x71


def test_a_delay_above_30_days_makes_the_frame_malformed_from_its_header() -> None:
    # The header announces 65,535-byte fields that never come: the header alone decides.
    header = bytes.fromhex("71 ffff 00000000 9a7ec801 01 ffff ffff")
    for chunks in ([header], one_byte_at_a_time(header)):
        decoder = FrameDecoder()
        decoder.feed(bytes.fromhex("21"))
        frames = decoder.decode()
        for chunk in chunks:
            decoder.feed(chunk)
            frames += decoder.decode()
        assert frames == [SYNC]
        assert isinstance(decoder.error, MalformedFrame)
        assert str(decoder.error) == (
            "malformed delayed push frame (0x71) at stream offset 1: delay 2,592,000,001 ms is"
            " above the most, 2,592,000,000 ms (30 days)"
        )


def test_the_largest_frame_is_a_push_with_options_of_196621_bytes() -> None:
    frame = DelayedPush(b"q" * 65535, b"k" * 65535, b"p" * 65535, 0xFFFF_FFFF, 255, 1)
    data = encode(frame)
    assert len(data) == wire.MAX_FRAME == 196_621
    assert decode_frames([data]) == [frame]
    assert decode_frames([data[:-1]]) == []


@pytest.mark.parametrize(
    ("frame", "field"),
    [
        (Reserve(b"q", 86_400_001), "lease_ms"),
        (Reserve(b"q", -1), "lease_ms"),
        (Reserve(TOO_LONG), "queue"),
        (LeasedSubscribe(b"q", 86_400_001), "lease_ms"),
        (Ack(-1), "lease_id"),
        (Ack(1 << 64), "lease_id"),
        (Release(1, 86_400_001), "delay_ms"),
        (Touch(1, 86_400_001), "lease_ms"),
    ],
)
def test_encode_rejects_lease_fields_out_of_range(frame: ClientFrame, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        encode(frame)


def test_lease_replies_have_an_11_byte_header() -> None:
    # lease id u64 | attempt u8 | count u16 | packets
    data = bytes.fromhex("0000000000000007 02 0002 0001 0001 6b 61 0001 0000 6b")
    packets = [Packet(b"k", b"a"), Packet(b"k", b"")]
    assert encode_lease_reply(7, 2, packets) == data
    assert encode_lease_reply(7, 300, packets)[8] == 0xFF  # the byte saturates at 255
    assert encode_lease_status(7, True) == bytes.fromhex("0000000000000007 01 0000")
    assert encode_lease_status(9, False) == bytes.fromhex("0000000000000009 00 0000")
    assert bytes.fromhex("0000000000000000 00 0000") == LEASED_EMPTY


def test_reply_decoder_reads_lease_messages_in_any_chunking() -> None:
    data = (
        encode_lease_reply(7, 2, [Packet(b"k", b"a"), Packet(b"k", b"")])
        + encode_lease_status(7, True)
        + LEASED_EMPTY
    )
    expected = [
        LeaseReply(7, 2, [Packet(b"k", b"a"), Packet(b"k", b"")]),
        LeaseReply(7, 1, []),
        LeaseReply(0, 0, []),
    ]
    for chunks in ([data], one_byte_at_a_time(data)):
        decoder = ReplyDecoder()
        got = []
        for chunk in chunks:
            decoder.feed(chunk)
            while (reply := decoder.next_lease_reply()) is not None:
                got.append(reply)
        assert got == expected
    assert expected[1].live
    assert not LeaseReply(7, 0, []).live


def test_reply_decoder_mixes_both_headers_as_the_caller_says() -> None:
    # A plain connection: a reserve reply, then a pop reply, then an ack's answer.
    decoder = ReplyDecoder()
    decoder.feed(
        encode_lease_reply(1, 1, [Packet(b"a", b"")])
        + encode_reply([Packet(b"b", b"")])
        + encode_lease_status(1, False)
    )
    assert decoder.next_lease_reply() == LeaseReply(1, 1, [Packet(b"a", b"")])
    assert decoder.next_reply() == [Packet(b"b", b"")]
    assert decoder.next_lease_reply() == LeaseReply(1, 0, [])
    assert decoder.next_reply() is None


@pytest.mark.parametrize("count", [1, 2, 3])
def test_replies_leave_no_memory_behind(count: int) -> None:
    # The compiled build once leaked an intermediate bytes object in every one-packet reply and
    # lease reply (``header + key + payload`` under mypyc): memory grew with every pop.
    packets = [(b"key%d" % i, b"payload") for i in range(count)]
    encode_reply(packets)  # anything made once (caches) is made now
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(10_000):
            encode_reply(packets)
            encode_lease_reply(7, 1, packets)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 10_000, f"{grown} bytes left behind by 10,000 replies"


@pytest.mark.parametrize("count", [0, 1, 3])
def test_append_reply_appends_the_bytes_of_encode_reply(count: int) -> None:
    # The server writes a batch's replies into one buffer: what is there already stays.
    packets = [(b"key%d" % i, b"payload" * i, 1) for i in range(count)]
    output = bytearray(b"earlier")
    append_reply(output, packets)
    assert bytes(output) == b"earlier" + encode_reply(packets)


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("field", ["key", "payload"])
def test_a_reply_refuses_a_field_its_u16_length_cannot_hold(count: int, field: str) -> None:
    # Lengths are packed into one integer: a longer field would spill into the next one.
    big = {"key": b"k", "payload": b"p", field: bytes(MAX_FIELD + 1)}
    with pytest.raises(ArgumentError, match=field):
        append_reply(bytearray(), [(big["key"], big["payload"])] * count)


def test_append_reply_leaves_no_memory_behind() -> None:
    packets = [(b"key", b"payload")]
    output = bytearray()
    append_reply(output, packets)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(10_000):
            append_reply(output, packets)
            del output[:]
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 10_000, f"{grown} bytes left behind by 10,000 replies"


def test_frames_naming_one_queue_share_one_name_object() -> None:
    # The store looks queues up by name: one object per connection's queue means its hash is
    # computed once, not for every frame; a pipelined pop is one frame object.
    decoder = FrameDecoder()
    decoder.feed(encode(Push(b"jobs", b"k", b"p")) + encode(Pop(b"jobs")) * 2)
    push, pop, again = decoder.decode()
    decoder.feed(encode(Push(b"jobs", b"k2", b"p")) + encode(Pop(b"other")))
    later, other = decoder.decode()
    assert push.queue is pop.queue is later.queue
    assert pop is again
    assert other == Pop(b"other")


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_a_push_queue_and_a_pop_queue_used_in_turn_keep_their_shared_objects(
    native: bool,
) -> None:
    # A worker pushing to one queue and popping another (or a client sending a pop after each
    # push, as pinpriq-bench's barrier at pipeline 1) keeps one name object for its pushes and
    # one frame for its pops, request after request, rather than a new name and pop frame for
    # every frame as when the two names took turns in one slot.
    if native and wire._codec is None:
        pytest.skip("the C decoder (pinpriq/_codec.c) is not built")
    decoder = FrameDecoder(native=native)
    frames = []
    for key in (b"a", b"b", b"c"):
        decoder.feed(encode(Push(b"results", key, b"p")) + encode(Pop(b"barrier")))
        frames += decoder.decode()
    pushes, pops = frames[0::2], frames[1::2]
    assert [push.key for push in pushes] == [b"a", b"b", b"c"]
    assert pushes[0].queue is pushes[1].queue is pushes[2].queue
    assert pops[0] is pops[1] is pops[2] == Pop(b"barrier")


def test_a_long_queue_name_is_not_kept_by_the_decoder() -> None:
    # Names are shared only up to a bound, so an idle connection never holds a 64 KiB name.
    long_name = b"q" * 0xFFFF
    decoder = FrameDecoder()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        decoder.feed(encode(Push(long_name, b"k", b"p")) + encode(Pop(long_name)))
        assert decoder.decode() == [Push(long_name, b"k", b"p"), Pop(long_name)]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 0xFFFF, f"the decoder holds {held} bytes after decoding every frame"
