"""The metrics collector over a real engine (tiny random Llama); /metrics and /healthz over HTTP."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams
from engine.llm_engine import EngineStats, LLMEngine
from worker.endpoints import MetricsPortInUse, WorkerHealth
from worker.metrics import WorkerMetrics

MODEL_NAME = "tiny-llama"
PROMPT_A = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 can be cached
PROMPT_B = list(range(300, 320))  # 20 tokens, shares nothing with A


def scrape(metrics: WorkerMetrics) -> dict[tuple[str, frozenset], float]:
    """Every sample of one scrape, keyed by (name, labels without model_name)."""
    text = generate_latest(metrics.registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL_NAME, s
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            samples[(s.name, labels)] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def make_engine(model_dir: str, kv_cache_memory: str) -> LLMEngine:
    return LLMEngine(
        model=model_dir, dtype="float32", device="cpu", kv_cache_memory=kv_cache_memory, seed=0
    )


class Driver:
    """Runs requests through an engine and reports them to WorkerMetrics as the worker would."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.metrics = WorkerMetrics(MODEL_NAME, engine.get_stats, lambda: len(self.pending))
        self.pending: dict[str, float] = {}  # request id -> enqueue time
        self.last_token_at: dict[str, float] = {}
        self.num_seen: dict[str, int] = {}

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.pending[request_id] = time.time()
        self.engine.add_request(request_id, prompt, params)

    def step(self) -> None:
        outputs = self.engine.step()
        self.metrics.observe_step(self.engine.scheduler.last_output.total_num_scheduled_tokens)
        now = time.time()
        for out in outputs:
            rid, tokens = out.request_id, out.outputs[0].token_ids
            num_new = len(tokens) - self.num_seen.get(rid, 0)
            self.num_seen[rid] = len(tokens)
            if rid not in self.last_token_at:
                self.metrics.observe_first_token(now - self.pending[rid])
                self.metrics.observe_new_tokens(num_new, None)
            else:
                self.metrics.observe_new_tokens(num_new, now - self.last_token_at[rid])
            self.last_token_at[rid] = now
            if out.finished:
                enqueued = self.pending.pop(rid)
                self.metrics.observe_job_end(
                    "finished",
                    out.outputs[0].finish_reason,
                    prompt_tokens=len(out.prompt_token_ids),
                    generation_tokens=len(tokens),
                    queued_s=out.metrics.first_scheduled_time - enqueued,
                    e2e_s=now - enqueued,
                )

    def run(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    return make_engine(tiny_llama_dir, "16MiB")


def test_gauges_are_read_at_scrape_time_and_fall_to_zero_at_the_last_step(engine):
    driver = Driver(engine)
    driver.add("a", PROMPT_A, max_tokens=5)
    driver.add("b", PROMPT_B, max_tokens=3)
    driver.step()

    during = scrape(driver.metrics)
    assert value(during, "pagedq:num_requests_running") == 2
    assert value(during, "pagedq:num_requests_waiting") == 0
    assert value(during, "pagedq:jobs_in_flight") == 2
    assert value(during, "pagedq:kv_cache_usage_perc") > 0

    driver.run()
    after = scrape(driver.metrics)
    assert value(after, "pagedq:num_requests_running") == 0
    assert value(after, "pagedq:num_requests_waiting") == 0
    assert value(after, "pagedq:jobs_in_flight") == 0
    assert value(after, "pagedq:kv_cache_usage_perc") == 0


def test_counters_and_histograms_count_exactly(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, "16MiB")
    driver = Driver(engine)
    driver.add("a", PROMPT_A, max_tokens=5)
    driver.add("b", PROMPT_B, max_tokens=3)
    driver.run()
    driver.add("c", PROMPT_A, max_tokens=5)  # the same prompt again: 2 blocks from the cache
    driver.run()
    m = scrape(driver.metrics)

    assert value(m, "pagedq:request_success_total", finished_reason="length") == 3
    assert value(m, "pagedq:request_success_total", finished_reason="stop") == 0
    assert value(m, "pagedq:jobs_ended_total", status="finished") == 3
    assert value(m, "pagedq:generation_tokens_total") == 5 + 3 + 5
    assert value(m, "pagedq:request_generation_tokens_sum") == 13
    assert value(m, "pagedq:request_generation_tokens_count") == 3
    assert value(m, "pagedq:request_prompt_tokens_sum") == 40 + 20 + 40
    # Lookups: every prompt token of a, b and c; hits: c's first 2 blocks (the last token of a
    # prompt is always recomputed, so 39 tokens can hit at most 2 full blocks of 16).
    assert value(m, "pagedq:prefix_cache_queries_total") == 100
    assert value(m, "pagedq:prefix_cache_hits_total") == 32
    # Computed prompt tokens exclude the hits; every step computes prompts plus one token per
    # decode (each sample's first token comes from its prefill step).
    assert value(m, "pagedq:prompt_tokens_total") == 100 - 32
    assert value(m, "pagedq:iteration_tokens_total_sum") == 68 + (4 + 2 + 4)
    steps = value(m, "pagedq:engine_steps_total")
    assert value(m, "pagedq:iteration_tokens_total_count") == steps == engine.num_steps
    assert value(m, "pagedq:time_to_first_token_seconds_count") == 3
    assert value(m, "pagedq:inter_token_latency_seconds_count") == 4 + 2 + 4
    assert value(m, "pagedq:e2e_request_latency_seconds_count") == 3
    assert value(m, "pagedq:request_queue_time_seconds_count") == 3
    assert value(m, "pagedq:num_preemptions_total", kind="recompute") == 0
    assert value(m, "pagedq:num_preemptions_total", kind="swap") == 0


def test_grammar_compiles_and_constrained_tokens_are_counted(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, "16MiB")
    driver = Driver(engine)
    schema = {"type": "object", "properties": {"ok": {"enum": ["yes", "no"]}}, "required": ["ok"]}
    for request_id in ("j1", "j2"):  # the same schema twice: one compile, one cache hit
        params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs={"json": schema})
        driver.pending[request_id] = time.time()
        engine.add_request(request_id, PROMPT_B, params)
    driver.run()
    m = scrape(driver.metrics)
    stats = engine.get_stats()
    assert value(m, "pagedq:grammar_compiles_total") == stats.num_grammar_compiles == 1
    assert value(m, "pagedq:grammar_cache_hits_total") == stats.grammar_cache_hits == 1
    assert value(m, "pagedq:grammar_failures_total") == 0
    assert value(m, "pagedq:constrained_tokens_total") == stats.num_constrained_tokens > 0
    assert value(m, "pagedq:forced_tokens_total") == stats.num_forced_tokens > 0
    assert value(m, "pagedq:grammar_compile_seconds_total") > 0


def test_preemptions_are_counted_by_kind(tiny_llama_dir):
    # 8 KV blocks of 16 tokens; 4 requests that each grow to 4 blocks cannot all stay resident.
    engine = make_engine(tiny_llama_dir, "64KiB")
    assert engine.kv_cache_manager.block_pool.num_blocks == 8
    driver = Driver(engine)
    for i in range(4):
        driver.add(f"r{i}", list(range(10 + 20 * i, 30 + 20 * i)), max_tokens=30)
    driver.run()
    m = scrape(driver.metrics)

    # The swap pool is on by default: each preemption is counted under the kind it took.
    by_kind = engine.scheduler.num_preemptions_by_kind
    assert engine.scheduler.num_preemptions == by_kind["recompute"] + by_kind["swap"] > 0
    for kind in ("recompute", "swap"):
        assert value(m, "pagedq:num_preemptions_total", kind=kind) == by_kind[kind]
    assert value(m, "pagedq:request_success_total", finished_reason="length") == 4
    assert value(m, "pagedq:kv_cache_usage_perc") == 0


def test_canceled_and_failed_jobs_are_counted_by_status():
    stats = EngineStats(0, 0, 0.0, 8, 8, 0, 0, 0.0, 0, 0, 0)
    metrics = WorkerMetrics(MODEL_NAME, lambda: stats)
    metrics.observe_job_end("canceled", None, prompt_tokens=7, generation_tokens=2)
    metrics.observe_job_end("failed")
    m = scrape(metrics)
    assert value(m, "pagedq:request_success_total", finished_reason="abort") == 1
    assert value(m, "pagedq:jobs_ended_total", status="canceled") == 1
    assert value(m, "pagedq:jobs_ended_total", status="failed") == 1
    assert value(m, "pagedq:request_prompt_tokens_count") == 1


def test_engine_sched_fields_are_read_when_present():
    stats = EngineStats(0, 0, 0.0, 8, 8, 5, 0, 0.0, 0, 0, 0)
    # The fields engine-sched adds; the collector reads them by name when they exist.
    extra = {
        "num_preemptions_recompute": 3,
        "num_preemptions_swap": 2,
        "num_swapped": 1,
        "swapped_out_bytes": 4096,
        "tenant_generated_tokens": {"team-a": 120, "team-b": 30},
    }

    class Stats:
        def __getattr__(self, name):
            return extra[name] if name in extra else getattr(stats, name)

    m = scrape(WorkerMetrics(MODEL_NAME, Stats))
    assert value(m, "pagedq:num_preemptions_total", kind="recompute") == 3
    assert value(m, "pagedq:num_preemptions_total", kind="swap") == 2
    assert value(m, "pagedq:num_requests_swapped") == 1
    assert value(m, "pagedq:swapped_out_bytes_total") == 4096
    assert value(m, "pagedq:tenant_generation_tokens_total", tenant="team-a") == 120
    assert value(m, "pagedq:tenant_generation_tokens_total", tenant="team-b") == 30


# --- HTTP: /metrics and /healthz ----------------------------------------------------------------


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def served():
    stats = EngineStats(2, 1, 0.25, 6, 8, 0, 0, 0.0, 3, 10, 4)
    state = {"alive": True, "now": 1000.0}
    health = WorkerHealth(
        MODEL_NAME,
        engine_alive=lambda: state["alive"],
        last_step_at=lambda: state["now"] - 0.5,
        redis_grace_s=30,
        clock=lambda: state["now"],
    )
    metrics = WorkerMetrics(MODEL_NAME, lambda: stats, lambda: 3, health.report)
    server = metrics.serve(0)  # a free port on 127.0.0.1
    yield f"http://127.0.0.1:{server.port}", state, health, server
    server.stop()


def test_metrics_and_healthz_share_one_port(served):
    url, *_ = served
    code, text = get(url + "/metrics")
    assert code == 200
    assert 'pagedq:num_requests_running{model_name="tiny-llama"} 2.0' in text
    code, body = get(url + "/healthz")
    assert code == 200
    assert json.loads(body) == {
        "status": "ok",
        "model": MODEL_NAME,
        "engine_alive": True,
        "last_step_age_s": 0.5,
        "redis_connected": True,
        "redis_last_ok_age_s": 0.0,
    }
    assert get(url + "/nope")[0] == 404


def test_healthz_is_503_when_the_engine_thread_is_dead(served):
    url, state, _, _ = served
    state["alive"] = False
    code, body = get(url + "/healthz")
    assert code == 503
    report = json.loads(body)
    assert report["status"] == "unhealthy" and report["engine_alive"] is False
    assert report["reasons"] == ["engine thread is dead"]


def test_healthz_is_503_only_after_redis_is_unreachable_past_the_grace(served):
    url, state, health, _ = served
    health.redis_error("ConnectionError: refused")
    state["now"] += 10
    code, body = get(url + "/healthz")
    assert code == 200
    assert json.loads(body)["redis_connected"] is False
    state["now"] += 25  # 35 s without a successful round trip
    code, body = get(url + "/healthz")
    assert code == 503
    assert json.loads(body)["redis_error"] == "ConnectionError: refused"
    health.redis_ok()
    assert get(url + "/healthz")[0] == 200


def test_a_busy_port_raises_one_clear_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        metrics = WorkerMetrics(MODEL_NAME, lambda: None)
        with pytest.raises(MetricsPortInUse) as busy:
            metrics.serve(port)
    message = str(busy.value)
    assert f"metrics port {port} on 127.0.0.1 is already in use" in message
    assert "\n" not in message


def test_before_the_engine_is_attached_the_port_answers_starting():
    health = WorkerHealth(MODEL_NAME)
    metrics = WorkerMetrics(MODEL_NAME, health_fn=health.report)
    server = metrics.serve(0)
    url = f"http://127.0.0.1:{server.port}"
    try:
        code, body = get(url + "/healthz")
        assert code == 503
        assert json.loads(body)["status"] == "starting"
        code, text = get(url + "/metrics")
        assert code == 200 and "pagedq:jobs_in_flight" in text
        assert "pagedq:num_requests_running" not in text

        stats = EngineStats(0, 0, 0.0, 8, 8, 0, 0, 0.0, 0, 0, 0)
        metrics.attach(lambda: stats, lambda: 0)
        health.attach(engine_alive=lambda: True, last_step_at=lambda: None)
        assert get(url + "/healthz")[0] == 200
        assert (
            'pagedq:num_requests_running{model_name="tiny-llama"} 0.0' in get(url + "/metrics")[1]
        )
    finally:
        server.stop()
