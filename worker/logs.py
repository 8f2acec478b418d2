"""Logging set-up: console lines by default; with json, every stderr line is one JSON object.

In json mode, stdlib logging (RQ's too), `warnings`, transformers' logging and uncaught
exceptions all go through structlog's JSON renderer; progress bars are turned off before any
model loads; whatever else a library writes to `sys.stderr` is wrapped line by line into a JSON
object (`logger: "stderr"`), so a log shipper never sees a bare line.
"""

from __future__ import annotations

import atexit
import importlib.util
import io
import json
import logging
import os
import sys
import threading
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any, TextIO

import structlog

log = structlog.get_logger("pagedq.worker")

# Read by huggingface_hub, tqdm (4.66+: TQDM_* env vars set its defaults) and transformers.
PROGRESS_BAR_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}


def configure_logging(log_format: str = "console", level: str = "INFO") -> None:
    """Route structlog and stdlib logging through one renderer on stderr.

    Call it first thing in the process, before transformers or the model is imported.
    """
    if log_format not in ("console", "json"):
        raise ValueError(f"log_format={log_format!r} is invalid: must be 'console' or 'json'")
    stream = sys.__stderr__ if log_format == "json" else sys.stderr
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if log_format == "json":
        renderer: Any = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=stream.isatty())
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    if log_format == "json":
        _json_only(stream)


def _json_only(stream: TextIO) -> None:
    """Send every other writer of stderr through the JSON handler."""
    os.environ.update(PROGRESS_BAR_ENV)
    logging.captureWarnings(True)
    if importlib.util.find_spec("transformers") is not None:
        import transformers.utils.logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()
        hf_logging.disable_progress_bar()
    if importlib.util.find_spec("huggingface_hub") is not None:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    sys.stderr = writer = JsonLineWriter(stream)
    atexit.register(writer.close_line)
    sys.excepthook = _log_uncaught
    threading.excepthook = lambda args: _log_uncaught(
        args.exc_type, args.exc_value, args.exc_traceback, getattr(args.thread, "name", "?")
    )


def _log_uncaught(exc_type, exc_value, tb, thread: str = "main") -> None:
    logging.getLogger("pagedq").critical(
        "uncaught exception in thread %s", thread, exc_info=(exc_type, exc_value, tb)
    )


class JsonLineWriter(io.TextIOBase):
    """A `sys.stderr` stand-in: JSON lines pass through, any other line is wrapped in JSON.

    Carriage-return redraws (a progress bar that slipped through) keep only their last frame.
    """

    def __init__(self, target: TextIO) -> None:
        self.target = target
        self._buffer = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        """Always: this is an output stream."""
        return True

    def isatty(self) -> bool:
        """Never: tools that draw for a terminal must not draw here."""
        return False

    def write(self, text: str) -> int:
        """Buffer `text`; write each complete line as one JSON object."""
        with self._lock:
            self._buffer += text
            *lines, self._buffer = self._buffer.split("\n")
            for line in lines:
                self._emit(line)
        return len(text)

    def flush(self) -> None:
        """Flush the target; a partial line waits for its end (a bar redraws it with a \r)."""
        self.target.flush()

    def close_line(self) -> None:
        """Write a pending partial line (at exit)."""
        with self._lock:
            if self._buffer:
                self._emit(self._buffer)
                self._buffer = ""
        self.target.flush()

    def _emit(self, line: str) -> None:
        line = line.rsplit("\r", 1)[-1].rstrip()
        if not line:
            return
        if line.startswith("{"):
            try:
                json.loads(line)
            except ValueError:
                pass
            else:
                self.target.write(line + "\n")
                return
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        record = {"event": line, "level": "warning", "logger": "stderr", "timestamp": now}
        self.target.write(json.dumps(record) + "\n")
        self.target.flush()


def log_engine_ready(engine: Any, load_s: float, **fields: Any) -> None:
    """The start line: model, device and dtype actually chosen, KV cache size, load time."""
    kv = getattr(engine, "kv_cache_manager", None)
    log.info(
        "model loaded",
        model=engine.model_name,
        device=str(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."),
        num_kv_blocks=kv.block_pool.num_blocks if kv is not None else None,
        block_size=engine.config.block_size,
        tensor_parallel_size=engine.config.tensor_parallel_size,
        max_model_len=engine.max_model_len,
        load_s=round(load_s, 2),
        **fields,
    )


def log_job_end(
    job_id: str,
    status: str,
    *,
    finish_reason: str | None = None,
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
    timings: Mapping[str, float | None] | None = None,
    error: str | None = None,
    **fields: Any,
) -> None:
    """The one log line of a job end (finished, failed or canceled): id, status, tokens, timings.

    `timings` is the result's timings dict (`queued_s`, `ttft_s`, `total_s`), flattened in.
    """
    event: dict[str, Any] = {
        "job_id": job_id,
        "status": status,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        **dict(timings or {}),
        **fields,
    }
    if error is not None:
        event["error"] = error
    (log.warning if status == "failed" else log.info)("job ended", **event)
