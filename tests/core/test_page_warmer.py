"""The KV caches' pages faulted in ahead of the block pool's frontier, on a thread, without
changing a value (``graphrt/runner/page_warmer.py``)."""

import time

import pytest
import torch

from graphrt.runner import page_warmer
from graphrt.runner.huge_pages import HUGE_PAGE
from graphrt.runner.kv_cache import _zeros
from graphrt.runner.page_warmer import KVPageWarmer, populate_supported
from tests.core.test_kv_pages import _owned_fraction

BLOCKS = 1024
SHAPE = (BLOCKS, 16, 2, 64)  # fp32: 8 KiB a block, 8 MiB a cache; a round is 256 blocks

needs_populate = pytest.mark.skipif(not populate_supported(), reason="the kernel lacks MADV_POPULATE_WRITE")


class Frontier:
    def __init__(self) -> None:
        self.block = 1

    def __call__(self) -> int:
        return self.block


def _caches(layers: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(_zeros(SHAPE, torch.float32), _zeros(SHAPE, torch.float32)) for _ in range(layers)]


def _settle(warmer: KVPageWarmer, timeout: float = 30.0) -> int:
    """The warmer's frontier once it has reached its target (or ended) and stays there. A round
    faults one huge page of every cache, 5-57 ms each on a VM, so a pause between rounds is no
    sign of rest: the first version (still for 50 ms) failed once on a loaded machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not warmer.running or warmer.warmed >= warmer._target():
            last = warmer.warmed
            time.sleep(0.2)  # a round past the target would start here
            if warmer.warmed == last:
                return last
        time.sleep(0.02)
    raise AssertionError(f"the warmer kept moving: {warmer.warmed} blocks")


@needs_populate
def test_the_blocks_ahead_of_the_frontier_are_faulted_in_and_no_more():
    # Arrange: three layers of fresh caches, a value written into a block the warmer will reach
    caches = _caches()
    caches[1][1][5, 3] = 2.5
    expected = caches[1][1].clone()
    frontier = Frontier()
    # Act
    warmer = KVPageWarmer(caches, frontier, step_blocks=10).start()
    warmed = _settle(warmer)
    # Assert: whole rounds up to frontier + ahead (1 + 10 + 2 rounds of 256), then it waits
    assert warmer.ahead == 10 + 2 * 256 and warmed == 768 and warmer.running
    cut = warmed * SHAPE[1] * SHAPE[2] * SHAPE[3]
    for k, v in caches:
        for cache in (k, v):
            flat = cache.view(-1)
            assert _owned_fraction(flat[:cut]) == 1.0
            assert _owned_fraction(flat[cut:]) < 1 / 8  # the rest still costs no memory
    assert torch.equal(caches[1][1], expected) and float(caches[0][0].abs().sum()) == 0.0
    warmer.stop()


@needs_populate
def test_a_nudge_after_the_frontier_moves_warms_on_to_the_end_and_the_thread_ends():
    # Arrange
    caches = _caches(1)
    frontier = Frontier()
    warmer = KVPageWarmer(caches, frontier, step_blocks=0).start()
    assert _settle(warmer) == 768  # 1 + 512, in whole rounds
    # Act: the pool hands out blocks up to 700
    frontier.block = 700
    warmer.nudge()
    warmer._thread.join(30)
    # Assert: 700 + 512 is past the last block: all of them, and the thread is gone
    assert warmer.warmed == BLOCKS and not warmer.running
    assert _owned_fraction(caches[0][0]) == 1.0 and _owned_fraction(caches[0][1]) == 1.0


@needs_populate
def test_whole_warms_every_block_without_waiting_for_the_frontier():
    # Arrange: the pool has handed out nothing
    caches = _caches(1)
    # Act
    warmer = KVPageWarmer(caches, Frontier(), step_blocks=0, whole=True).start()
    warmer._thread.join(30)
    # Assert
    assert warmer.warmed == BLOCKS and not warmer.running
    assert _owned_fraction(caches[0][0]) == 1.0 and _owned_fraction(caches[0][1]) == 1.0


@needs_populate
def test_stop_ends_a_waiting_thread():
    warmer = KVPageWarmer(_caches(1), Frontier(), step_blocks=0).start()
    _settle(warmer)
    warmer.stop()
    assert not warmer.running and warmer.warmed < BLOCKS


def test_caches_that_are_not_contiguous_are_refused():
    k = torch.zeros(8, 16, 2, 64).transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        KVPageWarmer([(k, k)], Frontier(), step_blocks=0)


@needs_populate
def test_an_engine_warms_caches_in_huge_pages_only(tiny_model, monkeypatch):
    """The tiny model's caches are small: made huge-page caches here by lowering the threshold
    (whether the kernel then grants huge pages does not matter to the warmer)."""
    from graphrt.runner import huge_pages
    from tests.helpers import make_llm

    # Arrange
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: True)
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    model = tiny_model("llama_gqa")
    # Act
    llm = make_llm(model, kv_cache_memory=64 * 2**20)
    llm.generate([[5, 6, 7, 8, 9, 10]], {"max_tokens": 40, "temperature": 0}, use_tqdm=False)
    warmer, pool = llm.engine.page_warmer, llm.engine.blocks.pool
    # Assert: the blocks handed out and the ones ahead of them are warmed (or all of them)
    assert warmer is not None and warmer.error is None and not warmer.whole
    _settle(warmer)
    assert warmer.warmed >= min(pool.num_blocks, pool.fresh + warmer.ahead)
    assert llm.engine.stats()["warmed_blocks"] == warmer.warmed
    plain = make_llm(model, kv_cache_memory=64 * 2**20, huge_pages=False).engine
    assert plain.page_warmer is None and "warmed_blocks" not in plain.stats()


@needs_populate
def test_an_engine_asked_to_prefault_warms_its_whole_cache_even_in_small_pages(tiny_model):
    from tests.helpers import make_llm

    # Act
    settings = dict(kv_cache_memory=8 * 2**20, huge_pages=False, prefault_kv_cache=True)
    engine = make_llm(tiny_model("llama_gqa"), **settings).engine
    engine.page_warmer._thread.join(30)
    # Assert: every block (the null block too), whatever the pool has handed out
    assert engine.page_warmer.whole and engine.stats()["warmed_blocks"] == engine.blocks.pool.num_blocks
    for cache in engine.kv_caches[0]:
        assert _owned_fraction(cache) == 1.0


def test_no_warmer_where_the_kernel_lacks_the_advice(tiny_model, monkeypatch):
    from graphrt.runner import huge_pages
    from tests.helpers import make_llm

    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: True)
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    monkeypatch.setattr(page_warmer, "MADV_POPULATE_WRITE", -1)  # an advice no kernel takes
    assert not populate_supported()
    llm = make_llm(tiny_model("llama_gqa"), kv_cache_memory=64 * 2**20)
    assert llm.engine.page_warmer is None
    assert len(llm.generate([[5, 6, 7]], {"max_tokens": 4, "temperature": 0}, use_tqdm=False)[0].token_ids) == 4


def test_a_round_is_one_huge_page_of_the_cache_with_the_largest_blocks():
    k, v = _zeros((64, 16, 2, 64), torch.float32), _zeros((64, 16, 2, 128), torch.float32)
    warmer = KVPageWarmer([(k, v)], Frontier(), step_blocks=3)
    assert warmer.blocks_per_round == HUGE_PAGE // (16 * 2 * 128 * 4)
    assert warmer.ahead == 3 + 2 * warmer.blocks_per_round and not warmer.running
