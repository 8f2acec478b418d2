"""README's supported-model table is the one generated from the registry, so a family added to
``MODEL_REGISTRY`` or ``TRANSFORMERS_BACKEND_TYPES`` shows up there (or this fails, naming the
command that rewrites it)."""

from __future__ import annotations

import pytest

from engine.models import model_impls
from worker.models_table import (
    BACKEND_TEST,
    NATIVE_TEST,
    REGENERATE,
    REPO,
    models_markdown,
    readme_block,
    write_readme,
)


def test_the_readme_models_table_is_the_generated_one():
    block = readme_block((REPO / "README.md").read_text())
    assert block is not None, "README.md has no <!-- models:start --> / <!-- models:end --> block"
    assert block == models_markdown(), f"README's models table is stale: run {REGENERATE}"


def test_the_table_has_one_row_per_claimed_type_with_its_path_and_tests():
    lines = models_markdown().splitlines()
    assert lines[:2] == ["| `model_type` | Served by | Held by |", "|---|---|---|"]
    rows = {}
    for line in lines[2:]:
        model_type, served_by, held_by = (cell.strip() for cell in line.strip("|").split("|"))
        rows[model_type.strip("`")] = served_by, held_by
    impls = model_impls()
    assert list(rows) == sorted(impls, key=lambda t: (impls[t] != "native", t))  # native first
    assert rows["llama"] == ("native: `engine/models/llama.py`", f"`{NATIVE_TEST}`")
    assert rows["lfm2"] == (
        "native: `engine/models/lfm2.py`",
        f"`{NATIVE_TEST}`, `tests/engine/test_lfm2.py`",  # its own file, by name
    )
    assert rows["cohere2"] == ("Transformers backend", f"`{BACKEND_TEST}`")


def test_pagedq_models_markdown_prints_the_table(capsys):
    import pagedq_cli

    assert pagedq_cli.main(["models", "--markdown"]) == 0
    assert capsys.readouterr().out == models_markdown() + "\n"


def test_write_readme_rewrites_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- models:start -->\n| old |\n<!-- models:end -->\nrest\n")
    assert write_readme(readme)
    expected = f"intro\n<!-- models:start -->\n{models_markdown()}\n<!-- models:end -->\nrest\n"
    assert readme.read_text() == expected
    assert not write_readme(readme)
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="no <!-- models:start -->"):
        write_readme(readme)
