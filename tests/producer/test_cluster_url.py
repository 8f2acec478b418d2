"""redis+cluster:// URLs: parsed without contacting anything, malformed ones refused in one line
naming what is wrong and the accepted forms."""

from __future__ import annotations

import pytest

from producer.connection import (
    ClusterURL,
    RedisURLError,
    check_url,
    is_cluster_url,
    parse_cluster_url,
    redis_client,
)


@pytest.mark.parametrize(
    "url, parsed",
    [
        ("redis+cluster://10.0.0.1:7000", ClusterURL((("10.0.0.1", 7000),), {})),
        ("redis+cluster://a,b:7001/", ClusterURL((("a", 6379), ("b", 7001)), {})),
        (
            "rediss+cluster://app:p%40ss@a:1,[::1]:2/0?socket_timeout=3",
            ClusterURL(
                (("a", 1), ("::1", 2)),
                {"socket_timeout": 3.0, "username": "app", "password": "p@ss", "ssl": True},
            ),
        ),
    ],
)
def test_cluster_urls_parse(url, parsed):
    assert is_cluster_url(url)
    assert parse_cluster_url(url) == parsed
    check_url(url)


@pytest.mark.parametrize(
    "url, problem",
    [
        ("redis+cluster://", "names no node host:port"),
        ("redis+cluster://a:1/3", "a cluster has only db 0"),
        ("redis+cluster://a:port", "port must be 1 to 65535, got 'port'"),
        ("redis+cluster://::1:7000", "must be written [address]:port"),
        ("redis+cluster://a?socket_timeout=soon", "bad query option"),
    ],
)
def test_bad_cluster_urls_say_what_is_wrong_and_the_expected_form(url, problem):
    with pytest.raises(RedisURLError) as err:
        check_url(url)
    message = str(err.value)
    assert problem in message and "\n" not in message
    assert "expected redis+cluster://[user:password@]host:port[,host:port...]" in message
    with pytest.raises(ValueError, match="expected"):
        redis_client(url)


def test_every_form_is_named_when_the_scheme_is_unknown():
    with pytest.raises(RedisURLError, match=r"redis\+sentinel://.*redis\+cluster://"):
        check_url("cluster://h:7000")
