"""A function that job hashes in the tests name as their RQ callback: it must never run.

Worker processes get this folder on PYTHONPATH, so `callback_marker.touch` would import; if
anything ever called it, the file named by $PAGEDQ_TEST_MARKER would appear.
"""

from __future__ import annotations

import os
from pathlib import Path


def touch(*args, **kwargs) -> None:
    """Leave the marker file."""
    Path(os.environ.get("PAGEDQ_TEST_MARKER", "/tmp/pagedq-callback-called")).write_text("ran")
