"""When to renew leases and when to reap other workers' expired ones."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(slots=True)
class Leases:
    """The heartbeat and reaper schedule of one worker.

    Every execution this worker holds is a lease of `lease_ttl` seconds in RQ's started
    registry; heartbeats renew all of them every lease_ttl / 3 seconds in one script. The
    reaper (every lease_ttl / 2) requeues jobs whose lease expired: their worker died.
    """

    lease_ttl: int
    next_heartbeat_at: float = 0.0
    next_reap_at: float = 0.0

    def heartbeat_due(self) -> bool:
        """True (and the next one scheduled) when it is time to heartbeat."""
        t = time.monotonic()
        if t < self.next_heartbeat_at:
            return False
        self.next_heartbeat_at = t + max(0.5, self.lease_ttl / 3)
        return True

    def reap_due(self) -> bool:
        """True (and the next one scheduled) when it is time to reap expired leases."""
        t = time.monotonic()
        if t < self.next_reap_at:
            return False
        self.next_reap_at = t + max(1.0, self.lease_ttl / 2)
        return True

    def now(self) -> None:
        """Heartbeat and reap at the next chance (e.g. right after Redis came back)."""
        self.next_heartbeat_at = self.next_reap_at = 0.0
