"""README's table of supported model types, generated from the registry (``model_impls``) so
that it lists what `pagedq models` lists: `pagedq models --markdown` prints it, and
`python -m worker.models_table --write-readme README.md` (`make readme-models`) rewrites the block
between README's ``<!-- models:start -->`` / ``<!-- models:end -->`` markers."""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START, END = "<!-- models:start -->", "<!-- models:end -->"
BLOCK = f"{re.escape(START)}\n(.*?)\n?{re.escape(END)}"  # empty between the markers too
NATIVE_TEST = "tests/engine/test_architectures.py"
BACKEND_TEST = "tests/engine/test_transformers_backend.py"
REGENERATE = "`make readme-models` (`python -m worker.models_table --write-readme README.md`)"


def _holds(path: Path) -> tuple[str, ...]:
    """The model types a test module says it holds: its module-level ``HOLDS`` tuple."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "HOLDS" for t in node.targets
        ):
            return tuple(ast.literal_eval(node.value))
    return ()


def family_tests(model_type: str) -> list[str]:
    """A family's own test files: ``tests/engine/test_<model_type>.py`` and every
    ``tests/engine`` module whose ``HOLDS`` names the type (an installed package has no tests:
    none)."""
    found = []
    for path in sorted((REPO / "tests" / "engine").glob("test_*.py")):
        if path.stem == f"test_{model_type}" or model_type in _holds(path):
            found.append(str(path.relative_to(REPO)))
    return found


def models_markdown() -> str:
    """The Markdown table of every claimed ``model_type``: the path ``model_impl="auto"`` serves
    it on (a native family's file, or the Transformers backend) and the tests that hold it;
    native families first."""
    from engine.models import MODEL_REGISTRY, model_impls

    rows = ["| `model_type` | Served by | Held by |", "|---|---|---|"]
    impls = model_impls()
    for model_type in sorted(impls, key=lambda t: (impls[t] != "native", t)):
        if impls[model_type] == "native":
            module = MODEL_REGISTRY[model_type][0].replace(".", "/")
            served_by = f"native: `{module}.py`"
            tests = [NATIVE_TEST, *family_tests(model_type)]
        else:
            served_by = "Transformers backend"
            tests = [BACKEND_TEST]
        held_by = ", ".join(f"`{t}`" for t in tests if t)
        rows.append(f"| `{model_type}` | {served_by} | {held_by} |")
    return "\n".join(rows)


def readme_block(readme: str) -> str | None:
    """The text between README's models markers, or None if they are missing."""
    match = re.search(BLOCK, readme, re.S)
    return match.group(1) if match else None


def write_readme(path: Path) -> bool:
    """Replace the block between the markers in ``path`` by the generated table; True if the
    file changed."""
    readme = path.read_text()
    if readme_block(readme) is None:
        raise ValueError(f"{path} has no {START} ... {END} block to rewrite")
    block = f"{START}\n{models_markdown()}\n{END}"
    updated = re.sub(BLOCK, lambda _: block, readme, count=1, flags=re.S)
    path.write_text(updated)
    return updated != readme


def main(argv: list[str] | None = None) -> int:
    """Print the table, or rewrite a README's block with it."""
    p = argparse.ArgumentParser(prog="python -m worker.models_table", description=__doc__)
    p.add_argument("--write-readme", type=Path, metavar="PATH", help="rewrite PATH's block")
    args = p.parse_args(argv)
    if args.write_readme is None:
        print(models_markdown())
    else:
        try:
            changed = write_readme(args.write_readme)
        except ValueError as exc:
            p.error(str(exc))
        print(f"{args.write_readme}: {'updated' if changed else 'already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
