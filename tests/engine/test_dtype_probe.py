"""dtype="auto" on the CPU follows a measurement of this host, cached per CPU and torch."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from tiny_models import make_tiny_model

from engine import LLM
from engine.config import resolve_dtype
from engine.dtype_probe import (
    PROBE_VERSION,
    DtypeProbe,
    host_key,
    probe_cache_path,
    probe_cpu_dtype,
)

CPU = torch.device("cpu")


class CountingMeasure:
    """A measurement that returns given timings and counts its calls."""

    def __init__(self, float32_s: float, bfloat16_s: float) -> None:
        self.timings, self.calls = (float32_s, bfloat16_s), 0

    def __call__(self) -> tuple[float, float]:
        self.calls += 1
        return self.timings


def write_probe(cache_dir, float32_s: float, bfloat16_s: float) -> None:
    """A cache file as a measurement on this host would leave it."""
    path = probe_cache_path(cache_dir)
    path.parent.mkdir(parents=True)
    probe = {"float32_s": float32_s, "bfloat16_s": bfloat16_s, "host": host_key()}
    path.write_text(json.dumps({**probe, "version": PROBE_VERSION}))


@pytest.mark.parametrize(
    ("float32_s", "bfloat16_s", "expected"),
    [
        (0.100, 0.040, torch.bfloat16),
        (0.100, 0.250, torch.float32),
        (0.100, 0.100, torch.float32),  # a tie keeps the exact dtype
    ],
)
def test_auto_picks_the_dtype_measured_faster(
    tmp_path, monkeypatch, float32_s, bfloat16_s, expected
):
    monkeypatch.setenv("PAGEDQ_CACHE_DIR", str(tmp_path))
    probe = probe_cpu_dtype(CountingMeasure(float32_s, bfloat16_s))
    assert (probe.float32_s, probe.bfloat16_s, probe.dtype) == (float32_s, bfloat16_s, expected)
    # resolve_dtype reads the same host's cached measurement.
    assert resolve_dtype("auto", CPU) == expected


def test_the_choice_is_logged_with_both_timings(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="engine.dtype_probe"):
        probe_cpu_dtype(CountingMeasure(0.1, 0.04), cache_dir=tmp_path)
    assert "dtype auto on this CPU: bfloat16, the faster of the faithful dtypes" in caplog.text
    assert "fp32 100.0 ms, bf16 40.0 ms" in caplog.text


def test_a_named_dtype_is_never_overridden(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDQ_CACHE_DIR", str(tmp_path))
    write_probe(tmp_path, float32_s=0.1, bfloat16_s=0.01)
    assert resolve_dtype("auto", CPU) == torch.bfloat16
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype("float16", CPU) == torch.float16
    # A named dtype measures nothing: no cache file appears where there was none.
    monkeypatch.setenv("PAGEDQ_CACHE_DIR", str(tmp_path / "empty"))
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert not (tmp_path / "empty").exists()


def test_the_cached_measurement_is_reused(tmp_path):
    measure = CountingMeasure(0.1, 0.3)
    first = probe_cpu_dtype(measure, cache_dir=tmp_path)
    second = probe_cpu_dtype(measure, cache_dir=tmp_path)
    assert measure.calls == 1
    assert first == second == DtypeProbe(0.1, 0.3, host_key())
    assert json.loads(probe_cache_path(tmp_path).read_text())["bfloat16_s"] == 0.3


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "",
        '{"float32_s": 0.1}',
        json.dumps({"float32_s": -1, "bfloat16_s": 0.1, "host": "h", "version": 1}),
        "other host",
        "other version",
    ],
)
def test_a_corrupt_or_foreign_cache_file_is_measured_again(tmp_path, content):
    path = probe_cache_path(tmp_path)
    path.parent.mkdir(parents=True)
    stale = {"float32_s": 0.5, "bfloat16_s": 0.1, "host": host_key(), "version": PROBE_VERSION}
    if content == "other host":
        content = json.dumps({**stale, "host": "another CPU"})
    elif content == "other version":
        content = json.dumps({**stale, "version": PROBE_VERSION - 1})
    path.write_text(content)
    measure = CountingMeasure(0.1, 0.3)
    assert probe_cpu_dtype(measure, cache_dir=tmp_path).dtype == torch.float32
    assert measure.calls == 1
    assert json.loads(path.read_text())["float32_s"] == 0.1  # the file is whole again


def test_the_real_measurement_times_both_dtypes(tmp_path):
    probe = probe_cpu_dtype(cache_dir=tmp_path)  # measure_projections, the default
    assert probe.host == host_key() and probe.float32_s > 0 and probe.bfloat16_s > 0
    assert probe.dtype == (torch.bfloat16 if probe.bfloat16_s < probe.float32_s else torch.float32)
    assert json.loads(probe_cache_path(tmp_path).read_text())["float32_s"] == probe.float32_s


@pytest.mark.parametrize("faster", [torch.bfloat16, torch.float32])
def test_an_auto_engine_runs_in_the_measured_dtype(tmp_path, monkeypatch, faster):
    monkeypatch.setenv("PAGEDQ_CACHE_DIR", str(tmp_path))
    write_probe(tmp_path, 0.1, 0.05 if faster == torch.bfloat16 else 0.2)
    folder = make_tiny_model(tmp_path / "llama", "llama")
    engine = LLM(str(folder), kv_cache_memory=2**22, block_size=16).llm_engine
    assert engine.dtype == faster
    assert engine.model.embed_tokens.weight.dtype == faster
