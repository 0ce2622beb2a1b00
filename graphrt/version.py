"""graphrt's identity: its version, and a hash of the source that makes up the runtime.

The hash covers the runtime (``graphrt/``), the op library (``graphrt.kernels``) and the passes
(``graphrt.passes``) wherever they are installed from, native sources included: editing a pass or a
kernel changes every graph-cache key. It leaves out the runtime's outer folders, whose code is
never traced into a graph (the command line, the benchmarks, the HTTP server, the speculative
drafters' host-side policy): editing them keeps every compiled graph. This module imports
nothing of the runtime above it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import pathlib

__version__ = "0.1.0"

_SOURCE_SUFFIXES = (".py", ".cpp", ".h")
_OUTSIDE_GRAPHS = ("bench", "cli", "server", "spec")  # graphrt's folders that only drive the engine


def package_dirs() -> dict[str, pathlib.Path]:
    """Where graphrt, graphrt.kernels and graphrt.passes are loaded from (no op is registered)."""
    dirs = {}
    for name in ("graphrt", "graphrt.kernels", "graphrt.passes"):
        spec = importlib.util.find_spec(name)
        dirs[name] = pathlib.Path(spec.origin).parent
    return dirs


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    h = hashlib.sha256()
    for name, root in package_dirs().items():
        for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES):
            if name == "graphrt" and path.relative_to(root).parts[0] in _OUTSIDE_GRAPHS:
                continue
            h.update(f"{name}/{path.relative_to(root)}".encode())
            h.update(path.read_bytes())
    return h.hexdigest()
