"""Checkpoint tensor names -> pagedq's, for families whose modules transformers names otherwise
(``transformer.h.0.self_attention.dense`` -> ``layers.0.self_attn.o_proj``)."""

from __future__ import annotations


def renamed(name: str, table: tuple[tuple[str, str], ...]) -> str:
    """``name`` after each ``(old, new)`` of ``table`` in turn: an ``old`` that starts with a dot
    is replaced wherever it stands (a module inside a layer), any other only as the name's
    prefix (a top-level module)."""
    for old, new in table:
        if old.startswith("."):
            name = name.replace(old, new)
        elif name.startswith(old):
            name = new + name.removeprefix(old)
    return name
