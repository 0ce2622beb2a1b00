"""Small shared helpers for the test suite."""

import graphrt


def make_llm(model, **kwargs):
    """An engine in eager mode (no graph compiles) unless the test asks for compile=True."""
    return graphrt.LLM(model, **{"compile": False, "progress": False, **kwargs})
