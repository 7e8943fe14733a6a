"""Who may come in: the server's one token (where it comes from, how a presented token is
checked) and the address test of protected mode.

The token authenticates clients on the data port (protocol 1.1's auth frame, decision 12) and
on the admin listener (``Authorization: Bearer``). It is read from a file or from the
environment, never from a command-line value, which ``ps`` would show to every user. A server
without a token is in protected mode unless told otherwise: only clients on loopback get in.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Mapping

__all__ = ["TOKEN_VARIABLE", "TokenError", "is_loopback", "load_token", "tokens_match"]

#: The environment variable both the server and the clients read the token from.
TOKEN_VARIABLE = "PINPRIQ_AUTH_TOKEN"


class TokenError(ValueError):
    """The token cannot be used: unreadable, empty, or given twice. The message says which."""


def load_token(path: str | None, environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The server's token from ``path`` (one trailing newline stripped, as ``echo`` leaves it)
    or from ``PINPRIQ_AUTH_TOKEN``; ``None`` when neither is set. An empty token, an unreadable
    file, or both sources at once raise ``TokenError``."""
    from_environment = environ.get(TOKEN_VARIABLE)
    if path is not None and from_environment is not None:
        raise TokenError(f"give the token in --auth-token-file or in {TOKEN_VARIABLE}, not both")
    if path is not None:
        try:
            with open(path, "rb") as file:
                token = file.read()
        except OSError as error:
            raise TokenError(f"cannot read the token file {path}: {error.strerror}") from None
        token = token.removesuffix(b"\n").removesuffix(b"\r")
        where = f"the token file {path}"
    elif from_environment is not None:
        token = os.fsencode(from_environment)
        where = TOKEN_VARIABLE
    else:
        return None
    if not token:
        raise TokenError(f"{where} holds an empty token; an empty token is refused")
    return token


def tokens_match(presented: bytes, expected: bytes) -> bool:
    """Whether a presented token is the server's, in time that does not depend on where they
    differ (``hmac.compare_digest``), so timing tells an attacker nothing."""
    return hmac.compare_digest(presented, expected)


def is_loopback(host: str) -> bool:
    """Whether a peer's address (as ``getpeername`` gives it) is this host's loopback:
    127.0.0.0/8, ``::1``, or an IPv4 loopback address mapped into IPv6 (``::ffff:127.0.0.1``,
    what a dual-stack socket reports). Anything else, unparsable included, is not."""
    try:
        address = ipaddress.ip_address(host.partition("%")[0])  # no IPv6 zone (fe80::1%eth0)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback
