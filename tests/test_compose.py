"""docker-compose.yml: the services, their commands, Redis persistence and the GPU reservation."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


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


def test_services_are_redis_gpu_worker_dashboard_and_a_cpu_profile(compose):
    services = compose["services"]
    assert {"redis", "worker", "dashboard", "worker-cpu"} <= set(services)
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    assert "profiles" not in services["worker"]


def test_redis_persists_with_aof_on_a_volume(compose):
    redis = compose["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    flags = _flags(redis["command"])
    assert redis["command"][0] == "redis-server"
    assert flags["--appendonly"] == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert redis["volumes"][0].split(":")[0] in compose["volumes"]


@pytest.mark.parametrize("name, device", [("worker", "cuda"), ("worker-cpu", "cpu")])
def test_workers_run_pagedq_worker_against_the_compose_redis(compose, name, device):
    worker = compose["services"][name]
    assert worker["build"]["dockerfile"] == "docker/Dockerfile"
    assert (ROOT / worker["build"]["dockerfile"]).is_file()
    command = worker["command"]
    assert command[0] == "worker"  # the image's entrypoint is `pagedq`
    flags = _flags(command)
    assert flags["--redis-url"] == "redis://redis:6379/0"
    assert flags["--device"] == device
    assert flags["--model"] == "smollm2"
    assert int(flags["--metrics-port"]) > 0
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    # The flags parse with the real CLI, so the compose file cannot drift from it.
    worker_cli = pytest.importorskip("worker.cli")
    args = worker_cli.build_worker_parser().parse_args(command[1:])
    assert args.redis_url == "redis://redis:6379/0"


def test_gpu_worker_reserves_an_nvidia_gpu(compose):
    devices = compose["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia"
    assert "gpu" in devices[0]["capabilities"]
    assert "deploy" not in compose["services"]["worker-cpu"]


def test_dashboard_points_at_the_compose_redis(compose):
    dashboard = compose["services"]["dashboard"]
    assert "rq-dashboard" in dashboard["image"]
    assert dashboard["environment"]["RQ_DASHBOARD_REDIS_URL"] == "redis://redis:6379/0"


def test_dockerfile_installs_the_worker_extra_and_runs_pagedq():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert '".[worker]"' in dockerfile
    assert 'ENTRYPOINT ["pagedq"]' in dockerfile
