"""Everything that can change a compiled graph's code, as one JSON-able key."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess

import torch

from graphrt.version import __version__, source_hash


@functools.lru_cache(maxsize=1)
def compiler_version() -> str:
    """The C++ compiler Inductor builds with on Linux ($CXX, else g++), found without importing
    Inductor (a second of start-up for an engine that only loads packages)."""
    cc = shutil.which(os.environ.get("CXX", "g++")) or os.environ.get("CXX", "g++")
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        return f"{cc}: {out.splitlines()[0] if out else '?'}"
    except (OSError, subprocess.SubprocessError):
        return f"{cc}: ?"


@functools.lru_cache(maxsize=1)
def cpu_fingerprint() -> str:
    """The CPU's feature flags: an AOTInductor library targets the build machine's features."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor() or platform.machine()


def op_calls() -> str:
    """How a package reaches graphrt's ops: "c-shim" (the native library's C entry points, which
    the package needs at load) or "dispatch" (GRAPHRT_NATIVE=0 or a failed build: torch bodies)."""
    from graphrt.kernels.native_library import load

    return "c-shim" if load() is not None else "dispatch"


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    return {
        "graphrt": __version__,
        "graphrt_source": source_hash(),
        "torch": torch.__version__,
        "torch_npu": _installed_version("torch-npu"),  # looked up, never imported
        "cann": os.environ.get("ASCEND_TOOLKIT_VERSION"),
        "python": platform.python_version(),
        "compiler": compiler_version(),
        "device": f"cpu:{cpu_fingerprint()}",
        "op_calls": op_calls(),
        "rank": int(os.environ.get("RANK", "0")),
    }


def weights_fingerprint(module: torch.nn.Module) -> str:
    """Names, shapes, dtypes and a sample of every weight: two models never share an entry."""
    h = hashlib.sha256()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        flat = t.detach().reshape(-1)
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(flat[:64].float().numpy().tobytes())
        h.update(flat[-64:].float().numpy().tobytes())
    return h.hexdigest()


def entry_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
