"""KV memory: how many blocks a budget buys, and the per-layer cache tensors."""

from __future__ import annotations

import ctypes
import gc
import math
import mmap
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from graphrt.kernels.checks import cache_holds
from graphrt.models.config import ModelConfig
from graphrt.runner import huge_pages as pages

T = TypeVar("T")


class KVCacheTooSmallError(ValueError):
    """Not even one sequence of max_model_len fits in the KV budget."""


# kv_cache_dtype's names: "auto" is the model's dtype, but bfloat16 under int4/int8 weights
# (auto_kv_dtype)
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None = None  # None: the shipped graph cache's, else 16
    kv_cache_memory: int | None = None  # bytes; None = kv_cache_fraction of available memory
    kv_cache_fraction: float = 0.1
    enable_prefix_caching: bool = True
    # fault in every page of the cache from start-up, on a thread (runner/page_warmer.py); else
    # only those just ahead of the blocks handed out (caches in huge pages), or none
    prefault: bool = False
    # the caches' dtype: "auto" (auto_kv_dtype), "float32", or "bfloat16" under a float32 model (half
    # the bytes: twice the tokens in a budget, half a decode step's K/V read); None: a shipped
    # cache's, else auto
    kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory} must be a positive number of bytes")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction={self.kv_cache_fraction} must lie in (0, 1]")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            known = list(KV_CACHE_DTYPES)
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not known; choose one of {known}")


def auto_kv_dtype(model_dtype: torch.dtype, cfg: ModelConfig, backend: str, quantized: bool) -> torch.dtype:
    """``kv_cache_dtype="auto"``: the model's dtype, except bfloat16 under a float32 model whose
    weights are int4 or int8. Such an engine already trades exactness for speed, and K/V rounded
    to bf16 (a relative error of 2^-9) cost far less than its weights' rounding: in ``graphrt
    bench quality`` SmolLM2's perplexity moved by 0.04-0.05% against the same weights over a
    float32 cache, where the weights' int8 rounding moved it by 0.81%. They halve the K/V a decode
    step reads, which at eight rows of 200 tokens is a third of an int8 step's bytes (SmolLM2).
    Where a bf16 cache is not possible (a latent MLA cache, TorchAir) it stays the model's."""
    if quantized and cache_holds(model_dtype, torch.bfloat16) and cfg.mla is None and backend != "torchair":
        return torch.bfloat16
    return model_dtype


def resolve_kv_cache_dtype(
    name: str, model_dtype: torch.dtype, cfg: ModelConfig, backend: str, quantized: bool = False
) -> torch.dtype:
    """The caches' dtype for ``kv_cache_dtype=name``: "auto" (auto_kv_dtype), the model's, or
    bfloat16 under a float32 model (the paged-attention kernels round K/V on the write and widen
    them on the read; q, the scores and the output stay float32). A latent (MLA) cache and
    TorchAir's attention keep the model's dtype. ``quantized``: the model's weights are int4/int8."""
    if name not in KV_CACHE_DTYPES:  # a shipped cache's recorded setting is read unchecked
        raise ValueError(f"kv_cache_dtype={name!r} is not known; choose one of {list(KV_CACHE_DTYPES)}")
    if name == "auto":
        return auto_kv_dtype(model_dtype, cfg, backend, quantized)
    wanted = KV_CACHE_DTYPES[name]
    if wanted == model_dtype:
        return model_dtype
    if not cache_holds(model_dtype, wanted):
        raise ValueError(
            f"kv_cache_dtype={name!r} under a {str(model_dtype).removeprefix('torch.')} model: a KV cache holds "
            f"the model's dtype ('auto'), or 'bfloat16' under a float32 model"
        )
    if cfg.mla is not None:
        raise ValueError(f"kv_cache_dtype={name!r}: {cfg.architecture}'s latent (MLA) cache keeps the model's dtype")
    if backend == "torchair":
        raise ValueError(f"kv_cache_dtype={name!r}: the torchair backend's attention keeps the model's dtype")
    return wanted


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int  # including the null block
    block_size: int
    bytes_per_block: int
    budget_bytes: int
    max_tokens: int  # tokens the usable blocks hold
    max_seq_len_fits: int  # the longest single sequence that fits

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks - 1} blocks of {self.block_size} tokens "
            f"({self.budget_bytes / 2**20:.1f} MiB budget, {self.bytes_per_block} B/block), "
            f"{self.max_tokens} tokens in all"
        )


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = cfg.num_layers * sum(heads * dim for heads, dim in cfg.kv_cache_dims()) * dtype.itemsize
    return per_token * block_size


def _proc_kib(path: str, field: str) -> int | None:
    """A ``field:  <n> kB`` line of a Linux /proc file, in bytes; None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory_bytes() -> int:
    """MemAvailable on Linux; physical memory elsewhere."""
    available = _proc_kib("/proc/meminfo", "MemAvailable")
    return available if available is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """The process's RSS high-water mark: VmHWM on Linux (which ``peak_growth`` resets), else
    getrusage's maximum."""
    peak = _proc_kib("/proc/self/status", "VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _release_free_memory() -> None:
    """Hands memory the process has freed back to the system (glibc's malloc_trim), so a measured
    step's allocations show as growth instead of reusing what an earlier phase left resident."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_growth(fn: Callable[[], T]) -> tuple[T, int]:
    """``fn()`` and the peak RSS growth (bytes) while it ran, above the RSS when it started.

    The high-water mark is reset first (``/proc/self/clear_refs``, Linux 4.0+): a peak the
    process reached earlier — converting a checkpoint at load, say — would otherwise hide this
    one, and a growth measured that way was remembered as the step's memory (near zero) and sized
    the KV cache for every later start. Where it cannot be reset, growth above the old peak."""
    _release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = current_rss_bytes()
    except OSError:
        before = peak_rss_bytes()
    result = fn()
    return result, max(peak_rss_bytes() - before, 0)


def plan_kv_cache(
    cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype, max_model_len: int, activation_peak: int = 0
) -> KVCachePlan:
    per_block = bytes_per_block(cfg, cache.block_size, dtype)
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    else:
        budget = int(max(available_memory_bytes() - activation_peak, 0) * cache.kv_cache_fraction)
    usable = budget // per_block - 1  # one block is the null block
    need = -(-max_model_len // cache.block_size)
    if usable < need:
        raise KVCacheTooSmallError(
            f"the KV budget of {budget} bytes holds {max(usable, 0)} blocks of {cache.block_size} tokens "
            f"({per_block} bytes each), but one sequence of max_model_len={max_model_len} needs {need}; "
            f"raise kv_cache_memory to at least {(need + 1) * per_block} bytes or lower max_model_len"
        )
    return KVCachePlan(
        usable + 1, cache.block_size, per_block, budget, usable * cache.block_size, usable * cache.block_size
    )


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, huge_pages: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    (k_heads, k_dim), (v_heads, v_dim) = cfg.kv_cache_dims()
    return [
        (
            _zeros((num_blocks, block_size, k_heads, k_dim), dtype, huge_pages),
            _zeros((num_blocks, block_size, v_heads, v_dim), dtype, huge_pages),
        )
        for _ in range(cfg.num_layers)
    ]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
    """Zeros whose pages the OS provides on first touch, so a KV cache of gigabytes is allocated at
    once instead of being written through at start-up: an anonymous mapping of its own (the
    tensor keeps it alive), never memory the process freed before, whose pages are resident
    already and which calloc then writes through (as numpy's zeros did in a long-running process:
    a second engine's caches). ``huge_pages``: in 2 MiB pages where the kernel grants them
    (``huge_pages.py``): attention reads a step's K/V cold, and in 4 KiB pages each of them is a TLB
    miss too (SmolLM2 fp32, batch 1 at 480-544 tokens: 46-48 against 51-52 µs an attention call,
    two alternated pairs of `graphrt bench decode` runs)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if huge_pages and nbytes >= pages.MIN_BYTES and pages.huge_pages_available():
        return pages.huge_page_buffer(nbytes).view(dtype).view(shape)
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)  # all-zero bits are 0


def fault_in_pages(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write one element of every page of the caches with its own value, so that no later
    step pays a first-touch page fault. The caches' pages arrive on first use (``_zeros``), which
    a long-running server has paid once; a fresh process pays it on every page its steps reach
    (measured on a 2-core VM: a batch-8 decode step's K/V write 25 µs a layer on fresh pages,
    5 µs on touched ones). Start-up does not call this (2.4 GB of cache took 3.3 s there); a
    benchmark of steady-state decode does. The values are unchanged, so it is safe between steps."""
    page = os.sysconf("SC_PAGE_SIZE")
    for pair in caches:
        for cache in pair:
            flat = cache.view(-1)
            per_page = max(1, page // cache.element_size())
            for touched in (flat[::per_page], flat[-1:]):  # the last element: a page of its own, maybe
                touched.copy_(touched.clone())
