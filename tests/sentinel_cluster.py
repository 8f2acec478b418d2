"""A real Sentinel setup for tests: a primary, a replica and three Sentinels on 127.0.0.1."""

from __future__ import annotations

import signal
import time

import pytest
import redis

from worker.redis_server import PrivateRedis

SERVICE = "pagedq"
# A primary starts a full sync at once, not after Redis's default 5 s wait for more replicas.
FAST_SYNC = ["--repl-diskless-sync-delay", "0"]


def sentinel_config(primary_port: int, down_after_ms: int, failover_timeout_ms: int) -> str:
    """A Sentinel's config: watch the primary, quorum 2 of 3, quick to judge it down."""
    return (
        f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n"
        f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
        f"sentinel failover-timeout {SERVICE} {failover_timeout_ms}\n"
        f"sentinel parallel-syncs {SERVICE} 1\n"
    )


def start_sentinel(config: str) -> PrivateRedis:
    """A redis-server in Sentinel mode; skips the test when the server has no Sentinel mode."""
    try:
        return PrivateRedis(config=config, args=["--sentinel"])
    except RuntimeError as exc:
        pytest.skip(f"this redis-server cannot run as a Sentinel (--sentinel): {exc}")


def replica_args(primary_port: int) -> list[str]:
    """Server options of a replica of the server on `primary_port`."""
    return [*FAST_SYNC, "--replicaof", "127.0.0.1", str(primary_port)]


def wait_until(check, timeout: float, what: str) -> None:
    """Poll `check()` every 0.1 s until it is true; AssertionError naming `what` after timeout."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.1)


def replica_in_sync(replica: PrivateRedis) -> bool:
    """True once the replica's link to its primary is up."""
    try:
        return replica.client().info("replication").get("master_link_status") == "up"
    except redis.ConnectionError:
        return False


class SentinelCluster:
    """Primary + replica + 3 Sentinels, each a redis-server of its own on a free port.

    `url` is the redis+sentinel:// URL of the service. `kill_primary()` SIGKILLs whichever
    server is primary now; `wait_failover(old)` waits until every Sentinel names a new one.
    `freeze_replication()` before the kill makes the primary's last writes die with it.
    """

    def __init__(self, down_after_ms: int = 1000, failover_timeout_ms: int = 5000) -> None:
        self.servers: dict[int, PrivateRedis] = {}
        self.sentinels: list[PrivateRedis] = []
        self._frozen: list[PrivateRedis] = []
        try:
            primary = self._add(PrivateRedis(args=FAST_SYNC))
            replica = self._add(PrivateRedis(args=replica_args(primary.port)))
            # The replica first: a Sentinel finds replicas in the primary's INFO, read at once
            # when it starts and then only every 10 s.
            wait_until(lambda: replica_in_sync(replica), 20, "the replica to sync")
            config = sentinel_config(primary.port, down_after_ms, failover_timeout_ms)
            for _ in range(3):
                self.sentinels.append(start_sentinel(config))
            wait_until(self._sentinels_ready, 30, "the Sentinels to see the replica and each other")
        except BaseException:
            self.close()
            raise
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        self.url = f"redis+sentinel://{hosts}/{SERVICE}"

    def _add(self, server: PrivateRedis) -> PrivateRedis:
        self.servers[server.port] = server
        return server

    def _sentinels_ready(self) -> bool:
        for sentinel in self.sentinels:
            state = sentinel.client().sentinel_masters().get(SERVICE)
            if not state or state["num-slaves"] < 1 or state["num-other-sentinels"] < 2:
                return False
        return True

    def primary_port(self, sentinel: int = 0) -> int:
        """The port of the primary as one Sentinel sees it."""
        _, port = self.sentinels[sentinel].client().sentinel_get_master_addr_by_name(SERVICE)
        return int(port)

    @property
    def primary(self) -> PrivateRedis:
        """The server the first Sentinel names primary."""
        return self.servers[self.primary_port()]

    def replicas_of(self, port: int) -> list[PrivateRedis]:
        """The other running servers (replicas of `port` once the Sentinels are done)."""
        return [s for p, s in self.servers.items() if p != port and s.process.poll() is None]

    def freeze_replication(self) -> None:
        """SIGSTOP the replicas and cut their links: what the primary writes from now on reaches
        none of them, as with a replica lagging when the primary dies. `kill_primary()` resumes
        them; keep it under the Sentinels' down-after-milliseconds, or none can be promoted."""
        port = self.primary_port()
        self._frozen = self.replicas_of(port)
        for replica in self._frozen:
            replica.process.send_signal(signal.SIGSTOP)
        self.servers[port].client().client_kill_filter(_type="replica")

    def kill_primary(self) -> int:
        """SIGKILL the primary (a crash: what it did not replicate is lost); its port."""
        port = self.primary_port()
        self.servers[port].kill()
        for replica in self._frozen:
            replica.process.send_signal(signal.SIGCONT)
        self._frozen = []
        return port

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Wait until every Sentinel names a primary other than `old_port`, and that server
        says it is one; its port."""

        def promoted() -> bool:
            ports = {self.primary_port(i) for i in range(len(self.sentinels))}
            if len(ports) != 1 or old_port in ports:
                return False
            role = self.servers[ports.pop()].client().info("replication")["role"]
            return role == "master"

        wait_until(promoted, timeout, "the Sentinels to promote a replica")
        return self.primary_port()

    def rejoin_as_replica(self, port: int, timeout: float = 20.0) -> None:
        """Start the killed server `port` again as a replica of the current primary, and wait
        until it is in sync (what a failed primary does once repaired)."""
        server = self.servers[port]
        server.args = replica_args(self.primary_port())
        server.start()
        wait_until(lambda: replica_in_sync(server), timeout, f"server {port} to sync")

    def close(self) -> None:
        """Stop every server and Sentinel."""
        for server in [*self.sentinels, *self.servers.values()]:
            server.close()

    def __enter__(self) -> SentinelCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
