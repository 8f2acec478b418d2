"""Redis clients from a URL: redis://, rediss://, unix://, Sentinel-managed primaries, and
Redis Cluster.

`redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]` names the
Sentinels to ask and the service whose primary to use; `rediss+sentinel://` speaks TLS to the
data nodes (the Sentinels themselves are asked in plain TCP). The user and password are the data
nodes'. Query options are redis-py's, as in a redis:// URL. Discovery and failover are
redis-py's own (`Sentinel.master_for`): every new connection asks the Sentinels where the
primary is, and a connection to a demoted primary is dropped (a ConnectionError to the caller).

`redis+cluster://[user:password@]host:port[,host:port...]` names some nodes of a Redis Cluster
(any of them: the client asks one for the slot map); `rediss+cluster://` speaks TLS. The client
is redis-py's RedisCluster: it sends each command to the primary of its key's slot and follows
MOVED / ASK redirections and failovers itself (docs/OPERATIONS.md, "Redis Cluster").
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.crc import key_slot
from redis.retry import Retry
from redis.sentinel import Sentinel

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379
# Asking one Sentinel is quick; a dead or frozen one must not hold up asking the next.
SENTINEL_TIMEOUT_S = 2.0
SENTINEL_FORM = (
    "redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db] "
    "(rediss+sentinel:// for TLS to the data nodes)"
)
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_CLUSTER_PORT = 6379
CLUSTER_FORM = (
    "redis+cluster://[user:password@]host:port[,host:port...] (rediss+cluster:// for TLS)"
)
URL_FORMS = (
    "redis://[user:password@]host[:port][/db], rediss://... (TLS), unix:///path/to.sock, "
    + SENTINEL_FORM
    + ", or "
    + CLUSTER_FORM
)


class RedisURLError(ValueError):
    """A Redis URL that cannot be used; the message says what is wrong and the accepted forms."""

    def __init__(self, problem: str, expected: str = URL_FORMS) -> None:
        super().__init__(f"{problem}; expected {expected}")


@dataclass(frozen=True, slots=True)
class SentinelURL:
    """A parsed redis+sentinel:// URL: where the Sentinels are and which primary to use."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    # Connection options of the data nodes: db, username, password, ssl, query options.
    options: dict[str, Any] = field(default_factory=dict)


def is_sentinel_url(url: str) -> bool:
    """True for redis+sentinel:// and rediss+sentinel:// URLs."""
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelURL:
    """The Sentinels, service and options of a sentinel URL (RedisURLError when malformed)."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in SENTINEL_SCHEMES:
        raise RedisURLError(f"not a sentinel URL (scheme {parts.scheme!r})", SENTINEL_FORM)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    sentinels = tuple(_host_port(h) for h in hostlist.split(",") if h.strip())
    if not sentinels:
        raise RedisURLError("the sentinel URL names no Sentinel host:port", SENTINEL_FORM)
    segments = parts.path.strip("/").split("/") if parts.path.strip("/") else []
    if not segments or not segments[0]:
        raise RedisURLError(
            "the sentinel URL names no service (the path's first segment)", SENTINEL_FORM
        )
    if len(segments) > 2:
        raise RedisURLError(
            f"the sentinel URL's path {parts.path!r} has more than /service/db", SENTINEL_FORM
        )
    options: dict[str, Any] = {}
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise RedisURLError(f"db must be a number >= 0, got {segments[1]!r}", SENTINEL_FORM)
        options["db"] = int(segments[1])
    options.update(_url_options(parts, userinfo, SENTINEL_FORM))
    return SentinelURL(sentinels, unquote(segments[0]), options)


def _url_options(parts, userinfo: str, form: str) -> dict[str, Any]:
    """Query options, the data nodes' user and password, and TLS (a ``rediss+`` scheme) of a
    sentinel or cluster URL."""
    options: dict[str, Any] = {}
    if parts.query:
        try:
            options.update(parse_url(f"redis://?{parts.query}"))
        except ValueError as exc:
            raise RedisURLError(f"bad query option: {exc}", form) from None
    if userinfo:
        user, colon, password = userinfo.partition(":")
        if user:
            options["username"] = unquote(user)
        if colon:
            options["password"] = unquote(password)
    if parts.scheme.lower().startswith("rediss+"):
        options["ssl"] = True
    return options


@dataclass(frozen=True, slots=True)
class ClusterURL:
    """A parsed redis+cluster:// URL: some nodes of the cluster and the connection options."""

    nodes: tuple[tuple[str, int], ...]
    options: dict[str, Any] = field(default_factory=dict)


def is_cluster_url(url: str) -> bool:
    """True for redis+cluster:// and rediss+cluster:// URLs."""
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def is_cluster(connection: Any) -> bool:
    """True when `connection` is a Redis Cluster client (sync or asyncio)."""
    return isinstance(connection, RedisCluster | AsyncRedisCluster)


def parse_cluster_url(url: str) -> ClusterURL:
    """The nodes and options of a cluster URL (RedisURLError when malformed)."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in CLUSTER_SCHEMES:
        raise RedisURLError(f"not a cluster URL (scheme {parts.scheme!r})", CLUSTER_FORM)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    nodes = tuple(
        _host_port(h, "cluster node", CLUSTER_FORM, DEFAULT_CLUSTER_PORT)
        for h in hostlist.split(",")
        if h.strip()
    )
    if not nodes:
        raise RedisURLError("the cluster URL names no node host:port", CLUSTER_FORM)
    if parts.path.strip("/") not in ("", "0"):
        raise RedisURLError(
            f"a cluster has only db 0, the URL's path is {parts.path!r}", CLUSTER_FORM
        )
    options: dict[str, Any] = {}
    options.update(_url_options(parts, userinfo, CLUSTER_FORM))
    return ClusterURL(nodes, options)


def check_url(url: str) -> None:
    """Raise RedisURLError when `url` is not a Redis URL pagedq can use (nothing is contacted)."""
    if is_sentinel_url(url):
        parse_sentinel_url(url)
        return
    if is_cluster_url(url):
        parse_cluster_url(url)
        return
    try:
        parse_url(url)
    except ValueError as exc:
        raise RedisURLError(f"invalid Redis URL ({exc})") from None


def _host_port(
    text: str,
    what: str = "Sentinel",
    form: str = SENTINEL_FORM,
    default: int = DEFAULT_SENTINEL_PORT,
) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
    elif text.count(":") > 1:
        raise RedisURLError(f"IPv6 {what} address {text!r} must be written [address]:port", form)
    else:
        host, _, port = text.partition(":")
    if not host:
        raise RedisURLError(f"{what} address {text!r} has no host", form)
    if not port:
        return host, default
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RedisURLError(f"{what} address {text!r}: port must be 1 to 65535, got {port!r}", form)
    return host, int(port)


def _sentinel_kwargs(kwargs: dict[str, Any], retry: Any) -> dict[str, Any]:
    """Options of the connections to the Sentinels: the caller's socket_* ones but with short
    timeouts, and no retries (discovery moves on to the next Sentinel instead)."""
    given = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    return {
        **given,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "retry": retry,
    }


def _split(url: str, kwargs: dict[str, Any]) -> tuple[SentinelURL, dict[str, Any], bool]:
    """The parsed URL, the data nodes' options (the URL's win, as in redis-py's from_url) and
    whether one connection is wanted."""
    target = parse_sentinel_url(url)
    options = dict(kwargs)
    single = options.pop("single_connection_client", False)
    options.update(target.options)
    return target, options, single


def _own_pool(client: Any, single: bool) -> Any:
    """The client on the same pool, holding one connection when `single`."""
    if not single:
        return client
    one = type(client)(connection_pool=client.connection_pool, single_connection_client=True)
    client.auto_close_connection_pool = False
    one.auto_close_connection_pool = True
    return one


def _cluster_options(url: str, kwargs: dict[str, Any]) -> tuple[ClusterURL, dict[str, Any]]:
    """The parsed URL and the cluster client's options (the URL's win). A cluster client has
    a pool per node, so `single_connection_client` does not apply; its own retries follow a
    failover (its `retry`'s count), so a `retry` of fewer than 3 attempts is raised to 3."""
    target = parse_cluster_url(url)
    options = {k: v for k, v in kwargs.items() if k != "single_connection_client"}
    options.pop("health_check_interval", None)
    retry = options.pop("retry", None)
    options["retry"] = Retry(NoBackoff(), max(3, retry.get_retries() if retry else 3))
    options.update(target.options)
    return target, options


def redis_client(url: str, **kwargs: Any) -> redis.Redis:
    """A redis-py client for any URL form pagedq takes; `kwargs` are redis-py's (timeouts,
    retry, client_name, ...). With a sentinel URL the client follows the current primary; with
    a cluster URL it is a RedisCluster (same commands, routed by key slot)."""
    if is_cluster_url(url):
        target, options = _cluster_options(url, kwargs)
        nodes = [ClusterNode(host, port) for host, port in target.nodes]
        return RedisCluster(startup_nodes=nodes, **options)
    if not is_sentinel_url(url):
        try:
            return redis.Redis.from_url(url, **kwargs)
        except ValueError as exc:
            raise RedisURLError(f"invalid Redis URL ({exc})") from None
    target, options, single = _split(url, kwargs)
    sentinel = Sentinel(
        list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(kwargs, Retry(NoBackoff(), 0))
    )
    return _own_pool(sentinel.master_for(target.service, **options), single)


class _BlockingSentinelPool(AsyncSentinelPool, aioredis.BlockingConnectionPool):
    """A Sentinel-managed pool that waits `timeout` s for a free connection when all are used."""


def async_redis_client(url: str, *, blocking: bool = False, **kwargs: Any) -> aioredis.Redis:
    """`redis_client` for asyncio. With `blocking`, a full pool makes callers wait (redis-py's
    BlockingConnectionPool: `max_connections`, and `timeout` seconds) instead of raising; a
    cluster client's pools are per node and never block."""
    if is_cluster_url(url):
        target, options = _cluster_options(url, kwargs)
        options.pop("timeout", None)
        nodes = [AsyncClusterNode(host, port) for host, port in target.nodes]
        return AsyncRedisCluster(startup_nodes=nodes, **options)
    if not is_sentinel_url(url):
        try:
            if not blocking:
                return aioredis.Redis.from_url(url, **kwargs)
            single = kwargs.pop("single_connection_client", False)
            pool = aioredis.BlockingConnectionPool.from_url(url, **kwargs)
            return _own_pool(aioredis.Redis.from_pool(pool), single)
        except ValueError as exc:
            raise RedisURLError(f"invalid Redis URL ({exc})") from None
    target, options, single = _split(url, kwargs)
    no_retry = AsyncRetry(NoBackoff(), 0)
    sentinel = AsyncSentinel(
        list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(kwargs, no_retry)
    )
    pool_class = _BlockingSentinelPool if blocking else AsyncSentinelPool
    client = sentinel.master_for(target.service, connection_pool_class=pool_class, **options)
    return _own_pool(client, single)


def mget(connection: Any, keys: list[str]) -> list[Any]:
    """MGET of `keys`; on a cluster, one MGET per slot (redis-py's mget_nonatomic), in order
    (awaitable, for an asyncio client)."""
    if not keys:
        return []
    if is_cluster(connection):
        return connection.mget_nonatomic(keys)
    return connection.mget(keys)


# A reader of streams in several slots blocks on one slot at a time for this long.
CLUSTER_XREAD_SLICE_MS = 50


def xread(connection: Any, streams: dict[str, str], count: int, block_ms: int | None) -> list:
    """XREAD of `streams` (key -> last id) waiting up to `block_ms` (None: not at all).

    One XREAD on one Redis; on a cluster, where one XREAD reads one slot, each slot's streams
    are read at once and then waited on in turns of CLUSTER_XREAD_SLICE_MS, until an entry
    comes or `block_ms` has passed."""
    if not is_cluster(connection):
        return connection.xread(streams, count=count, block=block_ms) or []
    groups: dict[int, dict[str, str]] = {}
    for key, last in streams.items():
        groups.setdefault(key_slot(key.encode()), {})[key] = last
    parts = list(groups.values())
    if len(parts) == 1:
        return connection.xread(parts[0], count=count, block=block_ms) or []
    deadline = time.monotonic() + (block_ms or 0) / 1000
    turn = 0
    while True:
        out = [r for part in parts for r in connection.xread(part, count=count) or []]
        left_ms = int((deadline - time.monotonic()) * 1000)
        if out or block_ms is None or left_ms <= 0:
            return out
        part = parts[turn % len(parts)]
        turn += 1
        out = connection.xread(part, count=count, block=min(left_ms, CLUSTER_XREAD_SLICE_MS))
        if out:
            return out


# An asyncio reader of streams on a cluster polls each slot's streams this often.
CLUSTER_XREAD_POLL_S = 0.02


async def async_xread(
    connection: Any, streams: dict[str, str], count: int, block_ms: int | None
) -> list:
    """`xread` for asyncio (`block_ms` None: without blocking). On a cluster it reads each
    slot's streams without blocking, every CLUSTER_XREAD_POLL_S, until an entry comes or
    `block_ms` has passed (a blocked read there could not be woken by CLIENT UNBLOCK, which goes
    to one node)."""
    if not is_cluster(connection):
        return await connection.xread(streams, count=count, block=block_ms) or []
    groups: dict[int, dict[str, str]] = {}
    for key, last in streams.items():
        groups.setdefault(key_slot(key.encode()), {})[key] = last
    deadline = time.monotonic() + (block_ms or 0) / 1000
    while True:
        out = []
        for part in groups.values():
            out += await connection.xread(part, count=count) or []
        if out or time.monotonic() >= deadline:
            return out
        await asyncio.sleep(CLUSTER_XREAD_POLL_S)
