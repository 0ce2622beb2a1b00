"""The KV caches' pages faulted in ahead of the block allocator, on a thread of their own.

The caches' pages arrive on first touch (``kv_cache._zeros``). The block pool hands out the blocks
it has never used in id order before any it has (``core/block_manager.py``), so a fresh engine's
steps keep reaching new pages until every block has been used once. Each layer's K and V is its
own tensor: when the blocks handed out cross a page boundary, all of them fault in the same step.
In 2 MiB pages that is the costly case. On the 2-vCPU VM this was measured on, a fresh huge page
took 5-57 ms to fault, so SmolLM2's 60 caches made one batch-8 decode step take 1.0-1.4 s
against 12 ms for the others, once every 170 blocks handed out.

``KVPageWarmer`` keeps the pages of the next ``ahead`` blocks faulted in, one huge page of every
cache at a time, from a thread that waits while it is far enough ahead. It asks the kernel
(``MADV_POPULATE_WRITE``, Linux 5.14) to fault the pages in as a write would, without touching a
byte, so it may run beside a step that writes the same cache. The faults cost the same CPU time
as before: they are spread over many steps instead of landing in one. ``whole`` faults in the
whole cache from the start instead (``CacheConfig.prefault``), in any page size. Where the kernel
lacks the advice, nothing is started and the pages fault on first use, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import threading
from collections.abc import Callable

import torch

from graphrt.runner.huge_pages import HUGE_PAGE

log = logging.getLogger(__name__)
MADV_POPULATE_WRITE = 23  # <linux/mman.h>; not in Python's mmap module before 3.13
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def populate_supported() -> bool:
    """Whether this kernel takes ``MADV_POPULATE_WRITE`` (asked of one page of the process's own)."""
    fn = _madvise()
    if fn is None:
        return False
    buf = torch.empty(2 * _PAGE, dtype=torch.uint8)
    page = -(-buf.data_ptr() // _PAGE) * _PAGE
    return fn(page, _PAGE, MADV_POPULATE_WRITE) == 0


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class KVPageWarmer:
    """Faults in the pages of ``caches`` (a list of (K, V) per layer, each ``[num_blocks, ...]``
    and contiguous) for the blocks below ``frontier() + ahead``. ``frontier`` returns the lowest
    block id the pool has never handed out; ``step_blocks`` is the most fresh blocks one step can
    take, and ``ahead`` adds two rounds (a huge page of every cache each) to it, so that a round
    is under way while the step before it runs. ``nudge`` after each scheduled step wakes the
    thread to look again. ``whole``: every block, in id order, without waiting for the frontier
    (a server that should reach its steady speed soon). The thread ends when every block is warmed
    or ``stop`` is called."""

    def __init__(
        self,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        frontier: Callable[[], int],
        step_blocks: int,
        whole: bool = False,
    ):
        tensors = [t for pair in caches for t in pair]
        if not tensors or any(not t.is_contiguous() for t in tensors):
            raise ValueError("KVPageWarmer needs at least one contiguous cache tensor")
        self.num_blocks = tensors[0].shape[0]
        self._frontier = frontier
        self.whole = whole
        # (first byte, bytes a block, last byte + 1) of every cache; the tensors keep their mappings alive
        self._regions = [(t.data_ptr(), t.stride(0) * t.element_size(), t.data_ptr() + t.nbytes) for t in tensors]
        self._keep = tensors
        per_block = max(r[1] for r in self._regions)
        self.blocks_per_round = max(1, HUGE_PAGE // per_block)  # a huge page of the cache with the largest blocks
        self.ahead = max(0, step_blocks) + 2 * self.blocks_per_round
        self.warmed = 0  # blocks below this have every page faulted in
        self.error: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._madvise = _madvise()
        self._thread = threading.Thread(target=self._run, name="graphrt-kv-page-warmer", daemon=True)

    def start(self) -> KVPageWarmer:
        if self._madvise is None:
            raise OSError("no madvise in this C library: check populate_supported() first")
        self._thread.start()
        return self

    def nudge(self) -> None:
        if self.warmed < self._target():  # after each step: most steps leave it far enough ahead
            self._wake.set()

    def _target(self) -> int:
        return self.num_blocks if self.whole else min(self.num_blocks, self._frontier() + self.ahead)

    def stop(self, wait: bool = True) -> None:
        """End the thread; ``wait``: until it has (its fault under way, at most tens of ms)."""
        self._stop.set()
        self._wake.set()
        if wait and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set() and self.warmed < self.num_blocks:
            if self.warmed >= self._target():
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            upto = min(self.num_blocks, self.warmed + self.blocks_per_round)
            for first, per_block, end in self._regions:
                lo, hi = first + self.warmed * per_block, first + upto * per_block
                if self._stop.is_set() or not self._populate(lo, hi, end):
                    return
            self.warmed = upto

    def _populate(self, lo: int, hi: int, end: int) -> bool:
        lo = lo // _PAGE * _PAGE
        hi = min(-(-hi // _PAGE) * _PAGE, -(-end // _PAGE) * _PAGE)
        if self._madvise(lo, hi - lo, MADV_POPULATE_WRITE) == 0:  # the GIL is released meanwhile
            return True
        self.error = os.strerror(ctypes.get_errno())
        log.warning("KV pages: stopped faulting them in ahead (%s); they fault on first use", self.error)
        return False
