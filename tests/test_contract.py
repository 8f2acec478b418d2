"""The wire contract has one home: a key, a TTL default, a model alias or a sampling field
declared a second time anywhere else fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from producer.contract import keys
from producer.contract.lua import TABLES, LuaScript
from producer.contract.schema import SAMPLING_FIELDS, GenerationRequest

ROOT = Path(__file__).resolve().parents[1]
CONTRACT_KEYS = ROOT / "producer" / "contract" / "keys.py"
# A quoted key prefix ("rq:job:", f"pagedq:result:{id}") or one of the whole-key literals.
KEY_LITERAL = re.compile(r"""['"](?:pagedq|rq):(?:[A-Za-z_-]+:|(?:queues|workers|cancel)['"])""")
CODE_DIRS = ("producer", "worker", "engine", "kernels", "gateway", "bench", "docker")


def _code_files() -> list[Path]:
    files = [ROOT / "pagedq_cli.py"]
    for folder in CODE_DIRS:
        files += sorted((ROOT / folder).rglob("*.py"))
    return [f for f in files if f != CONTRACT_KEYS]


def test_no_key_literal_outside_the_contract():
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _code_files()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if KEY_LITERAL.search(line)
    ]
    assert found == [], "key names belong in producer/contract/keys.py:\n" + "\n".join(found)


def test_the_key_pattern_catches_the_spellings_it_is_meant_for():
    for text in ('"rq:job:"', "f'pagedq:result:{job_id}'", '"rq:queues"', "'pagedq:cancel'"):
        assert KEY_LITERAL.search(text), text
    for text in ('"pagedq:num_requests_running"', '"pagedq.generate"', "'rq info'"):
        assert not KEY_LITERAL.search(text), text


def test_scripts_take_every_key_prefix_from_the_contract():
    from producer.enqueue import ENQUEUE_IF_ABSENT
    from worker.rq_scripts import SCRIPTS

    for script in (*SCRIPTS, ENQUEUE_IF_ABSENT):
        assert "pagedq:" not in script.written and "rq:" not in script.written, script.name
    assert TABLES["K"] is keys.PAGEDQ and TABLES["F"] is keys.JOB_FIELDS
    assert {**TABLES["RQ"]} == {**keys.RQ, "queues": keys.RQ_QUEUES, "workers": keys.RQ_WORKERS}


def test_a_scripts_prefixes_are_literals_of_its_source_and_an_unknown_one_is_refused():
    script = LuaScript("t", body="return {K.result .. a_id, F.base, RQ[a_status], fair.F[x]}")
    source = script.source
    assert f"'{keys.PAGEDQ['result']}' .. a_id" in source
    assert f"'{keys.JOB_FIELDS['base']}'" in source and "fair.F[x]" in source
    # Indexed by a variable, RQ stays a table; K and F are not built at all.
    assert source.startswith("local RQ = {") and "local K =" not in source
    assert "local F =" not in source
    with pytest.raises(ValueError, match=r"K.results"):
        _ = LuaScript("t", body="return K.results").source


def test_scripts_are_called_by_argument_names():
    script = LuaScript("t", body="return a_b", keys=("k",), args=("a", "b"))
    assert script.keys_and_args({"k": "K"}, {"b": 2, "a": 1}, rest=[3]) == (["K"], [1, 2, 3])
    assert (
        "local a_b = ARGV[2]" in script.source and "local KEYS_REST, REST = 2, 3" in script.source
    )
    with pytest.raises(ValueError, match=r"missing \['b'\], unknown \['c'\]"):
        script.keys_and_args({"k": "K"}, {"a": 1, "c": 3})


def test_wire_schema_and_engine_sampling_params_name_the_same_fields():
    from engine import SamplingParams

    engine_fields = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    assert set(SAMPLING_FIELDS) == engine_fields - {"skip_special_tokens"}
    defaults = SamplingParams()
    for name in SAMPLING_FIELDS:
        wire_default = GenerationRequest.model_fields[name].default
        assert wire_default == getattr(defaults, name) or name == "stop_token_ids"


def test_defaults_and_aliases_are_declared_once():
    from engine import model_loader
    from producer.client import Client
    from producer.contract.models import MODEL_ALIASES
    from worker.config import WorkerConfig

    assert model_loader.MODEL_ALIASES is MODEL_ALIASES
    config = WorkerConfig()
    assert (config.result_ttl, config.stream_ttl) == (
        keys.DEFAULT_RESULT_TTL,
        keys.DEFAULT_STREAM_TTL,
    )
    assert (config.redis_url, config.queue) == (keys.DEFAULT_REDIS_URL, keys.DEFAULT_QUEUE)
    from redis import Redis

    client = Client(connection=Redis(host="never-used.invalid"))  # never connected
    assert (client.queue.name, client.result_ttl) == (keys.DEFAULT_QUEUE, keys.DEFAULT_RESULT_TTL)


def test_a_scripts_source_keeps_only_the_library_functions_its_body_reaches():
    library = (
        "-- Doubles.\nlocal function double(x)\n    return 2 * x\nend\n\n"
        "local function quad(x)\n    return double(double(x))\nend\n"
        "local UNUSED = {1, 2}\nlocal function unused()\n    return UNUSED\nend\n"
    )
    source = LuaScript("t", body="return quad(1)", libraries=(library,)).source
    assert "-- Doubles.\nlocal function double(x)" in source and "local function quad" in source
    assert source.index("function double") < source.index("function quad")
    assert "unused" not in source and "UNUSED" not in source
