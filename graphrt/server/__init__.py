"""``graphrt serve``: the OpenAI-compatible HTTP server (FastAPI app, engine thread, metrics)."""
