"""The weights moved into one block of huge pages: the same values, the same sharing between
tensors, every tensor inside the block, and 2 MiB pages where the kernel grants them."""

import pytest
import torch

from graphrt.runner import huge_pages
from graphrt.runner.huge_pages import HUGE_PAGE, move_to_huge_pages


class Tied(torch.nn.Module):
    """Tied weights, two overlapping views of one storage, a non-float buffer: 4.6 MB in all."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(1024, 1024)
        self.b = torch.nn.Linear(1024, 1024, bias=False)
        self.b.weight = self.a.weight
        shared = torch.randn(1000, 64)
        self.register_buffer("v1", shared[10:20])
        self.register_buffer("v2", shared[15:40, 3:9])
        self.register_buffer("ids", torch.arange(10, dtype=torch.int8))


def smaps_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``address``."""
    inside, fields = False, {}
    for line in open("/proc/self/smaps"):
        head, _, rest = line.partition(" ")
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= address < hi
        elif inside:
            fields[head.rstrip(":")] = rest.strip()
    return fields


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding ``address``."""
    return int(smaps_of(address).get("AnonHugePages", "0 kB").split()[0])


def thp_fallbacks() -> int:
    """Page faults, in any process, where the kernel wanted a huge page and gave small ones."""
    for line in open("/proc/vmstat"):
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


@pytest.fixture
def thp_on(monkeypatch):
    """Copy as if the kernel granted huge pages (the copy does not depend on it)."""
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: True)


def test_values_and_sharing_survive_the_move(thp_on):
    m = Tied()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    storages = sum(v.untyped_storage().nbytes() for v in (m.a.weight, m.a.bias, m.v1, m.ids))  # v2 shares v1's
    moved = move_to_huge_pages(m)
    assert storages <= moved < storages + 64 * 4
    for name, value in m.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert m.b.weight is m.a.weight
    assert m.v1.untyped_storage().data_ptr() == m.v2.untyped_storage().data_ptr()
    m.v1[5, 5] = 42.0  # still views of one storage: v2[0, 2] is shared[15, 5]
    assert m.v2[0, 2].item() == 42.0
    start = m.a.weight.untyped_storage().data_ptr()
    ptrs = [t.data_ptr() for t in (m.a.weight, m.a.bias, m.v1, m.v2, m.ids)]
    lowest = min(ptrs)
    assert lowest % HUGE_PAGE == 0 and all(lowest <= p < lowest + moved for p in ptrs)
    assert start <= lowest
    x = torch.randn(2, 1024)
    assert torch.equal(m.a(x), torch.nn.functional.linear(x, before["a.weight"], before["a.bias"]))


def test_the_block_gets_huge_pages_where_the_kernel_grants_them():
    if not huge_pages.huge_pages_available():
        assert move_to_huge_pages(Tied()) == 0  # THP "never" (or switched off): nothing moves
        return
    m = Tied()
    fallbacks = thp_fallbacks()
    assert move_to_huge_pages(m) > HUGE_PAGE
    m.a.weight.data.add_(0)  # every page written once more: the mapping's huge pages are there
    mapping = smaps_of(m.a.weight.data_ptr())
    assert "hg" in mapping["VmFlags"].split() and mapping["THPeligible"] == "1"  # asked for, and eligible
    # the kernel grants them unless its memory is too fragmented at that moment (a loaded machine):
    # then it counts a fallback, and only the request above is graphrt's to check
    if thp_fallbacks() == fallbacks:
        assert anon_huge_kib(m.a.weight.data_ptr()) >= HUGE_PAGE // 1024


def test_thp_never_or_a_small_module_moves_nothing(monkeypatch, tmp_path):
    m = Tied()
    ptr = m.a.weight.data_ptr()
    assert move_to_huge_pages(torch.nn.Linear(8, 8)) == 0  # less than a huge page: left alone
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_MODE", str(mode))
    assert move_to_huge_pages(m) == 0 and m.a.weight.data_ptr() == ptr


def test_an_engine_moves_its_weights_at_start_up_unless_told_not_to(tiny_model, thp_on, monkeypatch):
    """On by default (``graphrt generate`` passes ``huge_pages=False``). The tiny model's weights
    are less than a huge page: moved all the same here."""
    from tests.helpers import make_llm

    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    for kwargs, moved in (({}, True), ({"huge_pages": False}, False)):
        engine = make_llm(tiny_model("llama_gqa"), **kwargs).engine
        storages = {p.untyped_storage().data_ptr() for p in engine.loaded.model.parameters()}
        if moved:
            assert len(storages) == 1  # one block holds them all
            assert min(p.data_ptr() for p in engine.loaded.model.parameters()) % HUGE_PAGE == 0
        else:
            assert len(storages) > 1


def test_a_kv_cache_takes_huge_pages_when_asked_and_large_enough():
    from graphrt.runner.kv_cache import _zeros

    fallbacks = thp_fallbacks()
    k = _zeros((512, 16, 8, 128), torch.float32, huge_pages=True)  # 32 MiB
    small = _zeros((4, 16, 2, 64), torch.float32, huge_pages=True)  # 32 KiB
    plain = _zeros((512, 16, 8, 128), torch.float32)
    for t in (k, small, plain):
        t.fill_(1.0)
    if huge_pages.huge_pages_available():
        assert "hg" in smaps_of(k.data_ptr())["VmFlags"].split()  # asked for
        if thp_fallbacks() == fallbacks:  # and granted, unless the kernel's memory was too fragmented
            assert anon_huge_kib(k.data_ptr()) >= 16 * HUGE_PAGE // 1024
    # a huge-page block is its own mapping, one huge page longer than asked (the alignment's slack)
    assert k.untyped_storage().nbytes() == k.numel() * 4 + HUGE_PAGE
    for t in (small, plain):  # a mapping of exactly the bytes, as without huge pages
        assert t.untyped_storage().nbytes() == t.numel() * 4
    assert float(k.sum()) == k.numel() and float(small.sum()) == small.numel()


def test_weights_already_in_a_block_are_not_moved_again(thp_on):
    """A second engine over the same in-memory model (the decode benchmark's eager one) keeps them."""
    m = Tied()
    assert move_to_huge_pages(m) > 0
    ptr = m.a.weight.data_ptr()
    assert move_to_huge_pages(m) == 0 and m.a.weight.data_ptr() == ptr


def test_a_freed_block_is_forgotten():
    import gc

    pages = huge_pages
    block = pages.huge_page_buffer(1 << 20).view(torch.float32)
    address = block.untyped_storage().data_ptr()
    assert pages.in_huge_page_block(block) and address in pages._blocks
    view = block[:16]
    del block
    gc.collect()
    assert address in pages._blocks  # a view keeps the mapping
    del view
    gc.collect()
    assert address not in pages._blocks
