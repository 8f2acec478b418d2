"""`stream: true` on /v1/responses: the Responses API's server-sent events, from a job's token
stream.

Order, as OpenAI sends them: response.created, response.in_progress, then per output item
response.output_item.added, (a message) response.content_part.added, response.output_text.delta
..., response.output_text.done, response.content_part.done, (a function call)
response.function_call_arguments.delta / .done, response.output_item.done, and last
response.completed (or response.incomplete / response.failed). Every event carries its `type`
and a `sequence_number` from 0.

A plain answer's text goes out delta by delta as the worker writes it. An answer that may
turn out to be something else (it opens with `<think>`, or the request has tools, so it may be
a function call) is held and sent whole, as its items, once the job ended.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request

from gateway.completions import _cancel, _result
from gateway.metrics import OPEN_STREAMS
from gateway.sse import Relay, StreamDiverged
from producer.openai_responses import ResponseOptions
from producer.openai_responses_output import (
    THINK_OPEN,
    message_item,
    output_text_part,
    response_object,
)
from producer.results import is_final

END_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete"}


class EventWriter:
    """Numbers the events of one response."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> dict[str, str]:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return {"event": kind, "data": json.dumps(data, separators=(",", ":"))}


async def response_events(
    request: Request,
    job_id: str,
    options: ResponseOptions,
    model: str,
    created_at: int,
    on_done: Callable[[dict[str, Any]], Awaitable[None]],
) -> AsyncIterator[dict[str, str]]:
    """The events of one streamed response; `on_done(response)` stores the final object."""
    hub = request.app.state.hub
    follow = hub.follow(job_id)
    event = EventWriter()
    relay = Relay()
    ended = live = False
    held = bool(options.tools)  # a tool call is known only at the end
    OPEN_STREAMS.inc()
    try:
        start = response_object(job_id, options, model, created_at)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        while True:
            entry = await follow.entries.get()
            new = ""
            while not is_final(entry):
                new += relay.take(entry)
                if follow.entries.empty():
                    break
                entry = follow.entries.get_nowait()
            ended = is_final(entry)
            if not held and not live and relay.sent:
                # Thinking comes whole at the end, as a reasoning item before the message.
                opening = relay.sent.lstrip()[: len(THINK_OPEN)]
                if THINK_OPEN.startswith(opening) and not ended:
                    new = ""  # maybe "<think>": wait for more
                    continue
                held = opening == THINK_OPEN
                if not held:
                    live, new = True, relay.sent
                    for e in _message_start(event, job_id):
                        yield e
            if live and new:
                yield _delta(event, job_id, new)
            if ended:
                break
        result = await _result(request, job_id, entry)
        final = response_object(job_id, options, model, created_at, result)
        if result.status != "finished":
            yield event("response.failed", response=final)
            await on_done(final)
            return
        for index, item in enumerate(final["output"]):
            if live and item["type"] == "message":
                text = item["content"][0]["text"]
                if text.startswith(relay.sent) and len(text) > len(relay.sent):
                    # Entries were lost (expired or trimmed): the result holds the whole text.
                    yield _delta(event, job_id, text[len(relay.sent) :], index)
                for e in _message_end(event, item, index):
                    yield e
                continue
            for e in _whole_item(event, item, index):
                yield e
        yield event(END_EVENTS.get(final["status"], "response.completed"), response=final)
        await on_done(final)
    except StreamDiverged as exc:
        yield event("error", code="stream_diverged", message=str(exc), param=None)
    finally:
        OPEN_STREAMS.dec()
        hub.unfollow(follow)
        if not ended:
            _cancel(request, job_id)


def _message_start(event: EventWriter, job_id: str, index: int = 0) -> list[dict[str, str]]:
    item = message_item(job_id, "", status="in_progress")
    return [
        event("response.output_item.added", output_index=index, item=item),
        event(
            "response.content_part.added",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            part=output_text_part(""),
        ),
    ]


def _delta(event: EventWriter, job_id: str, text: str, index: int = 0) -> dict[str, str]:
    return event(
        "response.output_text.delta",
        item_id=f"msg_{job_id}",
        output_index=index,
        content_index=0,
        delta=text,
        logprobs=[],
    )


def _message_end(event: EventWriter, item: dict[str, Any], index: int) -> list[dict[str, str]]:
    part = item["content"][0]
    common = {"item_id": item["id"], "output_index": index, "content_index": 0}
    return [
        event("response.output_text.done", **common, text=part["text"], logprobs=[]),
        event("response.content_part.done", **common, part=part),
        event("response.output_item.done", output_index=index, item=item),
    ]


def _whole_item(event: EventWriter, item: dict[str, Any], index: int) -> list[dict[str, str]]:
    """The events of an item sent at the end, whole."""
    kind = item["type"]
    if kind == "message":
        job_id = item["id"].removeprefix("msg_")
        out = _message_start(event, job_id, index)
        out.append(_delta(event, job_id, item["content"][0]["text"], index))
        return out + _message_end(event, item, index)
    started = {**item, "status": "in_progress"}
    if kind == "function_call":
        started["arguments"] = ""
    out = [event("response.output_item.added", output_index=index, item=started)]
    if kind == "function_call":
        common = {"item_id": item["id"], "output_index": index}
        out.append(
            event("response.function_call_arguments.delta", **common, delta=item["arguments"])
        )
        out.append(
            event(
                "response.function_call_arguments.done",
                **common,
                name=item["name"],
                arguments=item["arguments"],
            )
        )
    out.append(event("response.output_item.done", output_index=index, item=item))
    return out
