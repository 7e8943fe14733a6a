"""How pinpriq shows bytes to people: queue names, keys and payloads, in one line of text.

One rule everywhere (the CLI, the admin listener's JSON and metrics, the dashboard), so a name
copied from one is the name shown by the others: printable UTF-8 as it is, a backslash as
``\\\\``, ASCII control characters as ``\\t``, ``\\n``, ``\\r`` or ``\\xNN``, and every other
byte (bytes that are not UTF-8, and the UTF-8 of characters that do not print) as ``\\xNN``.
``\\xNN`` therefore always stands for one byte, and ``unescape`` gives the bytes back.
"""

from __future__ import annotations

import base64
import re

__all__ = ["escape", "json_value", "unescape"]

_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
_UNSHORT = {"\\": b"\\", "t": b"\t", "n": b"\n", "r": b"\r"}
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|[\\tnr])")


def escape(data: bytes) -> str:
    """``data`` as one line of text (see the module's rule); ``unescape`` reverses it."""
    out = []
    for char in data.decode("utf-8", "surrogateescape"):
        code = ord(char)
        if char == "\\":
            out.append("\\\\")
        elif 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8, smuggled by surrogateescape
            out.append(f"\\x{code - 0xDC00:02x}")
        elif char.isprintable():
            out.append(char)
        elif char in _SHORT:
            out.append(_SHORT[char])
        else:  # byte by byte, so \xNN is never a character: U+0085 is \xc2\x85, not \x85
            out.extend(f"\\x{byte:02x}" for byte in char.encode("utf-8"))
    return "".join(out)


def unescape(text: str) -> bytes:
    """The bytes ``escape`` showed as ``text``. A backslash that starts no escape stays."""
    out = bytearray()
    position = 0
    for match in _ESCAPE.finditer(text):
        out += text[position : match.start()].encode("utf-8")
        code = match.group(1)
        out += bytes([int(code[1:], 16)]) if code[0] == "x" else _UNSHORT[code]
        position = match.end()
    out += text[position:].encode("utf-8")
    return bytes(out)


def json_value(data: bytes) -> str | dict[str, str]:
    """``data`` for a JSON document: a string when it is UTF-8, else ``{"base64": ...}``."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}
