"""docs/GATEWAY.md's SDK examples run as written against a real gateway (only the URL and the
key are swapped for the test's); the gateway reads nothing from Redis but JSON."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
from gw_helpers import KEY, REPO

DOC = (REPO / "docs" / "GATEWAY.md").read_text()
EXAMPLES = dict(re.findall(r"<!-- gateway-example: (\w+) -->\s*```python\n(.*?)```", DOC, re.S))


@pytest.mark.parametrize("name", ["chat", "batch"])
def test_the_documented_examples_run(name, gateway, tmp_path, monkeypatch):
    code = EXAMPLES[name].replace("http://localhost:8000/v1", gateway.url + "/v1")
    code = code.replace('"sk-my-key"', repr(KEY))
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"GATEWAY.md:{name}", "exec"), {})
    if name == "batch":
        assert "completed" in out.getvalue()
        assert all(f"row-{i}" in out.getvalue() for i in range(3))


def test_the_readme_points_at_the_gateway_doc():
    assert "docs/GATEWAY.md" in (REPO / "README.md").read_text()


def test_the_gateway_never_unpickles_or_deserializes_rq_jobs():
    source = "\n".join(p.read_text() for p in Path(REPO, "gateway").glob("*.py"))
    for forbidden in ("pickle", "Job.fetch", "Job.restore", "eval(", "exec("):
        assert forbidden not in source, forbidden


def test_the_flags_table_is_the_parsers():
    from gateway.cli import flags_markdown

    table = DOC.split("<!-- gateway-flags:start -->\n")[1].split("\n<!-- gateway-flags:end -->")[0]
    assert table == flags_markdown()
