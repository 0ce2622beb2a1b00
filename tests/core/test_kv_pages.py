import os
import struct

import numpy as np
import torch

from graphrt.runner.kv_cache import _zeros, fault_in_pages, peak_growth

FRESH = (512, 16, 8, 128)  # 32 MiB of fp32


def _owned_fraction(t: torch.Tensor) -> float:
    """The share of the tensor's pages the process owns, from ``/proc/self/pagemap`` (bit 56,
    "exclusively mapped"): pages written. A page only read maps the shared zero page, present
    but not owned. The tensor's own pages, whatever the rest of the process allocates or frees."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, end = t.data_ptr() // page, -(-(t.data_ptr() + t.numel() * t.element_size()) // page)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = struct.unpack(f"{end - first}Q", f.read((end - first) * 8))
    return sum(e >> 56 & 1 for e in entries) / len(entries)


def test_fault_in_pages_makes_every_page_resident_and_keeps_the_values():
    # Arrange: 2 x 32 MiB of cache whose pages the OS has not provided yet, a few values written
    k, v = _zeros(FRESH, torch.float32), _zeros((2 * FRESH[0], *FRESH[1:]), torch.bfloat16)
    allocated = _owned_fraction(k), _owned_fraction(v)
    k[3, 5] = 1.5
    v[-1, -1, -1, -1] = -2.0
    expected_k, expected_v = k.clone(), v.clone()
    # Act
    fault_in_pages([(k, v)])
    # Assert: the allocation itself took (almost) no pages, the clones' reads none; the call took every one
    assert max(allocated) < 1 / 8
    assert _owned_fraction(k) == 1.0 and _owned_fraction(v) == 1.0
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)


def test_a_cache_left_alone_stays_unfaulted():
    # the negative case: without the call, the untouched cache costs no pages, and a read none either
    k = _zeros(FRESH, torch.float32)
    assert _owned_fraction(k) < 1 / 8
    assert float(k[100].abs().sum()) == 0.0  # a read maps the shared zero page, not new memory
    assert _owned_fraction(k) < 1 / 8


def test_a_cache_never_reuses_memory_the_process_freed():
    # Arrange: a long-running process has written and freed 16 MiB (calloc would hand those
    # resident pages back, written through with zeros: numpy's zeros did)
    n = 16 * 2**20 // 4
    for _ in range(2):
        written = np.ones(n, dtype=np.int32)
        del written
    # Act
    k = _zeros((n,), torch.float32)
    # Assert
    assert _owned_fraction(k) < 1 / 8 and float(k.abs().sum()) == 0.0


def test_peak_growth_measures_a_step_below_an_earlier_higher_peak():
    # Arrange: the process peaks first (as converting a checkpoint at load does), then frees it
    earlier = torch.ones(96 * 2**20 // 4)  # 96 MiB, every page touched
    del earlier
    size = 48 * 2**20

    def step():
        t = torch.empty(size // 4)
        t.fill_(1.0)  # touch every page
        return float(t[-1])

    # Act
    value, growth = peak_growth(step)
    # Assert: the step's own 48 MiB, though the process had been 96 MiB higher before
    assert value == 1.0
    assert 0.9 * size < growth < 1.5 * size
