"""Hugging Face's ``kernels`` package shares its import name with pagedq's ``kernels/``: where it
is installed, loading a model is refused naming the fix (transformers would otherwise import
ours in its place and fail with a bare ImportError)."""

from __future__ import annotations

import subprocess
import sys


def test_hugging_face_kernels_installed_is_refused_naming_the_fix(tmp_path):
    info = tmp_path / "kernels-0.19.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    code = (
        "from engine.model_loader import load_config, resolve_model\n"
        "load_config(resolve_model('smollm2'))\n"
    )
    env_path = f"{tmp_path}"
    proc = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.append({env_path!r})\n{code}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "Hugging Face's `kernels` package (0.19.1)" in proc.stderr
    assert "pip uninstall kernels" in proc.stderr


def test_without_it_the_check_passes():
    from engine.model_loader import check_no_hub_kernels

    check_no_hub_kernels()
