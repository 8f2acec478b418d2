"""Server-sent events in OpenAI's chunk shapes, read from a job's token stream.

Each `token` entry (the tokens of one worker window) becomes one chunk; a `restart` entry (the
job re-ran after its worker died) is absorbed: the re-run's text is matched against what was
already sent and only what goes beyond it is sent (online requests are seeded, so a re-run
samples the same tokens). The end carries the finish reason, the other choices of n > 1 and
the log-probabilities (from the result), then usage when asked, then `[DONE]`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.requests import Online
from producer.contract import stream as stream_entry
from producer.contract.schema import GenerationResult
from producer.openai_output import CHAT_URL, ChatCompletion, completion_body

DONE = "[DONE]"


class StreamDiverged(RuntimeError):
    """A re-run produced other text than what was already sent."""


class ChunkWriter:
    """Builds the JSON of each chunk of one streamed response."""

    def __init__(self, online: Online, job_id: str, model: str) -> None:
        self.chat = online.url == CHAT_URL
        self.online = online
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{job_id}"
        self.created = int(time.time())
        self.model = model

    def chunk(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None = None,
        logprobs: Any = None,
        role: bool = False,
    ) -> str:
        """One chunk carrying `text` for choice `index`."""
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs}
        choice["finish_reason"] = finish_reason
        return self._dump([choice])

    def usage(self, result: GenerationResult) -> str:
        """The last chunk of `stream_options.include_usage`: no choices, the usage."""
        u = result.usage
        usage = {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
        }
        return self._dump([], usage)

    def _dump(self, choices: list, usage: dict | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.online.include_usage:
            body["usage"] = usage
        return json.dumps(body, separators=(",", ":"))

    def final(self, result: GenerationResult) -> list[str]:
        """The chunks after the streamed text: the other choices of n > 1 (whole), then per
        choice its finish reason with its log-probabilities (from the result)."""
        body = completion_body(result, self.online.url, self.online.top_k)
        out = []
        for choice in body.choices:
            if choice.index != 0:  # only choice 0 is streamed token by token
                text = choice.message.content if isinstance(body, ChatCompletion) else choice.text
                out.append(self.chunk(choice.index, text, role=self.chat))
            logprobs = choice.logprobs.model_dump() if choice.logprobs is not None else None
            text = None if self.chat else ""
            out.append(self.chunk(choice.index, text, choice.finish_reason, logprobs))
        return out


class Relay:
    """Turns a job's stream entries into the text to send, absorbing re-runs."""

    def __init__(self) -> None:
        self.sent = ""
        self.run_text = ""
        self.after_restart = False
        self.first_sent = False

    def take(self, entry: dict[str, str]) -> str:
        """The new text an entry adds to what was sent ("" when nothing new)."""
        event = entry.get(stream_entry.EVENT)
        if event == stream_entry.RESTART:
            self.run_text, self.after_restart = "", True
            return ""
        if event != stream_entry.TOKEN:
            return ""
        self.run_text += stream_entry.entry_delta(entry)
        if not self.run_text.startswith(self.sent[: len(self.run_text)]):
            raise StreamDiverged("the job re-ran and produced other text than was sent")
        if len(self.run_text) <= len(self.sent):
            return ""
        new = self.run_text[len(self.sent) :]
        self.sent = self.run_text
        return new
