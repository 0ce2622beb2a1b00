"""graphrt: a graph-compiled LLM model runtime."""
