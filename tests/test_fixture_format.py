"""The fixture format's parser, and checks that the fixture files are what they claim to be.

The fixtures are hand-written data; these tests never regenerate them. They decode what each
fixture sends and expects with ``pinpriq.wire`` only to catch slips in the hand-counted
lengths, and to hold every fixture to its own queue names, so one server can run them all.
"""

from __future__ import annotations

import re
from collections import deque
from pathlib import Path

import pytest

from pinpriq.conformance import (
    DEFAULT_FIXTURES,
    Action,
    Fixture,
    FixtureError,
    Requires,
    Step,
    load_fixtures,
    parse_address,
    parse_bytes,
    parse_fixture,
)
from pinpriq.wire import (
    MAX_TTL_MS,
    Ack,
    Auth,
    ClientFrame,
    DelayedPush,
    FrameDecoder,
    LeasedSubscribe,
    Pop,
    ProtocolError,
    Push,
    Ready,
    Release,
    ReplyDecoder,
    Reserve,
    Sync,
    Touch,
)

FIXTURES = load_fixtures(DEFAULT_FIXTURES)
REPO = DEFAULT_FIXTURES.parent

# -- byte lists -------------------------------------------------------------------------------


def tokens(text: str, line: int = 1) -> list[tuple[int, str]]:
    return [(line, word) for word in text.split()]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("70 0004 00ff", b"\x70\x00\x04\x00\xff"),
        ("aBcD", b"\xab\xcd"),
        ('"jobs"', b"jobs"),
        ('""', b""),
        ('"a*b"', b"a*b"),
        ('0001 "k" "v"', b"\x00\x01kv"),
        ('"k"*3 00*2', b"kkk\x00\x00"),
        ('"k"*0', b""),
        ('( 41 "x" )*3', b"AxAxAx"),
        ("( 41 ) 42", b"AB"),
        ('"!$%&()*+,-./09:;<=>?@AZ[]^_`az{|}~"', b"!$%&()*+,-./09:;<=>?@AZ[]^_`az{|}~"),
    ],
)
def test_byte_lists(text: str, expected: bytes) -> None:
    assert parse_bytes(tokens(text)) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("123", "odd number of hex digits"),
        ("0x12", "neither hex bytes nor"),
        ("zz", "neither hex bytes nor"),
        ('"a"b', "neither hex bytes nor"),
        ('"\\"', "neither hex bytes nor"),
        ("( 00 ( 01 )*2 )*2", "groups do not nest"),
        ("( 00", "never closed"),
        (")*2", "without"),
        ("00*", "neither hex bytes nor"),
    ],
)
def test_bad_byte_lists(text: str, message: str) -> None:
    with pytest.raises(FixtureError, match=r"^line 7: .*" + re.escape(message)):
        parse_bytes(tokens(text, line=7))


# -- steps and files --------------------------------------------------------------------------

EXAMPLE = """\
# What this fixture shows,
# over two lines.

A send    50 0001 "q"       # pop
A expect  0000
B send
    70 0001 0000 01         # a push, header...
    # a comment line inside a continuation
    0001 0000 "k" "q"       # ...and the rest
B send-bytewise 41
wait 150ms
B expect-nothing 50ms
A expect-closed
B close
"""


def test_a_whole_fixture() -> None:
    fixture = parse_fixture(EXAMPLE, "example")
    assert fixture == Fixture(
        "example",
        "What this fixture shows, over two lines.",
        (
            Step(4, Action.SEND, "A", data=b"\x50\x00\x01q"),
            Step(5, Action.EXPECT, "A", data=b"\x00\x00"),
            Step(6, Action.SEND, "B", data=bytes.fromhex("70 0001 0000 01 0001 0000") + b"kq"),
            Step(10, Action.SEND_BYTEWISE, "B", data=b"A"),
            Step(11, Action.WAIT, ms=150),
            Step(12, Action.EXPECT_NOTHING, "B", ms=50),
            Step(13, Action.EXPECT_CLOSED, "A"),
            Step(14, Action.CLOSE, "B"),
        ),
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no steps"),
        ("# only a comment\n", "no steps"),
        ("  A send 00\n", "line 1: an indented line continues nothing"),
        ("A send\n", "line 1: send needs at least one byte"),
        ("A expect\n", "line 1: expect needs at least one byte"),
        ("A shout 00\n", "line 1: unknown action 'shout'"),
        ("A\n", "line 1: expected '<connection> <action> ...'"),
        ("1A send 00\n", "line 1: bad connection name '1A'"),
        ("wait 100\n", "line 1: expected a duration like 100ms, not '100'"),
        ("wait\n", "line 1: expected 'wait <N>ms'"),
        ("A expect-nothing\n", "line 1: expected 'A expect-nothing <N>ms'"),
        ("A expect-nothing 1s\n", "expected a duration like 100ms"),
        ("A close now\n", "line 1: close takes nothing after it"),
        ("A send 00\nA close\nA send 00\n", "line 3: connection A was already closed"),
        ("A expect-closed\nA expect 00\n", "line 2: connection A was already closed"),
        ("A send 00\n\n  wait 1ms\n", "line 3: 'wait' is neither hex bytes"),
        ("A send\n  ( 00\n  01\n", "line 3: '(' is never closed"),
        ("A send 61 $token-length $token\n", "line 1: $token-length is only for fixtures that"),
        ("requires token\nrequires token\nA send 00\n", "line 2: one 'requires token'"),
        ("A send 00\nrequires token\n", "line 2: one 'requires token' or 'requires no-token'"),
        ("requires tls\nA send 00\n", "line 1: requires 'token' or 'no-token', not 'tls'"),
        ("A expect-closed 1s\n", "expected a duration like 100ms"),
    ],
)
def test_bad_fixtures(text: str, message: str) -> None:
    with pytest.raises(FixtureError, match=re.escape(message)):
        parse_fixture(text, "bad")


def test_a_fixture_that_requires_a_token_names_it_with_its_length() -> None:
    text = "# auth\nrequires token\nA send 61 $token-length $token\nA expect-closed 5000ms\n"
    fixture = parse_fixture(text, "t", b"s3cret")
    assert fixture.requires is Requires.TOKEN
    assert fixture.steps == (
        Step(3, Action.SEND, "A", data=b"\x61\x00\x06s3cret"),
        Step(4, Action.EXPECT_CLOSED, "A", ms=5000),
    )
    assert parse_fixture("requires no-token\nA send 00\n", "t").requires is Requires.NO_TOKEN


def test_load_names_the_file_of_a_bad_fixture(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("A send 00\n")
    (tmp_path / "bad.txt").write_text("A send 0\n")
    with pytest.raises(FixtureError, match=r"bad\.txt: line 1: odd number"):
        load_fixtures(tmp_path)
    assert [fixture.name for fixture in load_fixtures(tmp_path, ["good"])] == ["good"]
    with pytest.raises(FixtureError, match="no fixture named nope"):
        load_fixtures(tmp_path, ["nope"])


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("127.0.0.1:7000", ("127.0.0.1", 7000)),
        ("localhost:1", ("localhost", 1)),
        ("[::1]:65535", ("::1", 65535)),
    ],
)
def test_addresses(text: str, address: tuple[str, int]) -> None:
    assert parse_address(text) == address


@pytest.mark.parametrize("text", ["localhost", ":7000", "host:", "host:0", "host:65536", "h:x"])
def test_bad_addresses(text: str) -> None:
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        parse_address(text)


# -- the fixture files ------------------------------------------------------------------------


def sent_by_connection(fixture: Fixture) -> dict[str, bytes]:
    sent: dict[str, bytes] = {}
    for step in fixture.steps:
        if step.action in (Action.SEND, Action.SEND_BYTEWISE):
            sent[step.conn] = sent.get(step.conn, b"") + step.data
    return sent


def last_action(fixture: Fixture, conn: str) -> Action:
    return [step.action for step in fixture.steps if step.conn == conn][-1]


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda f: f.name)
def test_fixture_sends_whole_frames_to_its_own_queues(fixture: Fixture) -> None:
    """Lengths counted right, and queues named ``<fixture>`` or ``<fixture>.<anything>``."""
    for conn, data in sent_by_connection(fixture).items():
        decoder = FrameDecoder()
        decoder.feed(data)
        frames = []
        try:
            frames.extend(decoder)
        except ProtocolError:
            # Only where the fixture says the server closes the connection for it.
            assert last_action(fixture, conn) is Action.EXPECT_CLOSED, f"{conn}: bad opcode"
        else:
            if decoder.pending:
                # A frame cut short only where the client closes the connection.
                assert last_action(fixture, conn) is Action.CLOSE, f"{conn}: bytes left over"
        for frame in frames:
            if isinstance(frame, Ready | Sync | Auth | Ack | Release | Touch):
                continue
            if fixture.name == "empty-name-and-key":
                assert frame.queue == b""
                continue
            name = fixture.name.encode()
            assert frame.queue == name or frame.queue.startswith(name + b"."), frame.queue
            if isinstance(frame, Push | DelayedPush):  # a 71 carries a u32 TTL (decision 21)
                assert 0 <= frame.ttl_ms <= MAX_TTL_MS


def decoded_frames(data: bytes) -> list[ClientFrame]:
    """The whole frames of ``data``, up to a bad byte if any."""
    decoder = FrameDecoder()
    decoder.feed(data)
    return decoder.decode()


class Connection:
    """What one connection of a fixture is owed, as far as the formats of replies go: the
    2-byte count, or the 11-byte lease header (decisions 13, 14 and 18)."""

    def __init__(self) -> None:
        self.leased = False  # a leased subscribe was sent: every message has the lease header
        self.owed: deque[bool] = deque()  # replies owed, in order: True for the lease header

    def sent(self, data: bytes) -> None:
        for frame in decoded_frames(data):
            if isinstance(frame, LeasedSubscribe):
                self.leased = True
            elif isinstance(frame, Pop):
                self.owed.append(False)
            elif isinstance(frame, Sync):
                self.owed.append(self.leased)
            elif isinstance(frame, Reserve | Ack | Release | Touch):
                self.owed.append(True)

    def expected(self, data: bytes, line: int) -> None:
        """``data`` is whole messages, each in the format its place calls for."""
        decoder = ReplyDecoder()
        decoder.feed(data)
        count = 0
        while decoder.pending:
            # The oldest reply owed has the format of its request's time; a delivery, that of
            # the connection now.
            leased = self.owed[0] if self.owed else self.leased
            if leased:
                lease = decoder.next_lease_reply()
                assert lease is not None, f"line {line}: part of a message"
                delivery = bool(lease.packets) and self.leased
            else:
                assert decoder.next_reply() is not None, f"line {line}: part of a reply"
                delivery = False
            count += 1
            if self.owed and not delivery:
                self.owed.popleft()
        assert count, f"line {line}: not one whole reply"


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda f: f.name)
def test_fixture_expects_whole_replies(fixture: Fixture) -> None:
    connections: dict[str, Connection] = {}
    for step in fixture.steps:
        conn = connections.setdefault(step.conn, Connection())
        if step.action in (Action.SEND, Action.SEND_BYTEWISE):
            conn.sent(step.data)
        elif step.action is Action.EXPECT:
            conn.expected(step.data, step.line)


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda f: f.name)
def test_fixture_says_what_it_shows(fixture: Fixture) -> None:
    assert len(fixture.description) > 40


@pytest.mark.parametrize("document", ["wire-fixtures/README.md", "docs/protocol.md"])
def test_documents_link_only_to_fixtures_that_exist(document: str) -> None:
    linked = re.findall(
        r"\]\((?:\.\./wire-fixtures/)?([a-z0-9-]+)\.txt\)", (REPO / document).read_text()
    )
    assert linked, "the document links no fixture"
    names = {fixture.name for fixture in FIXTURES}
    assert set(linked) <= names, f"links to missing fixtures: {sorted(set(linked) - names)}"


def test_the_fixtures_readme_lists_every_fixture() -> None:
    text = (DEFAULT_FIXTURES / "README.md").read_text()
    linked = set(re.findall(r"\]\(([a-z0-9-]+)\.txt\)", text))
    missing = {fixture.name for fixture in FIXTURES} - linked
    assert not missing, f"missing from wire-fixtures/README.md: {sorted(missing)}"
