"""A streamed chat answer as deltas of `reasoning_content`, `content` and `tool_calls`.

The text so far is cut as the whole answer will be (producer/chat_answer.py), holding back
what may still turn out to be a marker (`</think>`, `<tool_call>`); each delta is what a part
gained since the last one. A named tool choice's arguments stream as they come; calls parsed
from the model's own format (`auto`) or a `required` array come whole when the answer ends.
"""

from __future__ import annotations

from typing import Any

from producer.chat_answer import AnswerFormat, ChatParts, PartialParts, tool_call_id


class StreamParts:
    """The deltas of choice 0 of one streamed chat answer."""

    def __init__(self, answer: AnswerFormat, job_id: str) -> None:
        self.answer = answer
        self.job_id = job_id
        self.sent = PartialParts()
        self.call_opened = False

    def update(self, text: str) -> list[dict[str, Any]]:
        """The deltas that the text so far adds."""
        return self._deltas(self.answer.partial(text))

    def finish(self, parts: ChatParts) -> list[dict[str, Any]]:
        """The deltas that complete the streamed message into the whole answer's `parts`."""
        named = self.answer.mode == "named" and parts.tool_calls
        arguments = parts.tool_calls[0]["function"]["arguments"] if named else ""
        deltas = self._deltas(PartialParts(parts.reasoning or "", parts.content or "", arguments))
        if not named:
            for i, call in enumerate(parts.tool_calls):
                deltas.append({"tool_calls": [{"index": i, **call}]})
        return deltas

    def _deltas(self, now: PartialParts) -> list[dict[str, Any]]:
        deltas = []
        for name, key in (("reasoning", "reasoning_content"), ("content", "content")):
            new = _gain(getattr(self.sent, name), getattr(now, name))
            if new:
                deltas.append({key: new})
        new_args = _gain(self.sent.arguments, now.arguments)
        if new_args:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": new_args}}
            if not self.call_opened:
                self.call_opened = True
                call["id"] = tool_call_id(self.job_id, 0, 0)
                call["type"] = "function"
                call["function"] = {"name": self.answer.function, "arguments": new_args}
            deltas.append({"tool_calls": [call]})
        self.sent = PartialParts(
            _grown(self.sent.reasoning, now.reasoning),
            _grown(self.sent.content, now.content),
            _grown(self.sent.arguments, now.arguments),
        )
        return deltas


def _gain(sent: str, now: str) -> str:
    """What `now` adds to `sent` ("" unless it extends it: a part never takes text back)."""
    return now[len(sent) :] if now.startswith(sent) and len(now) > len(sent) else ""


def _grown(sent: str, now: str) -> str:
    return now if now.startswith(sent) else sent
