"""A refusal is not an outage: a wrong password, no password, or an ACL user missing what pagedq
needs makes the Client raise at once, and `pagedq submit`, the worker and the gateway say so in
one line and stop (a real redis-server started with --requirepass, and a real ACL user).

Refused certificates are tests/worker/test_tls.py's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from redis import Redis
from worker_process import REPO, WorkerProcess

from producer.client import Client
from producer.refusal import RedisRefusedError
from worker.redis_server import PrivateRedis, free_port

QUEUE = "q-refusals"
PASSWORD = "s3cret-pw"
# An ACL user that may connect and read, but neither write nor run scripts.
READER = ("reader", "reader-pw")
# Well under the 10 minutes an outage is waited out.
AT_ONCE_S = 10.0


@pytest.fixture(scope="module")
def server() -> Iterator[PrivateRedis]:
    with PrivateRedis(args=["--requirepass", PASSWORD]) as s:
        admin = Redis(port=s.port, password=PASSWORD)
        user, pw = READER
        admin.execute_command("ACL", "SETUSER", user, "on", f">{pw}", "~*", "+@read", "+ping")
        admin.close()
        yield s


def url(server: PrivateRedis, user: str = "", password: str | None = None) -> str:
    auth = f"{user}:{password}@" if password is not None else ""
    return f"redis://{auth}127.0.0.1:{server.port}/0"


# Redis's reply, as redis-py words it (it drops the WRONGPASS / NOAUTH / NOPERM codes).
CASES = {
    "wrong password": (("", "not-the-password"), "refused the credentials.*: invalid username"),
    "no password": (("", None), "refused the credentials"),
    "ACL refusal": (READER, "refused pagedq by its ACL.*no permissions to run"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_client_raises_at_once(server, case):
    (user, password), expected = CASES[case]
    start = time.monotonic()
    with Client(url(server, user, password), queue=QUEUE) as client:
        with pytest.raises(RedisRefusedError, match=expected) as err:
            client.submit(prompt="never queued", max_tokens=2)
    assert time.monotonic() - start < AT_ONCE_S
    assert "not-the-password" not in str(err.value) and "reader-pw" not in str(err.value)


def test_pagedq_submit_says_so_in_one_line(server, tmp_path):
    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"prompt": "hi", "max_tokens": 2}) + "\n")
    bad = url(server, "", "not-the-password")
    cmd = [sys.executable, "-m", "pagedq_cli", "submit", str(lines), "-o", str(tmp_path / "o"),
           "--redis-url", bad, "--queue", QUEUE]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert time.monotonic() - start < 60  # the interpreter's start on a loaded machine
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"pagedq: Redis at redis://:***@127.0.0.1:{server.port}/0 refused ")
    assert "invalid username-password pair" in line and "not-the-password" not in done.stderr


# A wrong password stops it at its first PING, as a refused certificate does (test_tls.py);
# an ACL user may PING and still lack what the worker needs.
@pytest.mark.parametrize("case", ["ACL refusal"])
def test_the_worker_exits_1_with_one_line_before_loading_its_model(server, case, tmp_path):
    (user, password), expected = CASES[case]
    worker = WorkerProcess(url(server, user, password), QUEUE, "w-refused", tmp_path,
                           "--log-format", "json", env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert worker.process.wait(120) == 1
    text = worker.log_path.read_text()
    assert "Traceback" not in text and password not in text
    events = [json.loads(line) for line in text.splitlines()]
    errors = [e for e in events if e["level"] == "error"]
    assert len(errors) == 1, text
    assert re.search(expected, errors[0]["event"]), text
    assert not any(e["event"] == "loading model" for e in events), text


def test_the_gateway_exits_1_with_one_line(server, tmp_path):
    cmd = [sys.executable, "-m", "pagedq_cli", "serve", "--redis-url",
           url(server, "", "not-the-password"), "--queue", QUEUE, "--port", str(free_port()),
           "--allow-unauthenticated"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.strip().splitlines() if "refused" in line]
    assert len(errors) == 1 and "invalid username-password" in errors[0], done.stderr
    assert errors[0].startswith("pagedq serve: Redis at redis://:***@127.0.0.1:")
    assert "not-the-password" not in done.stderr
