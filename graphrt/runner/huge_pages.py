"""The weights (and the KV caches: ``kv_cache.py``) in 2 MiB pages.

A decode step streams every weight once: 94 MB for SmolLM2's int4 file, 540 MB in fp32. Mapped
from the weights cache (or allocated tensor by tensor), they sit in 4 KiB pages, so the stream
takes a TLB miss every 4 KiB and evicts every other translation the step needs: the runner's
Python, the small ops between the products and the graph's own buffers each pay page walks after
every product. Copied once at start into a private anonymous mapping advised ``MADV_HUGEPAGE``,
the same bytes take 2 MiB pages.

Each tensor is re-pointed in place (``Tensor.set_``) to the copy of its storage, so every holder of
it (the graphs' input lists, tied weights, views) sees the new memory, and tensors that shared a
storage still share it. Nothing is done where the kernel gives no huge pages (transparent huge
pages ``never``, or no ``MADV_HUGEPAGE``) or for less than one huge page.

The cost is the first touch of each huge page: on the 2-vCPU VM this was measured on, a fresh
2 MiB page took 8-13 ms to fault (100 MB: 0.4-0.65 s, against 0.02 s in 4 KiB pages; the VM's
host backs free huge pages lazily), so start-up grows by 0.6 s for SmolLM2's int4 weights and
0.8 s for its fp32 ones, and a fresh process's first steps pay for the KV pages they reach: a
one-off `graphrt generate` of 8 tokens took 0.8-1.0 s to its first token instead of 0.16-0.27.
Hence an engine setting, ``huge_pages``: on for ``LLM``, `graphrt serve` and the decode
benchmark, which run long enough to earn it back (SmolLM2 fp32 at 480-544 tokens: 17.6 against
21.4 ms a step), off for a one-off `graphrt generate`.
"""

from __future__ import annotations

import mmap
import weakref

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = HUGE_PAGE  # a smaller block cannot hold a huge page: left where it is
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_blocks: dict[int, int] = {}  # the huge-page blocks handed out: storage address → bytes


def huge_pages_available() -> bool:
    """Whether advising a mapping MADV_HUGEPAGE can give it huge pages here."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(THP_MODE) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed uint8 memory starting on a 2 MiB boundary, advised MADV_HUGEPAGE. The
    tensor keeps its mapping alive."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    address = whole.untyped_storage().data_ptr()
    _blocks[address] = whole.untyped_storage().nbytes()
    # forgotten with its mapping, so that memory later given out at the same address is not taken
    # for a block (the mapping lives as long as any tensor over it)
    weakref.finalize(mapping, _blocks.pop, address, None)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


def in_huge_page_block(t: torch.Tensor) -> bool:
    s = t.untyped_storage()
    return _blocks.get(s.data_ptr()) == s.nbytes()


def move_to_huge_pages(module: torch.nn.Module) -> int:
    """Copy the module's CPU parameters and buffers into one huge-page buffer, each storage once,
    and re-point every tensor to its copy; returns the bytes moved (0: nothing was done). Tensors
    already in such a buffer (a model a second engine serves) stay where they are."""
    if not huge_pages_available():
        return 0
    unique = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    tensors = [t for t in unique.values() if t.device.type == "cpu" and t.numel() > 0 and not in_huge_page_block(t)]
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
    total = sum(_aligned(s.nbytes()) for s in storages.values())
    if total < max(1, MIN_BYTES):
        return 0
    arena = huge_page_buffer(total)
    new_storage = arena.untyped_storage()
    base = arena.data_ptr() - new_storage.data_ptr()  # the arena's byte offset in its storage
    offsets, at = {}, 0
    with torch.no_grad():
        for ptr, old in storages.items():
            n = old.nbytes()
            arena[at : at + n].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            offsets[ptr] = base + at
            at += _aligned(n)
        for t in tensors:
            byte_offset = offsets[t.untyped_storage().data_ptr()] + t.storage_offset() * t.element_size()
            t.set_(new_storage, byte_offset // t.element_size(), t.size(), t.stride())
    return total
