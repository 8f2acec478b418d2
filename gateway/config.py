"""The gateway's settings and its API keys (each mapped to a tenant and priorities)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from producer.client import DEFAULT_REPLICA_ACK_TIMEOUT_MS
from producer.contract.keys import DEFAULT_QUEUE, DEFAULT_RESULT_TTL
from producer.contract.routing import TENANT_RE

# OpenAI's limits of a batch input file.
MAX_FILE_BYTES = 200 * 2**20
MAX_FILE_LINES = 50_000
# Batch lines wait behind interactive requests (priority 0): lower runs first.
DEFAULT_BATCH_PRIORITY = 10
DEFAULT_FILE_TTL = 30 * 24 * 3600
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who an API key acts for: its tenant (None: no tenant) and the priorities of its jobs."""

    name: str | None = None
    priority: int = 0
    batch_priority: int = DEFAULT_BATCH_PRIORITY

    @property
    def owner(self) -> str:
        """The owner of files and batches in Redis ("" for requests without a tenant)."""
        return self.name or ""


@dataclass(slots=True)
class GatewayConfig:
    """Everything `pagedq serve` takes: Redis, queue, address, keys and the file limits."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    queue: str = DEFAULT_QUEUE
    queue_shards: int = 1  # hash-tagged shards of the queue, as the workers' --queue-shards
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: dict[str, Tenant] = field(default_factory=dict)
    max_file_bytes: int = MAX_FILE_BYTES
    max_file_lines: int = MAX_FILE_LINES
    batch_priority: int = DEFAULT_BATCH_PRIORITY
    file_ttl: int = DEFAULT_FILE_TTL
    result_ttl: int = DEFAULT_RESULT_TTL
    # How often the batch runner looks at the active batches (seconds).
    batch_poll_s: float = 0.5
    # The batch lease: a gateway that dies holding it is replaced after this many seconds.
    batch_lease_s: float = 15.0
    # Uploads are stored (and batches enqueued) in chunks of whole lines of about this size.
    file_chunk_bytes: int = 1 << 20
    # Enqueues wait for this many replicas to acknowledge them (Redis WAIT); 0: no wait.
    min_replicas_ack: int = 0
    replica_ack_timeout_ms: int = DEFAULT_REPLICA_ACK_TIMEOUT_MS

    def check(self) -> None:
        """Refuse a non-loopback address without keys: anyone could use the queue then."""
        if not self.api_keys and self.host not in LOOPBACK_HOSTS:
            raise ValueError(
                f"--host {self.host} without API keys would open the queue to anyone who can "
                "reach it: give --api-key or --api-keys-file, or bind to 127.0.0.1"
            )


def load_api_keys(path: str, batch_priority: int = DEFAULT_BATCH_PRIORITY) -> dict[str, Tenant]:
    """Read an API keys file: a JSON object {"KEY": {"tenant": T, "priority": P,
    "batch_priority": B}} (every field optional; a bare string value is the tenant)."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must hold a JSON object mapping each key to its tenant")
    keys = {}
    for key, value in raw.items():
        if isinstance(value, str) or value is None:
            value = {"tenant": value}
        if not isinstance(value, dict):
            raise ValueError(f"{path}: the value of a key must be an object, got {value!r:.40}")
        unknown = set(value) - {"tenant", "priority", "batch_priority"}
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {sorted(unknown)} for a key")
        tenant = value.get("tenant")
        if tenant is not None and not (isinstance(tenant, str) and TENANT_RE.match(tenant)):
            raise ValueError(f"{path}: tenant must be 1 to 64 of [A-Za-z0-9_.-], got {tenant!r}")
        priority, bulk = value.get("priority", 0), value.get("batch_priority", batch_priority)
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in (priority, bulk)):
            raise ValueError(f"{path}: priority and batch_priority must be integers")
        keys[key] = Tenant(tenant, priority, bulk)
    return keys
