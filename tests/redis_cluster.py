"""A real Redis Cluster for tests: six redis-servers on free ports of 127.0.0.1, three primaries
each with one replica, made by `redis-cli --cluster create`."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time

import pytest
import redis

from worker.redis_server import PrivateRedis

NODE_TIMEOUT_MS = 2000


def cluster_args(node_timeout_ms: int = NODE_TIMEOUT_MS) -> list[str]:
    """Server options of a cluster node that fails over quickly; the replica of a killed
    primary takes over without waiting for a data-age check."""
    return [
        "--cluster-enabled", "yes",
        "--cluster-node-timeout", str(node_timeout_ms),
        "--cluster-replica-validity-factor", "0",
        "--repl-diskless-sync-delay", "0",
    ]  # fmt: skip


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and below 65536 too."""
    for _ in range(200):
        port = random.randint(20000, 40000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_until(check, timeout: float, what: str) -> None:
    """Poll `check()` every 0.1 s until it is true; AssertionError naming `what` after timeout."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.1)


class RedisCluster:
    """Six cluster nodes (three primaries, three replicas) on 127.0.0.1.

    `url` is the redis+cluster:// URL naming every node. `kill_primary_of(key)` SIGKILLs the
    primary serving a key's slot; `wait_failover(port)` waits until a replica took its slots.
    """

    def __init__(self, nodes: int = 6, node_timeout_ms: int = NODE_TIMEOUT_MS) -> None:
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        if cli is None:
            pytest.skip("no redis-cli on PATH to create a cluster")
        self.servers: dict[int, PrivateRedis] = {}
        try:
            for _ in range(nodes):
                server = PrivateRedis(free_cluster_port(), args=cluster_args(node_timeout_ms))
                self.servers[server.port] = server
            hosts = [f"127.0.0.1:{p}" for p in self.servers]
            subprocess.run(
                [cli, "--cluster", "create", *hosts, "--cluster-replicas", "1", "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            wait_until(self._ready, 30, "the cluster to be ok with every replica in sync")
        except BaseException:
            self.close()
            raise
        self.url = "redis+cluster://" + ",".join(hosts)

    def _ready(self) -> bool:
        """Every node sees the cluster ok, with half the nodes replicas, each in sync."""
        try:
            for server in self.servers.values():
                client = server.client()
                if client.cluster("INFO")["cluster_state"] != "ok":
                    return False
                flags = [n["flags"] for n in client.cluster("NODES").values()]
                if sum("slave" in f for f in flags) != len(self.servers) // 2:
                    return False
                info = client.info("replication")
                if info["role"] == "slave" and info.get("master_link_status") != "up":
                    return False
            return True
        except redis.RedisError:
            return False

    def live(self) -> list[PrivateRedis]:
        """The running servers."""
        return [s for s in self.servers.values() if s.process.poll() is None]

    def primaries(self) -> list[int]:
        """Ports of the nodes serving slots now (as a live node sees it)."""
        nodes = self.live()[0].client().cluster("NODES")
        return sorted(
            int(addr.split("@")[0].rsplit(":", 1)[1])
            for addr, node in nodes.items()
            if "master" in node["flags"] and "fail" not in node["flags"] and node["slots"]
        )

    def primary_of(self, key: str) -> int:
        """The port of the primary serving `key`'s slot now."""
        slot = self.live()[0].client().cluster("KEYSLOT", key)
        for start, end, (_, port, *_), *_ in (
            self.live()[0].client().execute_command("CLUSTER", "SLOTS")
        ):
            if start <= slot <= end:
                return int(port)
        raise AssertionError(f"no node serves slot {slot}")

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crash: what it did not replicate is lost)."""
        self.servers[port].kill()

    def wait_failover(self, port: int, timeout: float = 30.0) -> None:
        """Wait until the cluster is ok again without `port` among its primaries."""

        def done() -> bool:
            try:
                client = self.live()[0].client()
                return (
                    client.cluster("INFO")["cluster_state"] == "ok" and port not in self.primaries()
                )
            except redis.RedisError:
                return False

        wait_until(done, timeout, f"a replica to take over from {port}")

    def close(self) -> None:
        """Stop every node."""
        for server in self.servers.values():
            server.close()

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
