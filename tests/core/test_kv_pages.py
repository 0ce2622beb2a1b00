import os

import torch

from graphrt.runner.kv_cache import _zeros, fault_in_pages, peak_growth


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_fault_in_pages_makes_every_page_resident_and_keeps_the_values():
    # Arrange: 2 x 32 MiB of cache whose pages the OS has not provided yet, a few values written
    shape = (512, 16, 8, 128)  # 32 MiB of fp32
    before = _resident_bytes()
    k, v = _zeros(shape, torch.float32), _zeros(shape, torch.bfloat16)
    allocated = _resident_bytes()
    k[3, 5] = 1.5
    v[-1, -1, -1, -1] = -2.0
    expected_k, expected_v = k.clone(), v.clone()
    size = k.numel() * k.element_size() + v.numel() * v.element_size()
    # Act
    after_clone = _resident_bytes()
    fault_in_pages([(k, v)])
    # Assert: the allocation itself took no pages; the call took (nearly) all of them
    assert allocated - before < size // 8
    assert _resident_bytes() - after_clone > 0.9 * size
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)


def test_a_cache_left_alone_stays_unfaulted():
    # the negative case: without the call, the untouched cache costs no resident memory
    before = _resident_bytes()
    k = _zeros((512, 16, 8, 128), torch.float32)
    assert _resident_bytes() - before < (k.numel() * 4) // 8
    assert float(k[100].abs().sum()) == 0.0  # a read maps the shared zero page, not new memory
    assert _resident_bytes() - before < (k.numel() * 4) // 8


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
