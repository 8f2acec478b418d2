"""Weighted fair sharing between tenants: per-tenant virtual time in tokens (the seed's WFQ)."""

from __future__ import annotations

import time
from collections import deque

from engine.request import Request

DEFAULT_TENANT = "default"
"""The account of requests that name no tenant."""

STARVATION_BOOST = 0.3
"""A request that has waited ``starvation_seconds`` has its virtual finish time lowered by 30%."""


def tenant_of(request: Request) -> str:
    """The account a request is charged to."""
    return request.tenant or DEFAULT_TENANT


class FairShare:
    """Virtual time per tenant: tokens computed for it divided by its weight.

    The next request comes from the tenant with the smallest virtual finish time
    ``virtual_time + remaining_tokens / weight``, lowered by up to ``STARVATION_BOOST`` as the
    request waits. Virtual times are taken relative to the smallest one among the tenants that
    have work (the system virtual time): that keeps the seed's order while making the
    multiplicative starvation boost independent of how long the engine has been up.
    """

    def __init__(
        self, weights: dict[str, float] | None = None, starvation_seconds: float | None = 60.0
    ) -> None:
        self.weights = dict(weights or {})
        self.starvation_seconds = starvation_seconds
        self.virtual_time: dict[str, float] = {}
        self.num_active: dict[str, int] = {}
        self.generated_tokens: dict[str, int] = {}

    def weight(self, tenant: str) -> float:
        """The tenant's share weight (1 unless configured)."""
        return self.weights.get(tenant, 1.0)

    def system_virtual_time(self) -> float:
        """The smallest virtual time among tenants with work (0 when none has any)."""
        active = [self.virtual_time.get(t, 0.0) for t in self.num_active]
        return min(active) if active else 0.0

    def activate(self, request: Request) -> None:
        """A request of this tenant entered the engine."""
        tenant = tenant_of(request)
        if not self.num_active.get(tenant):
            # A tenant that had nothing to run must not bank credit while idle: it comes back
            # no earlier than the system virtual time.
            floor = self.system_virtual_time() if self.num_active else 0.0
            self.virtual_time[tenant] = max(self.virtual_time.get(tenant, 0.0), floor)
        self.num_active[tenant] = self.num_active.get(tenant, 0) + 1

    def deactivate(self, request: Request) -> None:
        """A request of this tenant left the engine (finished or aborted)."""
        tenant = tenant_of(request)
        left = self.num_active.get(tenant, 0) - 1
        if left > 0:
            self.num_active[tenant] = left
        else:
            self.num_active.pop(tenant, None)

    def charge(self, request: Request, num_tokens: int) -> None:
        """Account ``num_tokens`` computed tokens (prompt or output) to the request's tenant."""
        tenant = tenant_of(request)
        self.virtual_time[tenant] = self.virtual_time.get(tenant, 0.0) + num_tokens / self.weight(
            tenant
        )

    def count_generated(self, request: Request, num_tokens: int = 1) -> None:
        """Count sampled tokens per tenant (a statistic; fairness charges computed tokens)."""
        tenant = tenant_of(request)
        self.generated_tokens[tenant] = self.generated_tokens.get(tenant, 0) + num_tokens

    def virtual_finish_time(self, request: Request, now: float | None = None) -> float:
        """The seed's key: smaller finishes earlier in the fair schedule.

        With ``now`` (a waiting request), the starvation boost applies: the key falls linearly
        by up to 30% over ``starvation_seconds`` of waiting.
        """
        tenant = tenant_of(request)
        vft = self.virtual_time.get(tenant, 0.0) - self.system_virtual_time()
        vft += request.num_remaining_tokens / self.weight(tenant)
        if now is None or not self.starvation_seconds:
            return vft
        waited = max(now - request.arrival_time, 0.0)
        return vft * (1.0 - STARVATION_BOOST * min(waited / self.starvation_seconds, 1.0))


class TokenRate:
    """Tokens per second over a sliding window of recent steps."""

    def __init__(self, window_seconds: float = 10.0) -> None:
        self.window_seconds = window_seconds
        self._samples: deque[tuple[float, int]] = deque()
        self._started: float | None = None

    def record(self, num_tokens: int, now: float | None = None) -> None:
        """Note ``num_tokens`` produced at ``now``."""
        now = time.time() if now is None else now
        if self._started is None:
            self._started = now
        self._samples.append((now, num_tokens))
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window_seconds:
            self._samples.popleft()

    def rate(self, now: float | None = None) -> float:
        """Tokens per second over the window (or since the first sample, if more recent)."""
        now = time.time() if now is None else now
        self._expire(now)
        if not self._samples or self._started is None:
            return 0.0
        span = min(self.window_seconds, now - self._started)
        return sum(n for _, n in self._samples) / span if span > 0 else 0.0
