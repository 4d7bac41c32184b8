"""Serving: continuous batching over the engine (batcher.py) and the OpenAI-compatible HTTP layer (server.py)."""
