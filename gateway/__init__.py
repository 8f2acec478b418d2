"""The OpenAI-compatible gateway: Files, Batches, chat and completions over the pagedq queue.

It enqueues into Redis and reads results and token streams from it; it holds no state of its
own, so any number of gateways can share one Redis. Imports only `producer/` (no torch).
"""
