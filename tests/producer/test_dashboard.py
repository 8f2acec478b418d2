"""The composed rq-dashboard (docker/dashboard.py) shows pagedq's JSON jobs and busy workers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("rq_dashboard")

DASHBOARD = Path(__file__).resolve().parents[2] / "docker" / "dashboard.py"

# Runs in its own process: docker/dashboard.py replaces RQ's default serializer process-wide.
PROBE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("pagedq_dashboard", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
from rq.serializers import JSONSerializer
from rq_dashboard.cli import make_flask_app
from rq_dashboard.web import config, setup_rq_connection
config.serializer = JSONSerializer  # what RQ_DASHBOARD_JSON=true sets
app = make_flask_app(None, None, None, "")
app.config["RQ_DASHBOARD_REDIS_URL"] = sys.argv[2]
setup_rq_connection(app)
client = app.test_client()
pages = {path: client.get(path) for path in sys.argv[3:]}
print(json.dumps({p: [r.status_code, r.get_data(as_text=True)] for p, r in pages.items()}))
"""


def test_job_and_worker_pages_work_while_a_job_runs(served):
    with served.client() as client:
        job_id = client.submit(prompt="dashboard", max_tokens=2000, ignore_eos=True)
        deadline = time.monotonic() + 60
        while client.status(job_id) != "started":
            assert time.monotonic() < deadline, served.worker.log_tail()
            time.sleep(0.05)
        pages = ["/0/data/workers.json", f"/0/data/job/{job_id}.json", f"/0/view/job/{job_id}"]
        pages += ["/0/data/queues.json", "/0/view/workers"]
        try:
            done = subprocess.run(
                [sys.executable, "-c", PROBE, str(DASHBOARD), served.url, *pages],
                capture_output=True,
                text=True,
                timeout=120,
            )
            status = client.status(job_id)
        finally:
            client.cancel(job_id)
    assert done.returncode == 0, done.stderr
    assert status == "started"  # the pages were read while the job ran
    replies = json.loads(done.stdout)
    assert {path: code for path, (code, _) in replies.items()} == {path: 200 for path in pages}
    workers = json.loads(replies["/0/data/workers.json"][1])["workers"]
    assert served.worker.name in [w["name"] for w in workers]
    job = json.loads(replies[f"/0/data/job/{job_id}.json"][1])
    assert job["id"] == job_id and "pagedq.generate" in job["description"]
