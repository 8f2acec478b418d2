"""Redis URLs: sentinel URLs parsed or refused with a reason, clients built, passwords hidden."""

from __future__ import annotations

import asyncio

import pytest
import redis
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.sentinel import SentinelConnectionPool

from gateway.cli import build_parser as gateway_parser
from gateway.cli import config_from_args as gateway_config
from producer.cli import main
from producer.connection import (
    RedisURLError,
    SentinelURL,
    async_redis_client,
    check_url,
    parse_sentinel_url,
    redis_client,
)
from producer.retry import redact_url
from worker.redis_link import connect


@pytest.mark.parametrize(
    "url, parsed",
    [
        (
            "redis+sentinel://10.0.0.1:26379,10.0.0.2:26380/pagedq",
            SentinelURL((("10.0.0.1", 26379), ("10.0.0.2", 26380)), "pagedq", {}),
        ),
        (
            "redis+sentinel://s1/pagedq/3",
            SentinelURL((("s1", 26379),), "pagedq", {"db": 3}),
        ),
        (
            "rediss+sentinel://app:p%40ss@[::1]:5000,s2:5001/my-service/0?socket_timeout=2.5",
            SentinelURL(
                (("::1", 5000), ("s2", 5001)),
                "my-service",
                {
                    "db": 0,
                    "socket_timeout": 2.5,
                    "username": "app",
                    "password": "p@ss",
                    "ssl": True,
                },
            ),
        ),
        (
            "redis+sentinel://:secret@h:1/svc",
            SentinelURL((("h", 1),), "svc", {"password": "secret"}),
        ),
    ],
)
def test_sentinel_urls_parse(url, parsed):
    assert parse_sentinel_url(url) == parsed
    check_url(url)


@pytest.mark.parametrize(
    "url, problem",
    [
        ("redis+sentinel://h:26379", "names no service"),
        ("redis+sentinel://h:26379/", "names no service"),
        ("redis+sentinel:///pagedq", "names no Sentinel host:port"),
        ("redis+sentinel://,/pagedq", "names no Sentinel host:port"),
        ("redis+sentinel://h:port/pagedq", "port must be 1 to 65535, got 'port'"),
        ("redis+sentinel://h:1,h:70000/pagedq", "port must be 1 to 65535, got '70000'"),
        ("redis+sentinel://:26379/pagedq", "has no host"),
        ("redis+sentinel://::1:26379/pagedq", "must be written [address]:port"),
        ("redis+sentinel://h/pagedq/zero", "db must be a number >= 0, got 'zero'"),
        ("redis+sentinel://h/pagedq/0/extra", "more than /service/db"),
        ("redis+sentinel://h/pagedq?socket_timeout=soon", "bad query option"),
    ],
)
def test_bad_sentinel_urls_say_what_is_wrong_and_the_expected_form(url, problem):
    with pytest.raises(RedisURLError) as err:
        check_url(url)
    assert problem in str(err.value)
    assert "redis+sentinel://[user:password@]host:port[,host:port...]/service_name" in str(
        err.value
    )
    with pytest.raises(ValueError, match="expected"):
        redis_client(url)


@pytest.mark.parametrize("url", ["http://h:6379", "redis://h:notaport/0", "sentinel://h/x"])
def test_other_bad_urls_list_every_accepted_form(url):
    with pytest.raises(RedisURLError, match=r"expected redis://.*unix://.*redis\+sentinel://"):
        check_url(url)


def test_plain_urls_build_plain_clients_with_the_callers_options():
    client = redis_client("redis://127.0.0.1:6390/2", socket_connect_timeout=3, client_name="x")
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["port"], kwargs["db"], kwargs["client_name"]) == (6390, 2, "x")
    assert kwargs["socket_connect_timeout"] == 3


def test_sentinel_urls_build_clients_of_the_services_primary():
    url = "redis+sentinel://u:pw@127.0.0.1:1,127.0.0.1:2/svc/4"
    client = redis_client(url, socket_connect_timeout=3, client_name="x")
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.is_master
    assert pool.service_name == "svc"
    kwargs = pool.connection_kwargs
    assert (kwargs["db"], kwargs["username"], kwargs["password"]) == (4, "u", "pw")
    assert (kwargs["client_name"], kwargs["socket_connect_timeout"]) == ("x", 3)
    # The Sentinels are asked without the data nodes' password, with short timeouts.
    asked = [s.connection_pool.connection_kwargs for s in pool.sentinel_manager.sentinels]
    assert [(k["port"], k.get("password")) for k in asked] == [(1, None), (2, None)]
    assert all(k["socket_timeout"] <= 2 for k in asked)
    # The worker's client is built the same way.
    assert isinstance(connect(url).connection_pool, SentinelConnectionPool)


def test_no_known_primary_is_a_connection_error():
    # Nothing listens on port 1: no Sentinel answers, so no primary is known (redis-py's
    # MasterNotFoundError), which the worker and the producer treat as an outage.
    with pytest.raises(redis.ConnectionError, match="No master found for 'svc'"):
        redis_client("redis+sentinel://127.0.0.1:1/svc").ping()


def test_async_clients_blocking_pool_and_single_connection():
    async def build():
        url = "redis+sentinel://127.0.0.1:1/svc"
        pooled = async_redis_client(url, blocking=True, max_connections=7, timeout=3)
        assert isinstance(pooled.connection_pool, AsyncSentinelPool)
        assert isinstance(pooled.connection_pool, redis.asyncio.BlockingConnectionPool)
        assert (pooled.connection_pool.max_connections, pooled.connection_pool.timeout) == (7, 3)
        single = async_redis_client(url, single_connection_client=True)
        assert single.single_connection_client
        with pytest.raises(redis.ConnectionError):
            await single.ping()
        plain = async_redis_client("redis://127.0.0.1:6390/0", blocking=True, max_connections=5)
        assert isinstance(plain.connection_pool, redis.asyncio.BlockingConnectionPool)
        for client in (pooled, single, plain):
            await client.aclose()

    asyncio.run(build())


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis+sentinel://u:pw@h1:1,h2:2/svc/0", "redis+sentinel://u:***@h1:1,h2:2/svc/0"),
        ("rediss+sentinel://:pw@[::1]:1,h2/svc", "rediss+sentinel://:***@[::1]:1,h2/svc"),
        ("redis+sentinel://h1:1,h2:2/svc", "redis+sentinel://h1:1,h2:2/svc"),
        ("redis://u:p@w@h:6379/0", "redis://u:***@h:6379/0"),
        ("redis://:pw@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
    ],
)
def test_passwords_are_hidden_in_every_url_form(url, shown):
    assert redact_url(url) == shown


def test_the_cli_refuses_a_bad_url_in_one_line_without_the_password(capsys):
    code = main(["status", "--redis-url", "redis+sentinel://u:hunter2@h:1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "names no service" in err and "hunter2" not in err and "u:***@h:1" in err
    assert "Traceback" not in err


def test_the_gateway_refuses_a_bad_url_before_serving():
    args = gateway_parser().parse_args(["--redis-url", "redis+sentinel://h:1,h:x/svc"])
    with pytest.raises(ValueError, match="port must be 1 to 65535"):
        gateway_config(args)
    args = gateway_parser().parse_args(["--redis-url", "redis+sentinel://h:1/svc"])
    assert gateway_config(args).redis_url == "redis+sentinel://h:1/svc"
