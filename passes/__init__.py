"""graphrt's FX passes over the torch-level step graph Dynamo records.

One pass per file, each a class with ``__call__(graph)`` and ``uuid()``; the order lives in
``pass_manager.PIPELINE``. Passes import kernels, never the runtime.
"""

from graphrt.passes.pass_manager import PASS_NAMES, PIPELINE, PassManager, PassReport

__all__ = ["PASS_NAMES", "PIPELINE", "PassManager", "PassReport"]
