"""graphrt's native CPU kernels: built from ``kernels/native/`` on first use, cached, loaded.

Why on first use rather than at install time: graphrt needs a C++ compiler anyway (Inductor
compiles every graph with it), a build on first use works the same from an editable checkout, a
wheel or a plain ``pip install .`` with build isolation (a setuptools extension would need torch
importable at build time), and the library is keyed by what it was built from, so a torch upgrade
or an edited kernel rebuilds it instead of loading a stale one.

The library lands in ``<cache>/native/<key>/`` (``$GRAPHRT_CACHE_DIR``, else
``$XDG_CACHE_HOME/graphrt``, else ``~/.cache/graphrt``); the key hashes the sources, torch's
version and the compiler. Builds run under an ``fcntl`` lock on a file in that folder, which the
kernel releases when a process dies, so a killed build never leaves a lock that hangs the next one
(torch's own extension builder can); the library is written to a temporary name and renamed into
place, so a reader never sees half a file.

``GRAPHRT_NATIVE=0`` skips the library: every op then runs its portable torch body. A failed build
warns once and does the same. ``GRAPHRT_CPU_ISA`` (``vnni``, ``avx512``, ``avx2``, ``portable``) asks the
library for a narrower instruction set than the CPU's widest (the others are tested that way).
``GRAPHRT_CPU_TUNING`` (``amd``, ``intel``) overrides how weights are streamed, chosen by the CPU's
vendor by default (a non-temporal single stream on AMD, prefetched row pairs elsewhere: each
measured fastest on its own vendor).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import warnings

import torch

NATIVE_DIR = pathlib.Path(__file__).parent / "native"
SOURCES = (
    "isa_kernels.cpp",
    "ops.cpp",
    "attention.cpp",
    "quant_tiles.cpp",
    "packed_bf16.cpp",
    "sampling.cpp",
    "c_shims.cpp",
)
ISAS = ("amx", "vnni", "avx512", "avx2", "portable")
LIBRARY = "libgraphrt_cpu.so"


class NativeBuildError(RuntimeError):
    """The native kernels could not be compiled or loaded."""


def cache_root() -> pathlib.Path:
    """graphrt's per-user cache (native kernels, tokenizers, benchmark files): $GRAPHRT_CACHE_DIR,
    else $XDG_CACHE_HOME/graphrt, else ~/.cache/graphrt."""
    if os.environ.get("GRAPHRT_CACHE_DIR"):
        return pathlib.Path(os.environ["GRAPHRT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "graphrt"


def compiler() -> str:
    return os.environ.get("CXX", "g++")


def _torch_dirs() -> tuple[str, str]:
    root = os.path.dirname(torch.__file__)
    return os.path.join(root, "include"), os.path.join(root, "lib")


def compile_flags() -> list[str]:
    include, _ = _torch_dirs()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        "-O3",
        "-std=c++17",
        "-ffp-contract=fast",  # multiply-adds as FMA instructions
        "-fPIC",
        "-fopenmp",  # at::parallel_for is OpenMP in torch's CPU build
        "-Wno-psabi",
        "-DNDEBUG",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{include}",
    ]


def link_flags() -> list[str]:
    _, lib = _torch_dirs()
    return ["-shared", "-fopenmp", f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


@functools.lru_cache(maxsize=1)
def _compiler_version() -> str:
    try:
        out = subprocess.run([compiler(), "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def build_key() -> str:
    h = hashlib.sha256()
    for path in sorted(NATIVE_DIR.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    for part in (torch.__version__, sys.platform, compiler(), _compiler_version(), *compile_flags(), *link_flags()):
        h.update(part.encode())
    return h.hexdigest()[:24]


def _run(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise NativeBuildError(f"{' '.join(cmd[:3])} ... failed:\n{out.stderr[-4000:]}")


def build(folder: pathlib.Path) -> pathlib.Path:
    """Compile the sources into ``folder/LIBRARY`` (both units at once) and return its path."""
    target = folder / LIBRARY
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        objects = [os.path.join(tmp, f"{pathlib.Path(s).stem}.o") for s in SOURCES]
        try:
            procs = [
                subprocess.Popen(
                    [compiler(), *compile_flags(), "-c", str(NATIVE_DIR / s), "-o", o],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for s, o in zip(SOURCES, objects)
            ]
        except OSError as e:
            raise NativeBuildError(f"cannot run the C++ compiler {compiler()!r} (set CXX to one): {e}") from e
        errors = [p.communicate()[1] for p in procs]
        for p, err, s in zip(procs, errors, SOURCES):
            if p.returncode != 0:
                raise NativeBuildError(f"compiling {s} with {compiler()} failed:\n{err[-4000:]}")
        staged = os.path.join(tmp, LIBRARY)
        _run([compiler(), *objects, "-o", staged, *link_flags()])
        os.replace(staged, target)
    return target


def library_path() -> pathlib.Path:
    """The cached library, built first if missing (one builder at a time per key)."""
    folder = cache_root() / "native" / build_key()
    target = folder / LIBRARY
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            if not target.exists():
                build(folder)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


CPU_TUNINGS = ("amd", "intel")


def check_isa_request() -> None:
    wanted = os.environ.get("GRAPHRT_CPU_ISA", "")
    if wanted and wanted not in ISAS:
        raise NativeBuildError(f"GRAPHRT_CPU_ISA={wanted!r} is not known; use one of {list(ISAS)} or leave it unset")
    tuning = os.environ.get("GRAPHRT_CPU_TUNING", "")
    if tuning and tuning not in CPU_TUNINGS:
        raise NativeBuildError(
            f"GRAPHRT_CPU_TUNING={tuning!r} is not known; use one of {list(CPU_TUNINGS)} or leave it unset"
        )


@functools.lru_cache(maxsize=1)
def load() -> str | None:
    """Load the native kernels once; returns the instruction set they run with, or None when the
    portable torch bodies serve instead (GRAPHRT_NATIVE=0, or the build failed: warned once)."""
    if os.environ.get("GRAPHRT_NATIVE", "1") == "0":
        return None
    check_isa_request()
    try:
        path = str(library_path())
        # global: an AOTInductor package built with AOTI_C_SHIMS resolves them in this library
        ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        torch.ops.load_library(path)
    except (NativeBuildError, OSError) as e:
        warnings.warn(f"graphrt's native CPU kernels are unavailable, using the torch bodies: {e}", stacklevel=2)
        return None
    return torch.ops.graphrt_native.isa()


# The C entry points of native/c_shims.cpp, as Inductor declares them in a package's wrapper:
# a package built with these calls the ops directly instead of through the proxy executor.
AOTI_C_SHIMS = {
    "linear": "AOTITorchError aoti_torch_cpu_linear(AtenTensorHandle, AtenTensorHandle, AtenTensorHandle*, "
    "AtenTensorHandle*)",
    "linear_quantized": "AOTITorchError aoti_torch_cpu_linear_quantized(AtenTensorHandle, AtenTensorHandle, "
    "AtenTensorHandle, AtenTensorHandle*, AtenTensorHandle*, AtenTensorHandle*)",
    "dequantize": "AOTITorchError aoti_torch_cpu_dequantize(AtenTensorHandle, AtenTensorHandle, AtenTensorHandle*, "
    "int32_t, AtenTensorHandle*)",
    "linear_tiles": "AOTITorchError aoti_torch_cpu_linear_tiles(AtenTensorHandle, AtenTensorHandle, "
    "AtenTensorHandle*, AtenTensorHandle*)",
    "dequantize_tiles": "AOTITorchError aoti_torch_cpu_dequantize_tiles(AtenTensorHandle, int32_t, AtenTensorHandle*)",
    "linear_packed_bf16": "AOTITorchError aoti_torch_cpu_linear_packed_bf16(AtenTensorHandle, AtenTensorHandle, "
    "AtenTensorHandle*, AtenTensorHandle*)",
    "unpack_bf16": "AOTITorchError aoti_torch_cpu_unpack_bf16(AtenTensorHandle, AtenTensorHandle*)",
    "slot_mapping": "AOTITorchError aoti_torch_cpu_slot_mapping(AtenTensorHandle, AtenTensorHandle, "
    "AtenTensorHandle, int64_t, AtenTensorHandle*)",
    "paged_attention": "AOTITorchError aoti_torch_cpu_paged_attention(AtenTensorHandle, AtenTensorHandle*, "
    "AtenTensorHandle*, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle*, AtenTensorHandle, AtenTensorHandle, "
    "AtenTensorHandle, double, AtenTensorHandle*)",
    "sample": "AOTITorchError aoti_torch_cpu_sample(AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, "
    "AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle*, AtenTensorHandle*, "
    "AtenTensorHandle*)",
}


def aoti_c_shims() -> dict:
    """Inductor's ``aot_inductor.custom_ops_to_c_shims`` for graphrt's native ops: empty when the
    native library is not loaded (a package then reaches the ops' torch bodies by dispatch)."""
    if load() is None:
        return {}
    return {getattr(torch.ops.graphrt, name).default: [decl] for name, decl in AOTI_C_SHIMS.items()}
