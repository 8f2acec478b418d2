"""The C++ paged attention of another git revision, loaded beside this tree's for A/B timing.

A kernel change is judged by a ratio measured in one process, both kernels timed in the same
rounds (separate runs on a shared 2-core host differ by more than most changes). The revision's
``kernels/csrc/paged_attention_cpu.cpp`` (and the header it includes) is built with this tree's
flags under the op namespace ``pagedq_rev``, cached like the kernels themselves.
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
FILES = ("kernels/csrc/paged_attention_cpu.cpp", "kernels/csrc/vec_cpu.h")


def load_revision_attention(rev: str) -> Callable[..., None]:
    """``fn(query, kv_cache, query_start_loc, seq_lens, block_table, scale, out)`` of ``rev``."""
    from torch.utils import cpp_extension

    from kernels.cpu_attention import build_flags, cache_dir

    sources = {}
    for path in FILES:
        text = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_IMPL"):
            text = text.replace(f"{macro}(pagedq,", f"{macro}(pagedq_rev,")
        sources[Path(path).name] = text
    digest = hashlib.sha256("".join(sources.values()).encode())
    digest.update(" ".join(build_flags()).encode() + torch.__version__.encode())
    name = f"pagedq_rev_{digest.hexdigest()[:12]}"
    build_dir = cache_dir() / name
    library = build_dir / f"{name}.so"
    if library.exists():
        torch.ops.load_library(str(library))
    else:
        build_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            for file_name, text in sources.items():
                (Path(tmp) / file_name).write_text(text)
            cpp_extension.load(
                name=name,
                sources=[str(Path(tmp) / "paged_attention_cpu.cpp")],
                extra_cflags=build_flags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
            )
    op = torch.ops.pagedq_rev.unified_attention
    # Revisions with attention options take (window, soft cap, sinks) after kv_split_size.
    extra = (0, 0.0, None) if len(op.default._schema.arguments) > 8 else ()

    def attend(query, kv_cache, query_start_loc, seq_lens, block_table, scale, out) -> None:
        op(query, kv_cache, query_start_loc, seq_lens, block_table, float(scale), out, 0, *extra)

    return attend
