"""The embedding job kind: `task: "embed"` with `input` (texts or token-id lists) instead of a
prompt; its result carries one vector per input (`GenerationResult.embeddings`).

An embedding job runs on the same queues and workers as generation: the worker prefills each
input in its running batch and pools the final hidden states (engine/pooling.py).
"""

from __future__ import annotations

from typing import Any

EMBED_TASK = "embed"
# Inputs of one embedding job at most (OpenAI allows 2048 per request).
MAX_EMBED_INPUTS = 2048
MAX_INPUT_CHARS = 8 * 2**20
MAX_INPUT_TOKENS = 2**20
MAX_TOKEN_ID = 2**31 - 1


def check_embed_input(inputs: list[Any]) -> None:
    """ValueError naming `input[i]` unless every input is a non-empty text or token-id list."""
    if not inputs:
        raise ValueError("input: must hold at least one text or token-id list")
    if len(inputs) > MAX_EMBED_INPUTS:
        raise ValueError(f"input: at most {MAX_EMBED_INPUTS} inputs per request, got {len(inputs)}")
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            if not item or len(item) > MAX_INPUT_CHARS:
                raise ValueError(f"input[{i}]: must be 1 to {MAX_INPUT_CHARS} characters")
        elif isinstance(item, list) and item:
            if len(item) > MAX_INPUT_TOKENS:
                raise ValueError(f"input[{i}]: at most {MAX_INPUT_TOKENS} token ids")
            if any(isinstance(t, bool) or not isinstance(t, int) for t in item) or not all(
                0 <= t <= MAX_TOKEN_ID for t in item
            ):
                raise ValueError(f"input[{i}]: token ids must be integers in [0, {MAX_TOKEN_ID}]")
        else:
            raise ValueError(f"input[{i}]: must be a non-empty string or list of token ids")


def check_embed_request(request: Any) -> None:
    """What an embedding job must (not) carry beside its `input`; ValueError names the field."""
    if request.input is None:
        raise ValueError("input: required for an embedding job (task 'embed')")
    if request.prompt is not None or request.messages is not None:
        raise ValueError("an embedding job takes input, not prompt or messages")
    if request.dimensions is not None and request.dimensions < 1:
        raise ValueError(f"dimensions: must be >= 1, got {request.dimensions}")
    if request.n != 1 or request.structured_outputs is not None:
        raise ValueError("an embedding job takes no n or structured outputs")
    check_embed_input(request.input)
