"""TLS to Redis for real: a redis-server that speaks only TLS, certificates made at test time,
the producer, a worker process and the gateway on rediss:// URLs; a wrong CA is one clear line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI
from tls_redis import TlsRedis
from worker_process import REPO, WorkerProcess

from producer.client import Client
from producer.refusal import RedisRefusedError
from worker.redis_server import free_port

QUEUE = "q-tls"


pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl CLI")


@pytest.fixture(scope="module")
def server() -> Iterator[TlsRedis]:
    with TlsRedis() as s:
        yield s


def wrong_ca_url(server: TlsRedis) -> str:
    """A URL with a password, trusting a CA that did not sign the server's certificate."""
    return server.url(server.certs.other_ca).replace("rediss://", "rediss://:secret@")


def start_gateway(url: str, log_path) -> tuple[subprocess.Popen, str]:
    """`pagedq serve` on a free port (no API keys: 127.0.0.1 only), once /health says ok."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedq_cli", "serve", "--redis-url", url, "--queue", QUEUE,
           "--port", str(port), "--log-level", "warning"]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, log_path.read_text()
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)


def test_producer_worker_and_gateway_run_jobs_over_tls(server, tiny_llama_dir, tmp_path):
    url = server.url()
    worker = WorkerProcess(url, QUEUE, "w-tls", tmp_path, model=tiny_llama_dir,
                           kv_cache_memory="16MiB", env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    gateway = None
    try:
        worker.wait_ready(timeout=120)
        with Client(url, queue=QUEUE, check_interval=0.2) as client:
            job_ids = client.submit_many(
                {"prompt": f"TLS {i}", "max_tokens": 3, "ignore_eos": True} for i in range(4)
            )
            for job_id in job_ids:
                result = client.result(job_id, timeout=60)
                assert result.status == "finished" and result.worker == "w-tls"
                assert result.usage.completion_tokens == 3
        gateway, base = start_gateway(url, tmp_path / "gateway.log")
        oai = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        chat = oai.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert chat.usage.completion_tokens >= 1 and chat.choices[0].finish_reason
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(15)
        assert worker.stop() == 0, worker.log_tail()


def test_client_certificates_are_presented_from_url_parameters():
    with TlsRedis(auth_clients="yes") as mtls:
        url = mtls.url(**mtls.client_cert_params())
        with Client(url, queue=QUEUE) as client:
            job_id = client.submit(prompt="mutual TLS", max_tokens=2)
            assert client.status(job_id) == "queued"


def test_a_producer_with_a_wrong_ca_fails_at_once_instead_of_waiting_out_an_outage(server):
    start = time.monotonic()
    with Client(wrong_ca_url(server), queue=QUEUE) as client:
        with pytest.raises(RedisRefusedError, match="certificate verify failed"):
            client.submit(prompt="never queued", max_tokens=2)
    assert time.monotonic() - start < 5


def test_the_producer_cli_with_a_wrong_ca_says_so_in_one_line(server):
    env = {**os.environ, "PAGEDQ_REDIS_URL": wrong_ca_url(server)}
    done = subprocess.run([sys.executable, "-m", "pagedq_cli", "status"], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=60)  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"pagedq: TLS to Redis at rediss://:***@127.0.0.1:{server.port}/0")
    assert "failed: certificate verify failed" in lines[0] and "ssl_ca_certs" in lines[0]
    assert "secret" not in done.stderr


def test_a_worker_with_a_wrong_ca_exits_1_with_one_line(server, tmp_path):
    worker = WorkerProcess(wrong_ca_url(server), QUEUE, "w-wrong-ca", tmp_path, "--log-format",
                           "json", env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert worker.process.wait(120) == 1
    text = worker.log_path.read_text()
    assert "Traceback" not in text and "secret" not in text
    errors = [e for e in map(json.loads, text.splitlines()) if e["level"] == "error"]
    assert len(errors) == 1, text
    assert errors[0]["event"].startswith(
        f"TLS to Redis at rediss://:***@127.0.0.1:{server.port}/0?ssl_ca_certs="
    )
    assert "failed: certificate verify failed" in errors[0]["event"], text
