"""The per-user cache: what graphrt keeps between runs so that the second start is fast.

One directory ($GRAPHRT_CACHE_DIR, else $XDG_CACHE_HOME/graphrt, else ~/.cache/graphrt) with one
folder per kind of entry. Every folder can be emptied at any time: its entries are rebuilt on use.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
from dataclasses import dataclass

SECTIONS = {
    "graphs": "compiled step graphs (AOTInductor packages, keyed and checked like a shipped graph cache)",
    "weights": "GGUF checkpoints converted to graphrt's layout (and their tokenizers), memory-mapped on load",
    "profiles": "measured activation memory of a worst-case step, per model and settings (sizes the KV cache)",
    "native": "graphrt's native kernel library, built for this CPU and torch",
    "llamacpp": "F32/F16 GGUF copies for `graphrt bench decode --vs-llamacpp`",
}


def cache_root() -> pathlib.Path:
    """The rule ``graphrt.kernels.native_library.cache_root`` follows too (the kernels import
    nothing from graphrt, and importing them builds the native library: not for `cache ls`)."""
    if os.environ.get("GRAPHRT_CACHE_DIR"):
        return pathlib.Path(os.environ["GRAPHRT_CACHE_DIR"])
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "graphrt"


def default_graph_cache_dir() -> str:
    return str(cache_root() / "graphs")


def weights_cache_dir() -> str:
    return str(cache_root() / "weights")


def remembered(section: str, key: dict, compute):
    """``compute()``'s JSON-able result, kept under ``section`` by the hash of ``key``."""
    name = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
    path = cache_root() / section / f"{name}.json"
    try:
        return json.loads(path.read_text())["value"]
    except (OSError, ValueError, KeyError):
        pass
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "value": value}, default=str))
        os.replace(tmp, path)
    except OSError:  # a read-only cache only costs the next start the measurement
        pass
    return value


@dataclass(frozen=True)
class SectionUsage:
    name: str
    path: str
    files: int
    bytes: int
    what: str


def _usage(path: str) -> tuple[int, int]:
    files = size = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                size += os.path.getsize(os.path.join(dirpath, n))
                files += 1
            except OSError:  # removed while we walked
                pass
    return files, size


def usage() -> list[SectionUsage]:
    root = cache_root()
    return [SectionUsage(name, str(root / name), *_usage(str(root / name)), what) for name, what in SECTIONS.items()]


def clear(sections: list[str] | None = None) -> int:
    """Empty the named sections (all by default); returns the bytes freed. The graph store is
    emptied under its lock, so a process writing to it at the same time never sees a torn file."""
    from graphrt.artifacts.store import ArtifactStore

    names = sections or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown cache section(s) {unknown}; sections: {list(SECTIONS)}")
    freed = 0
    for name in names:
        path = str(cache_root() / name)
        if not os.path.isdir(path):
            continue
        if name == "graphs":
            freed += ArtifactStore(path).clear()
            continue
        freed += _usage(path)[1]
        shutil.rmtree(path, ignore_errors=True)
    return freed
