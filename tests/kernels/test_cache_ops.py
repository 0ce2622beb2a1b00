import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrt import kernels
from graphrt.kernels import reference
from tests.kernels.paged_batch import make_batch

rows_st = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 40)).map(lambda t: (t[0], min(t[0], t[1]))), min_size=1, max_size=4
)


def naive_slots(positions, token_req, block_tables, block_size):
    out = []
    for p, r in zip(positions.tolist(), token_req.tolist()):
        out.append(-1 if r < 0 else block_tables[r][p // block_size].item() * block_size + p % block_size)
    return torch.tensor(out)


@settings(max_examples=30, deadline=None)
@given(rows=rows_st, block_size=st.sampled_from([1, 4, 16]), pad=st.integers(0, 3))
def test_slot_mapping_matches_naive_loop(rows, block_size, pad):
    b = make_batch(rows, block_size, 2, 1, 8, pad_tokens=pad)
    got = kernels.slot_mapping(b.positions, b.token_req, b.block_tables, block_size)
    assert torch.equal(got, naive_slots(b.positions, b.token_req, b.block_tables, block_size))
    assert torch.equal(got, reference.slot_mapping(b.positions, b.token_req, b.block_tables, block_size))
    assert torch.equal(got, b.slots)


@settings(max_examples=30, deadline=None)
@given(
    rows=rows_st,
    block_size=st.sampled_from([1, 4, 16]),
    pad=st.integers(0, 3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_reshape_and_cache_writes_exactly_the_slots(rows, block_size, pad, dtype):
    b = make_batch(rows, block_size, 2, 2, 8, dtype=dtype, pad_tokens=pad)
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    kernels.reshape_and_cache(b.k, b.v, k_cache, v_cache, b.slots)
    want_k, want_v = b.k_cache.clone(), b.v_cache.clone()
    for t, s in enumerate(b.slots.tolist()):  # naive loop
        if s >= 0:
            want_k[s // block_size, s % block_size] = b.k[t]
            want_v[s // block_size, s % block_size] = b.v[t]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    ref_k, ref_v = b.k_cache.clone(), b.v_cache.clone()
    reference.reshape_and_cache(b.k, b.v, ref_k, ref_v, b.slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_padding_rows_never_touch_the_cache():
    b = make_batch([(5, 5)], 4, 2, 2, 8, pad_tokens=0)
    before_k, before_v = b.k_cache.clone(), b.v_cache.clone()
    slots = torch.full((b.k.shape[0],), -1)
    kernels.reshape_and_cache(b.k, b.v, b.k_cache, b.v_cache, slots)
    assert torch.equal(b.k_cache, before_k) and torch.equal(b.v_cache, before_v)


def test_a_position_outside_its_block_table_is_refused():
    block_tables = torch.arange(8).view(2, 4)  # 4 blocks of 16: positions 0-63
    with pytest.raises((RuntimeError, IndexError), match="outside block_tables|out of bounds"):
        kernels.slot_mapping(torch.tensor([64]), torch.tensor([1]), block_tables, 16)
    # a padding token's position is never looked up
    assert kernels.slot_mapping(torch.tensor([0]), torch.tensor([-1]), block_tables, 16).tolist() == [-1]
