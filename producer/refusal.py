"""Telling a refusal apart from an outage: a wrong password, an ACL that forbids a command or a
key, or a refused certificate is a setting to fix, so nothing should wait it out.

redis-py raises a wrong password (WRONGPASS, NOAUTH) as AuthenticationError, a ConnectionError
like an unreachable server; an ACL refusal (NOPERM) as NoPermissionError; a refused certificate
as a ConnectionError caused by an ssl error (producer/tls_failure.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    NoPermissionError,
    RedisError,
)

from producer.tls_failure import tls_failure

CREDENTIALS_HINT = "check the user and password of the Redis URL"
ACL_HINT = (
    "the ACL user needs pagedq's keys, channels and commands, e.g. "
    "`ACL SETUSER pagedq on >PASSWORD ~rq:* ~pagedq:* &* +@all`"
)


@dataclass(frozen=True, slots=True)
class Refusal:
    """What Redis refused, Redis's own words, and what to check."""

    summary: str  # with {at} where the server's URL goes
    detail: str
    hint: str

    def message(self, at: str = "", during: str = "") -> str:
        """One line, e.g. `Redis at redis://u:***@host/0 refused the credentials: WRONGPASS
        ... (check the user and password of the Redis URL)` for at=" at redis://..."; `during`
        (" while ...") follows the summary."""
        return f"{self.summary.format(at=at)}{during}: {self.detail} ({self.hint})"


class RedisRefusedError(RedisError):
    """Redis refused pagedq (credentials, ACL or certificate): a setting to fix, not an outage.

    Not a ConnectionError, so nothing that waits out outages retries it."""

    def __init__(self, refusal: Refusal, during: str = "") -> None:
        super().__init__(refusal.message(during=during))
        self.refusal = refusal


def refusal(exc: BaseException) -> Refusal | None:
    """The refusal behind a redis-py error, or None for anything else (an outage, a bug)."""
    if isinstance(exc, RedisRefusedError):
        return exc.refusal
    tls = tls_failure(exc)
    if tls is not None:
        return Refusal("TLS to Redis{at} failed", tls.reason, tls.hint)
    text = str(exc).strip()
    code = text.split(" ", 1)[0]
    wrong_credentials = (AuthenticationError, AuthenticationWrongNumberOfArgsError)
    if isinstance(exc, wrong_credentials) or code in ("WRONGPASS", "NOAUTH"):
        return Refusal("Redis{at} refused the credentials", text, CREDENTIALS_HINT)
    if isinstance(exc, (NoPermissionError, AuthorizationError)) or code == "NOPERM":
        return Refusal("Redis{at} refused pagedq by its ACL", text, ACL_HINT)
    return None


def refused_error(exc: BaseException, during: str = "") -> RedisRefusedError | None:
    """The RedisRefusedError for `exc` (`during`: " while ..."), or None when `exc` is no
    refusal."""
    found = refusal(exc)
    return None if found is None else RedisRefusedError(found, during)
