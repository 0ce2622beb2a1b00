"""Compiling steps into graphs: Dynamo capture per key (``capture``), the inner backends
(``inner``), AOTInductor packages (``aoti``) and the builder that loads or compiles a key's graph
(``graph_builder``). The user-facing ``graphrt.compile`` lives with ``LLM`` in ``graphrt.llm``.
"""
