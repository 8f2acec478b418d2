"""Operating the gateway: health, metrics, expiry, Redis outages, binding rules, disconnects."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest
from gw_helpers import REPO, GatewayProcess, batch_file, chat_line, wait_batch

from worker.redis_server import PrivateRedis

AUTH = {"Authorization": "Bearer sk-team-a"}
MESSAGES = [{"role": "user", "content": "Count to a thousand."}]


def test_health_and_prometheus_metrics(gateway, oai):
    assert httpx.get(gateway.url + "/health").json()["status"] == "ok"
    oai.models.list()
    text = httpx.get(gateway.url + "/metrics").text
    assert 'pagedq_gateway_requests_total{method="GET",route="/v1/models",status="200"}' in text
    assert "pagedq_gateway_request_duration_seconds_bucket" in text
    assert "pagedq_gateway_open_streams" in text
    assert "pagedq_gateway_batches" in text


def test_a_batch_past_its_completion_window_expires_with_batch_expired_lines(oai):
    lines = [chat_line(f"x{i}", "go", max_tokens=450, ignore_eos=True) for i in range(60)]
    uploaded = oai.files.create(file=("slow.jsonl", batch_file(lines)), purpose="batch")
    batch = oai.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="2s"
    )
    assert batch.expires_at - batch.created_at == 2
    done = wait_batch(oai, batch.id, ("expired", "completed"))
    assert done.status == "expired" and done.expired_at
    counts = done.request_counts
    assert counts.completed + counts.failed == counts.total == 60 and counts.failed > 0
    errors = [json.loads(x) for x in oai.files.content(done.error_file_id).text.splitlines()]
    assert len(errors) == counts.failed
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}


def test_an_input_file_deleted_under_its_batch_still_gives_the_output(oai):
    uploaded = oai.files.create(
        file=("in.jsonl", batch_file([chat_line("d", "hi", max_tokens=2)])), purpose="batch"
    )
    batch = oai.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert oai.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(uploaded.id)
    done = wait_batch(oai, batch.id, ("completed",))
    assert json.loads(oai.files.content(done.output_file_id).text)["custom_id"] == "d"


def test_a_non_streamed_request_whose_client_left_is_canceled(gateway, stack):
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 450, "ignore_eos": True, "n": 2}
    before = _disconnect_cancels(gateway)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=0.5)
    deadline = time.monotonic() + 20
    while _disconnect_cancels(gateway) < before + 1:
        assert time.monotonic() < deadline, "the job of the request left was not canceled"
        time.sleep(0.2)
    # Nothing of that job is left running: the worker is idle again.
    while stack.worker.status()["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _disconnect_cancels(gateway: GatewayProcess) -> float:
    metrics = httpx.get(gateway.url + "/metrics").text
    name = "pagedq_gateway_disconnect_cancels_total "
    return float(next(x for x in metrics.splitlines() if x.startswith(name)).split()[-1])


def test_redis_down_is_a_503_in_openais_shape(stack, tmp_path):
    with PrivateRedis() as server:
        gw = GatewayProcess(server.url, tmp_path, stack.keys_file)
        try:
            client = gw.openai()
            assert client.models.list().data == []
            server.kill()
            with pytest.raises(openai.InternalServerError) as err:
                client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
            assert err.value.status_code == 503
            assert err.value.body["code"] == "redis_unavailable"
            assert httpx.get(gw.url + "/health").status_code == 503
        finally:
            gw.stop()


def test_without_keys_the_gateway_refuses_to_listen_beyond_loopback():
    cmd = [sys.executable, "-m", "pagedq_cli", "serve", "--host", "0.0.0.0"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--api-key" in done.stderr and "127.0.0.1" in done.stderr
