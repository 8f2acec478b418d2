"""call_with_retry: Redis outages are waited out with backoff, one log line per attempt."""

from __future__ import annotations

import logging

import pytest
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError

from producer.retry import RedisUnavailableError, call_with_retry, redact_url


def flaky(failures: int, exc: Exception):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= failures:
            raise exc
        return "ok"

    return fn, calls


def test_an_outage_is_retried_with_growing_delays_and_logged(caplog):
    fn, calls = flaky(5, RedisConnectionError("Connection refused"))
    slept = []
    with caplog.at_level(logging.WARNING, logger="pagedq.producer"):
        assert call_with_retry(fn, "reading job j", sleep=slept.append) == "ok"
    assert len(calls) == 6 and slept == [0.5, 1.0, 2.0, 4.0, 8.0]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 6
    assert messages[0] == (
        "Redis unreachable while reading job j (Connection refused); attempt 1, retrying in 0.5 s"
    )
    assert messages[-1] == "Redis reachable again after 5 failed attempt(s) (reading job j)"


def test_redis_loading_its_aof_counts_as_an_outage():
    fn, calls = flaky(1, BusyLoadingError("Redis is loading the dataset in memory"))
    assert call_with_retry(fn, "x", sleep=lambda s: None) == "ok" and len(calls) == 2


def test_it_gives_up_after_max_wait_s():
    fn, calls = flaky(100, RedisConnectionError("down"))
    with pytest.raises(RedisUnavailableError, match="Redis unreachable for 0 s while x: down"):
        call_with_retry(fn, "x", max_wait_s=0.1, sleep=lambda s: None)
    assert len(calls) == 1  # the first delay (0.5 s) already exceeds the budget


def test_a_nested_wait_that_gave_up_is_not_waited_out_again():
    fn, calls = flaky(100, RedisUnavailableError("Redis unreachable for 600 s while x"))
    with pytest.raises(RedisUnavailableError, match="600 s"):
        call_with_retry(fn, "outer", sleep=lambda s: None)
    assert len(calls) == 1


def test_other_errors_are_not_retried():
    fn, calls = flaky(1, ValueError("bug"))
    with pytest.raises(ValueError):
        call_with_retry(fn, "x", sleep=lambda s: None)
    assert len(calls) == 1


def test_redact_url_hides_the_password_only():
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("rediss://user:pw@h/1") == "rediss://user:***@h/1"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
