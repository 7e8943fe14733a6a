"""One way to show bytes to people (``pinpriq.display``): readable, one line, and reversible."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pinpriq.display import escape, json_value, unescape


@pytest.mark.parametrize(
    ("data", "shown"),
    [
        (b"orders", "orders"),
        ("café €".encode(), "café €"),
        (b"a\\b", "a\\\\b"),
        (b"tab\there\nnl\r", "tab\\there\\nnl\\r"),
        (b"\x00\x01\x7f", "\\x00\\x01\\x7f"),
        (b"\xff\xfe", "\\xff\\xfe"),  # not UTF-8
        ("\u0085".encode(), "\\xc2\\x85"),  # a character that does not print: its bytes
        (b"\x85", "\\x85"),  # the lone byte, which must look different
        ("zero\u200bwidth".encode(), "zero\\xe2\\x80\\x8bwidth"),
        (b"\\x41", "\\\\x41"),  # a name that looks like an escape stays itself
    ],
)
def test_escape_shows_printable_utf8_and_escapes_the_rest(data: bytes, shown: str) -> None:
    assert escape(data) == shown
    assert unescape(shown) == data


@given(st.binary(max_size=64) | st.text(max_size=32).map(str.encode))
def test_escape_is_one_line_and_reversible(data: bytes) -> None:
    shown = escape(data)
    assert "\n" not in shown
    assert "\r" not in shown
    assert unescape(shown) == data


def test_json_value_is_text_or_base64() -> None:
    assert json_value(b"caf\xc3\xa9") == "café"
    assert json_value(b"\xff") == {"base64": "/w=="}
