"""graphrt.compile: trace a model's steps once, fuse them with graphrt's passes, compile a graph
per key.

    llm = graphrt.compile("path/to/model")            # same as graphrt.LLM(..., compile=True)
    llm.pass_report()                                 # what each pass matched in which graph
"""

from __future__ import annotations

from typing import Any


def compile(model: Any = None, *, backend: str = "inductor", passes_disabled=(), **llm_kwargs):
    """Compile ``model`` (a graphrt model, a Hugging Face directory, a .gguf path, an in-memory
    transformers model, or None for the embedded default) into a runtime with one captured graph
    per graph key; returns the ``graphrt.LLM`` that serves it."""
    from graphrt.llm import LLM

    return LLM(model, compile=True, backend=backend, passes_disabled=passes_disabled, **llm_kwargs)
