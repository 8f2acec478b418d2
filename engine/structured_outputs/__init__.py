"""Structured outputs: constrain a request's sampling to a JSON schema, regex, choice or grammar
(with llguidance), per request, inside the running batch. See docs/STRUCTURED_OUTPUTS.md.

Only the parameters are imported here: SamplingParams needs them, llguidance is not needed
until a constrained request reaches an engine (engine.structured_outputs.manager).
"""

from engine.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
