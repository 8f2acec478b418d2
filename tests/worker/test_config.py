"""One configuration: `pagedq worker`'s flags are generated from EngineConfig, JobLimits and
WorkerConfig, with the same defaults, and the README lists every one of them."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field

import pytest
from worker_helpers import REPO

from engine.config import EngineConfig
from worker.cli import ENGINE_FLAG_SPECS, config_from_args, flags_markdown, worker_flags
from worker.config import REDIS_URL_ENV, WorkerConfig
from worker.flags import FlagSpec, add_dataclass_flags, dataclass_from_args
from worker.limits import JobLimits


def parse(*argv: str) -> WorkerConfig:
    return config_from_args(worker_flags().parser.parse_args(list(argv)))


def test_every_field_of_every_section_has_a_flag():
    flags = worker_flags()
    assert [f.field for f in flags.engine] == [f.name for f in dataclasses.fields(EngineConfig)]
    assert [f.field for f in flags.limits] == [f.name for f in dataclasses.fields(JobLimits)]
    own = [f.name for f in dataclasses.fields(WorkerConfig) if f.name not in ("engine", "limits")]
    assert [f.field for f in flags.worker] == own
    assert all(f.help and "EngineConfig." not in f.help for f in flags.all)
    names = {f.flag for f in flags.all}
    assert {"--gpu-memory-utilization", "--max-payload-bytes", "--metrics-port"} <= names


def test_no_flags_give_the_declared_defaults(monkeypatch):
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    config = parse()
    assert config == WorkerConfig()
    assert config.engine == EngineConfig() and config.limits == JobLimits()
    assert EngineConfig().scheduling_policy == config.engine.scheduling_policy == "fair"


def test_flags_set_nested_fields_and_bad_values_are_usage_errors():
    config = parse(
        "--max-num-seqs", "8", "--no-enable-prefix-caching", "--max-n", "4",
        "--max-tokens", "100", "--priority-aging-seconds", "none", "--lease-ttl", "9",
        "--kv-cache-memory", "64MiB", "--gpu-memory-utilization", "0.5",
    )  # fmt: skip
    assert (config.engine.max_num_seqs, config.engine.enable_prefix_caching) == (8, False)
    assert config.engine.priority_aging_seconds is None
    assert (config.engine.kv_cache_memory, config.engine.gpu_memory_utilization) == ("64MiB", 0.5)
    assert (config.limits.max_n, config.limits.max_tokens, config.lease_ttl) == (4, 100, 9)
    assert parse("--no-prefix-caching").engine.enable_prefix_caching is False
    with pytest.raises(ValueError, match="block_size=7 is invalid"):
        parse("--block-size", "7")
    with pytest.raises(ValueError, match="max_n=0 is invalid"):
        parse("--max-n", "0")
    with pytest.raises(SystemExit):
        parse("--scheduling-policy", "random")


@dataclass(slots=True)
class FutureEngineConfig:
    """Fields of the kinds engine-sched adds: a dict, a list, a new simple field."""

    tenant_weights: dict[str, float] = field(default_factory=dict)
    swap_space: float = 4.0
    stop_words: list[str] = field(default_factory=list)


def test_dict_list_and_new_simple_fields_get_flags():
    parser = argparse.ArgumentParser()
    flags = add_dataclass_flags(parser, FutureEngineConfig, specs=ENGINE_FLAG_SPECS)
    assert [f.flag for f in flags] == ["--tenant-weight", "--swap-space", "--stop-words"]
    args = parser.parse_args(
        ["--tenant-weight", "a=2", "--tenant-weight", "b=0.5", "--swap-space", "0",
         "--stop-words", "x", "--stop-words", "y"]
    )  # fmt: skip
    config = dataclass_from_args(FutureEngineConfig, args)
    assert config == FutureEngineConfig({"a": 2.0, "b": 0.5}, 0.0, ["x", "y"])
    assert dataclass_from_args(FutureEngineConfig, parser.parse_args([])) == FutureEngineConfig()
    with pytest.raises(SystemExit):
        parser.parse_args(["--tenant-weight", "a"])


def test_a_field_of_unknown_type_needs_a_spec():
    @dataclass
    class Odd:
        pair: complex = 0j

    with pytest.raises(TypeError, match="FlagSpec"):
        add_dataclass_flags(argparse.ArgumentParser(), Odd, specs={"x": FlagSpec()})


def test_the_readme_configuration_table_is_the_generated_one():
    readme = (REPO / "README.md").read_text()
    pattern = r"<!-- worker-flags:start -->\n(.*?)\n<!-- worker-flags:end -->"
    match = re.search(pattern, readme, re.S)
    assert match, "README.md has no worker-flags table"
    assert match.group(1) == flags_markdown(), (
        "README's flag table is stale: paste the output of "
        '`python -c "from worker.cli import flags_markdown; print(flags_markdown())"`'
    )
