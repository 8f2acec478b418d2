"""docker-compose.yml: valid against the compose specification, runs on any Docker host.

The schema is the compose specification's own JSON schema as vendored by the
`check-jsonschema` package (check_jsonschema/builtin_schemas/vendor/compose-spec.json).
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import pytest
from redis import Redis

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ("worker", "worker-gpu")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (ROOT / "docker" / "Dockerfile").read_text()


def _flags(command: list[str]) -> dict[str, str]:
    """--name=value and --name value pairs of a command list."""
    flags, i = {}, 0
    while i < len(command):
        arg = command[i]
        if arg.startswith("--") and "=" in arg:
            name, value = arg.split("=", 1)
            flags[name] = value
        elif arg.startswith("--") and i + 1 < len(command):
            flags[arg] = command[i + 1]
            i += 1
        i += 1
    return flags


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} interpolation (the only form the file uses outside $$)."""
    return re.sub(r"(?<!\$)\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), text)


def test_the_file_is_valid_against_the_compose_specification_schema(compose):
    schema_files = pytest.importorskip("check_jsonschema").__name__
    path = resources.files(schema_files) / "builtin_schemas/vendor/compose-spec.json"
    schema = json.loads(path.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []
    # The validator does catch mistakes: a wrong type under a service fails.
    broken = json.loads(json.dumps(compose))
    broken["services"]["redis"]["ports"] = "6379:6379"
    assert list(validator.iter_errors(broken))


def test_plain_up_runs_redis_a_cpu_worker_the_dashboard_and_the_gateway(compose):
    services = compose["services"]
    default = {name for name, s in services.items() if "profiles" not in s}
    assert default == {"redis", "worker", "dashboard", "gateway"}
    assert services["worker-gpu"]["profiles"] == ["gpu"]
    assert "deploy" not in services["worker"]  # no GPU reservation: starts on a laptop
    devices = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_every_image_is_pinned(compose, dockerfile):
    images = [s["image"] for s in compose["services"].values()]
    dashboard_file = (ROOT / "docker" / "dashboard.Dockerfile").read_text()
    gateway_file = (ROOT / "docker" / "gateway.Dockerfile").read_text()
    images += re.findall(r"^FROM (\S+)", dockerfile + dashboard_file + gateway_file, flags=re.M)
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest", image
        assert re.search(r"\d+\.\d+", tag), f"{image}: pin a version, not a moving tag"


def test_redis_keeps_an_aof_is_bound_to_localhost_and_takes_a_password(compose):
    redis = compose["services"]["redis"]
    command = " ".join(redis["command"])
    assert "redis-server --appendonly yes --appendfsync everysec" in command
    # $$ reaches the container's shell as $: --requirepass only when REDIS_PASSWORD is set.
    assert '$${REDIS_PASSWORD:+--requirepass "$$REDIS_PASSWORD"}' in command
    assert redis["environment"]["REDIS_PASSWORD"] == "${REDIS_PASSWORD:-}"
    assert redis["ports"] == ["127.0.0.1:6379:6379"]
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert redis["volumes"][0].split(":")[0] in compose["volumes"]
    assert "ping" in " ".join(redis["healthcheck"]["test"])


@pytest.mark.parametrize("name, device", [("worker", "cpu"), ("worker-gpu", "cuda")])
def test_workers_run_pagedq_worker_against_the_compose_redis(compose, name, device):
    worker = compose["services"][name]
    assert worker["build"]["dockerfile"] == "docker/Dockerfile"
    command = worker["command"]
    assert command[0] == "worker"  # the image's entrypoint is `pagedq`
    flags = _flags(command)
    assert flags["--device"] == device and flags["--model"] == "smollm2"
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    for password in ("", "s3cret"):
        url = _interpolate(flags["--redis-url"], {"REDIS_PASSWORD": password})
        kwargs = Redis.from_url(url).connection_pool.connection_kwargs
        assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("redis", 6379, 0)
        assert kwargs.get("password") == (password or None)
        assert _interpolate(worker["environment"]["PAGEDQ_REDIS_URL"], {}) == _interpolate(
            flags["--redis-url"], {}
        )
    # The flags parse with the real CLI, so the compose file cannot drift from it; the GPU
    # worker's device count comes from PAGEDQ_GPUS (tensor parallel over that many).
    worker_cli = pytest.importorskip("worker.cli")
    for gpus in ({}, {"PAGEDQ_GPUS": "8"}):
        args = worker_cli.build_worker_parser().parse_args(
            [_interpolate(arg, gpus) for arg in command[1:]]
        )
        if name == "worker-gpu":
            assert args.tensor_parallel_size == int(gpus.get("PAGEDQ_GPUS", 1))
    if name == "worker-gpu":
        (gpu,) = worker["deploy"]["resources"]["reservations"]["devices"]
        assert _interpolate(str(gpu["count"]), {"PAGEDQ_GPUS": "8"}) == "8"


@pytest.mark.parametrize("name", WORKERS)
def test_workers_scale_without_host_ports_and_report_health(compose, name):
    worker = compose["services"][name]
    assert "ports" not in worker  # --scale worker=4 cannot clash on a host port
    port = _flags(worker["command"])["--metrics-port"]
    assert worker["expose"] == [port]
    probe = " ".join(worker["healthcheck"]["test"])
    assert f"http://127.0.0.1:{port}/healthz" in probe
    assert worker["healthcheck"]["start_period"]


def test_the_model_cache_volume_is_writable_by_the_non_root_user(compose, dockerfile):
    for name in WORKERS:
        assert "model-cache:/home/pagedq/.cache" in compose["services"][name]["volumes"]
    assert "model-cache" in compose["volumes"]
    # A new named volume copies the image folder's owner: the folder must exist, owned by the
    # user, before USER; the caches the worker writes must live inside it.
    user_at = dockerfile.index("USER pagedq")
    mkdir = dockerfile.index("mkdir -p /home/pagedq/.cache/pagedq/models")
    chown = dockerfile.index("chown -R pagedq:pagedq /home/pagedq/.cache")
    assert mkdir < chown < user_at
    assert "PAGEDQ_CACHE_DIR=/home/pagedq/.cache/pagedq/models" in dockerfile
    assert "HF_HOME=/home/pagedq/.cache/huggingface" in dockerfile


def test_dashboard_reads_jobs_as_json_with_the_rq_the_workers_use(compose):
    dashboard = compose["services"]["dashboard"]
    assert dashboard["environment"]["RQ_DASHBOARD_JSON"] == "true"
    url = _interpolate(dashboard["environment"]["RQ_DASHBOARD_REDIS_URL"], {})
    assert url == _interpolate(_flags(compose["services"]["worker"]["command"])["--redis-url"], {})
    assert dashboard["ports"] == ["127.0.0.1:9181:9181"]  # no auth: this host only
    build = dashboard["build"]
    dockerfile = (ROOT / build["context"] / build["dockerfile"]).read_text()
    assert '"rq==3.0.0"' in dockerfile and '"rq-dashboard==0.9.0"' in dockerfile
    assert 'ENTRYPOINT ["python", "/app/dashboard.py"]' in dockerfile
    assert (ROOT / build["context"] / "dashboard.py").is_file()


def test_dockerfile_installs_the_worker_extra_and_runs_pagedq(dockerfile):
    assert '".[worker]"' in dockerfile
    assert "pagedq_cli.py" in dockerfile  # the console script's module
    assert 'ENTRYPOINT ["pagedq"]' in dockerfile


def test_the_gateway_serves_the_compose_queue_on_this_host_only_with_a_healthcheck(compose):
    gateway = compose["services"]["gateway"]
    assert gateway["command"][0] == "serve"
    assert gateway["ports"] == ["127.0.0.1:8000:8000"]
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    flags = _flags(gateway["command"])
    assert _interpolate(flags["--redis-url"], {}) == _interpolate(
        _flags(compose["services"]["worker"]["command"])["--redis-url"], {}
    )
    assert flags["--queue"] == _flags(compose["services"]["worker"]["command"])["--queue"]
    assert f"http://127.0.0.1:{flags['--port']}/health" in " ".join(gateway["healthcheck"]["test"])
    assert gateway["environment"]["PAGEDQ_API_KEY"] == "${PAGEDQ_API_KEY:-}"
    # The flags parse with the real CLI; the image installs the gateway extra, never torch.
    gateway_cli = pytest.importorskip("gateway.cli")
    gateway_cli.build_parser().parse_args(gateway["command"][1:])
    dockerfile = (ROOT / gateway["build"]["dockerfile"]).read_text()
    assert '".[gateway]"' in dockerfile and "torch" not in dockerfile
    assert "COPY worker" not in dockerfile and 'ENTRYPOINT ["pagedq"]' in dockerfile
