"""Redis clients from a URL: redis://, rediss://, unix://, and Sentinel-managed primaries.

`redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]` names the
Sentinels to ask and the service whose primary to use; `rediss+sentinel://` speaks TLS to the
data nodes (the Sentinels themselves are asked in plain TCP). The user and password are the data
nodes'. Query options are redis-py's, as in a redis:// URL. Discovery and failover are
redis-py's own (`Sentinel.master_for`): every new connection asks the Sentinels where the
primary is, and a connection to a demoted primary is dropped (a ConnectionError to the caller).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.backoff import NoBackoff
from redis.connection import parse_url
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
URL_FORMS = (
    "redis://[user:password@]host[:port][/db], rediss://... (TLS), unix:///path/to.sock, or "
    + SENTINEL_FORM
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
    if parts.query:
        try:
            options.update(parse_url(f"redis://?{parts.query}"))
        except ValueError as exc:
            raise RedisURLError(f"bad query option: {exc}", SENTINEL_FORM) from None
    if userinfo:
        user, colon, password = userinfo.partition(":")
        if user:
            options["username"] = unquote(user)
        if colon:
            options["password"] = unquote(password)
    if parts.scheme.lower() == "rediss+sentinel":
        options["ssl"] = True
    return SentinelURL(sentinels, unquote(segments[0]), options)


def check_url(url: str) -> None:
    """Raise RedisURLError when `url` is not a Redis URL pagedq can use (nothing is contacted)."""
    if is_sentinel_url(url):
        parse_sentinel_url(url)
        return
    try:
        parse_url(url)
    except ValueError as exc:
        raise RedisURLError(f"invalid Redis URL ({exc})") from None


def _host_port(text: str) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
    elif text.count(":") > 1:
        raise RedisURLError(
            f"IPv6 Sentinel address {text!r} must be written [address]:port", SENTINEL_FORM
        )
    else:
        host, _, port = text.partition(":")
    if not host:
        raise RedisURLError(f"Sentinel address {text!r} has no host", SENTINEL_FORM)
    if not port:
        return host, DEFAULT_SENTINEL_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RedisURLError(
            f"Sentinel address {text!r}: port must be 1 to 65535, got {port!r}", SENTINEL_FORM
        )
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


def redis_client(url: str, **kwargs: Any) -> redis.Redis:
    """A redis-py client for any URL form pagedq takes; `kwargs` are redis-py's (timeouts,
    retry, client_name, ...). With a sentinel URL the client follows the current primary."""
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
    BlockingConnectionPool: `max_connections`, and `timeout` seconds) instead of raising."""
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
