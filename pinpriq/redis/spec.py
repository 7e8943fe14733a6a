"""``--store``: which store a server uses. Parsed without importing the Redis client, so the
built-in store's start pays nothing for it.

``memory`` (the default) is the built-in store. ``redis://HOST:PORT/DB`` and ``rediss://``
(TLS) name a standalone Redis; ``redis-cluster://HOST:PORT[,HOST:PORT...]`` a Redis Cluster
(any of its nodes; the rest are discovered). A password goes in the URL's user part
(``redis://:PASSWORD@HOST:PORT``), as redis-cli takes it.
"""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import unquote, urlsplit

__all__ = ["StoreError", "StoreSpec", "parse_store"]

_SCHEMES = ("redis", "rediss", "redis-cluster")


class StoreError(Exception):
    """A bad --store value, or a Redis the server cannot use; the message is one line."""


class StoreSpec(NamedTuple):
    """A parsed ``--store``."""

    scheme: str  # memory, redis, rediss or redis-cluster
    nodes: tuple[tuple[str, int], ...] = ()
    db: int = 0
    password: str | None = None
    username: str | None = None
    text: str = "memory"  # as given, less any password, for the log


def parse_store(text: str) -> StoreSpec:
    """``memory``, ``redis://HOST[:PORT][/DB]``, ``rediss://...`` or
    ``redis-cluster://HOST:PORT[,HOST:PORT...]``; raises ``StoreError`` saying what is wrong."""
    if text == "memory":
        return StoreSpec("memory")
    scheme, sep, _ = text.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise StoreError(
            f"--store {text!r}: expected memory, redis://HOST:PORT/DB, rediss://HOST:PORT/DB "
            "or redis-cluster://HOST:PORT[,HOST:PORT...]"
        )
    parts = urlsplit(text)
    if parts.query or parts.fragment:
        raise StoreError(f"--store: no ?query or #fragment is understood in {scheme}:// URLs")
    creds, _, hosts = parts.netloc.rpartition("@")
    user, _, password = creds.partition(":")
    nodes = tuple(_node(item, text) for item in hosts.split(","))
    if scheme != "redis-cluster" and len(nodes) != 1:
        raise StoreError(f"--store {scheme}:// takes one HOST:PORT; a Cluster is redis-cluster://")
    db = _db(parts.path, scheme)
    shown = text.replace(f":{password}@", ":***@") if password else text
    return StoreSpec(scheme, nodes, db, unquote(password) or None, unquote(user) or None, shown)


def _node(item: str, text: str) -> tuple[str, int]:
    host, sep, port = item.rpartition(":")
    if not sep:
        host, port = item, "6379"
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StoreError(f"--store {text!r}: {item!r} is not HOST:PORT")
    return host, int(port)


def _db(path: str, scheme: str) -> int:
    number = path.strip("/")
    if not number:
        return 0
    if scheme == "redis-cluster":
        raise StoreError("--store redis-cluster:// takes no database number (a Cluster has one)")
    if not number.isdigit():
        raise StoreError(f"--store: the database must be a number, not {number!r}")
    return int(number)
