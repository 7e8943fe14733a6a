"""Opening a Redis store (``spec.StoreSpec``): connect, check the Redis, load the scripts, run
the background tasks."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import coredis
import trio

from pinpriq.redis import lua
from pinpriq.redis.deliveries import RedisSubscriptions
from pinpriq.redis.direct import DirectConnection, DirectSubscriber
from pinpriq.redis.keys import PREFIX
from pinpriq.redis.spec import StoreError, StoreSpec
from pinpriq.redis.store import _TRANSIENT, RedisStore

__all__ = ["open_store"]

log = logging.getLogger("pinpriq.redis")
# coredis logs each retry of a connection at INFO; pinpriq says once what is wrong instead.
logging.getLogger("coredis").setLevel(logging.WARNING)

#: Seconds to reach Redis at start before giving up with one line.
CONNECT_TIMEOUT = 5.0


def _client(spec: StoreSpec) -> Any:
    common: dict[str, Any] = {
        "username": spec.username,
        "password": spec.password,
        "connect_timeout": CONNECT_TIMEOUT,
        "decode_responses": False,
    }
    if spec.scheme == "redis-cluster":
        return coredis.RedisCluster(
            startup_nodes=[coredis.connection.TCPLocation(h, p) for h, p in spec.nodes], **common
        )
    host, port = spec.nodes[0]
    return coredis.Redis(host, port, spec.db, ssl=spec.scheme == "rediss", **common)


def _direct_options(spec: StoreSpec) -> dict[str, Any]:
    """How ``direct.py``'s connections reach the Redis of ``spec``, as the client does."""
    return {
        "tls": spec.scheme == "rediss",
        "db": spec.db,
        "username": spec.username,
        "password": spec.password,
        "connect_timeout": CONNECT_TIMEOUT,
    }


@asynccontextmanager
async def open_store(spec: StoreSpec) -> AsyncIterator[tuple[RedisStore, RedisSubscriptions]]:
    """Connect, check the Redis (``check``), load the scripts; yields the store and its
    subscriptions, their background tasks running; closes the client on the way out. Raises
    ``StoreError`` (one line) if Redis cannot be reached or used."""
    ready = False
    try:
        async with _client(spec) as client:
            store = RedisStore(client, cluster=spec.scheme == "redis-cluster")
            with trio.fail_after(CONNECT_TIMEOUT):
                await check_nodes(client, spec)
                await store.load_scripts()
                await store.sync_clock()
            subscriber = None
            if spec.scheme != "redis-cluster":  # a Cluster routes by slot: coredis only
                store.direct = DirectConnection(*spec.nodes[0], **_direct_options(spec))
                subscriber = DirectSubscriber(*spec.nodes[0], **_direct_options(spec))
            subscriptions = RedisSubscriptions(store, subscriber)
            async with trio.open_nursery() as nursery:
                if store.direct is not None:
                    nursery.start_soon(store.direct.run)
                await nursery.start(subscriptions.run)
                nursery.start_soon(store.sweep_loop)
                nursery.start_soon(store.snapshot_loop)
                nursery.start_soon(store.lease_loop)
                ready = True
                try:
                    yield store, subscriptions
                finally:
                    nursery.cancel_scope.cancel()
                    if store.direct is not None:
                        store.direct.close()
    except BaseException as error:  # anyio's task group may wrap it in a group
        cause = _startup_failure(error)
        if ready or cause is None:
            raise
        if isinstance(cause, StoreError):
            raise cause from None  # already says what is wrong with this Redis
        raise StoreError(f"cannot use Redis at {spec.text}: {_why(cause)}") from None


def _startup_failure(error: BaseException) -> BaseException | None:
    """The error that kept Redis from being used at start, found in any exception groups."""
    if isinstance(error, StoreError):
        return error
    if isinstance(error, (trio.TooSlowError, *_TRANSIENT, coredis.exceptions.RedisError)):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = _startup_failure(inner)
            if found is not None:
                return found
    return None


def _why(error: BaseException) -> str:
    if isinstance(error, trio.TooSlowError):
        return f"no answer within {CONNECT_TIMEOUT:g} s"
    return str(error) or type(error).__name__


async def check_nodes(client: Any, spec: StoreSpec) -> None:
    """``check`` the Redis, or each primary of a Cluster; warn if any has replicas."""
    if spec.scheme != "redis-cluster":
        replicas = await check(client, spec)
    else:
        replicas = 0
        for node in client.primaries:
            async with node:
                replicas += await check(node, spec)
    if replicas:
        log.warning(
            "Redis replicates asynchronously (%d replicas now): a failover to a replica can lose "
            "the last writes a sync acknowledged",
            replicas,
        )


async def check(client: Any, spec: StoreSpec) -> int:
    """Refuse a Redis that may evict (it would drop packets silently) or is older than 7.0
    (the scripts declare flags); warn about what a Redis crash may lose. Returns how many
    replicas it has (``INFO replication``)."""
    info = await client.info("server")
    version = _text(info.get("redis_version", "0"))
    if tuple(int(x) for x in version.split(".")[:2]) < (7, 0):
        raise StoreError(f"Redis at {spec.text} is {version}; pinpriq needs Redis 7.0 or newer")
    await check_layout(client, spec)
    config = await client.config_get(["maxmemory-policy", "appendonly", "appendfsync"])
    settings = {_text(k): _text(v) for k, v in config.items()}
    policy = settings.get("maxmemory-policy", "")
    if policy != "noeviction":
        raise StoreError(
            f"Redis at {spec.text} has maxmemory-policy {policy}: it may evict keys, which would "
            "drop queued packets silently; set maxmemory-policy noeviction"
        )
    if settings.get("appendonly") != "yes":
        log.warning(
            "Redis at %s has appendonly no: queued packets do not survive a Redis restart "
            "(beyond its last RDB snapshot), and a sync promises only that Redis applied them",
            spec.text,
        )
    else:
        log.info("Redis appendfsync is %s", settings.get("appendfsync"))
    replication = await client.info("replication")
    return int(replication.get("connected_slaves", 0))


async def check_layout(client: Any, spec: StoreSpec) -> None:
    """Refuse a Redis whose queues another layout of the store's keys uses: front ends of an
    older or newer pinpriq left their library (``lua.LIBRARY_NAME``) there."""
    libraries = await client.function_list(libraryname="pinpriq_*")
    others = sorted(_text(name) for name in libraries if _text(name) != lua.LIBRARY_NAME)
    if others:
        raise StoreError(_other_layout(spec, others))
    # Layout 5 keeps a queue's sequence number in its hash; layouts 2-4 kept it in a ``:q``
    # string, which every queue of theirs holding packets has. Their keys, left after their
    # library was deleted, would be misread: refuse them too (one scan, at start).
    async for key in client.scan_iter(match=PREFIX + b"{q*:q", count=1000):
        raise StoreError(
            f"Redis at {spec.text} holds queues of an older pinpriq key layout ({_text(key)} "
            f"and maybe more; this build uses {lua.LIBRARY_NAME}): drain them with the build "
            "that wrote them, or delete their pq:* keys, before starting this one"
        )


def _other_layout(spec: StoreSpec, libraries: list[str]) -> str:
    """Why a Redis holding the functions ``libraries`` of other layouts is refused, and what to
    run: the upgrade (docs/redis.md) if this build reads their keys as they are."""
    names = ", ".join(libraries)
    found = f"Redis at {spec.text} holds the functions of another pinpriq key layout ({names}; "
    deletes = " and ".join(f"`redis-cli FUNCTION DELETE {name}`" for name in libraries)
    if all(_layout_of(name) in range(lua.KEYS_SINCE, lua.LAYOUT) for name in libraries):
        return (
            f"{found}this build uses {lua.LIBRARY_NAME} and reads their queues as they are): "
            f"to upgrade, stop every front end of the older build, run {deletes} "
            "(on every primary of a Cluster), then start this one"
        )
    return (
        f"{found}this build uses {lua.LIBRARY_NAME}): run every front end on one build, or "
        f"{deletes} once no front end of that build runs"
    )


def _layout_of(library: str) -> int:
    """The layout of library ``pinpriq_<N>``; -1 if it names none."""
    suffix = library.removeprefix("pinpriq_")
    return int(suffix) if suffix.isdigit() else -1


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
