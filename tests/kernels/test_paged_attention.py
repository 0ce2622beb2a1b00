import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrt import kernels
from graphrt.kernels import KernelArgumentError, reference
from graphrt.kernels.attention import paged_attention_torch
from tests.kernels.paged_batch import make_batch

# (seq_len, query_len): query_len == seq_len is prefill, 1 is decode, between is a continuation.
row_st = st.tuples(st.integers(1, 48), st.integers(1, 48)).map(lambda t: (t[0], min(t[0], t[1])))
# a mixed batch of up to four rows, its block size and its padding tokens (the sweeps below)
BATCH = dict(
    rows=st.lists(row_st, min_size=1, max_size=4), block_size=st.sampled_from([1, 4, 16]), pad=st.integers(0, 2)
)
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # bf16: inputs rounded to 8 bits of mantissa


def naive_attention(b, scale):
    """Per request, per token, per head: softmax over the keys up to the token's position."""
    block_size = b.k_cache.shape[1]
    h, hkv = b.q.shape[1], b.k_cache.shape[2]
    out = torch.zeros(b.q.shape, dtype=torch.float64)
    for r, (seq_len, q_len) in enumerate(b.rows):
        start = b.query_start_loc[r].item()
        for i in range(q_len):
            pos = seq_len - q_len + i
            keys = torch.stack([b.k_cache[b.block_tables[r, j // block_size], j % block_size] for j in range(pos + 1)])
            vals = torch.stack([b.v_cache[b.block_tables[r, j // block_size], j % block_size] for j in range(pos + 1)])
            for head in range(h):
                kv = head // (h // hkv)
                s = keys[:, kv].double() @ b.q[start + i, head].double() * scale
                out[start + i, head] = torch.softmax(s, 0) @ vals[:, kv].double()
    return out


@settings(max_examples=25, deadline=None)
@given(
    heads=st.sampled_from([(4, 4), (4, 2), (6, 1), (8, 2)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    **BATCH,
)
def test_paged_attention_matches_naive_loop(rows, block_size, heads, dtype, pad):
    b = make_batch(rows, block_size, heads[0], heads[1], 16, dtype=dtype, pad_tokens=pad)
    scale = 16**-0.5
    got = kernels.paged_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, scale)
    want = naive_attention(b, scale)
    n = b.query_start_loc[-1].item()
    torch.testing.assert_close(got[:n].double(), want[:n], atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.all(got[n:] == 0), "padding rows must be zero"
    ref = reference.paged_attention(
        b.q, None, None, b.k_cache, b.v_cache, None, b.block_tables, b.seq_lens, b.query_start_loc, scale
    )
    torch.testing.assert_close(got.double(), ref.double(), atol=TOL[dtype], rtol=TOL[dtype])


def bf16_caches(b):
    """The batch with its caches rounded to bf16 and q, k, v kept fp32 (a bf16 KV cache under an
    fp32 model)."""
    b.k_cache, b.v_cache = b.k_cache.to(torch.bfloat16), b.v_cache.to(torch.bfloat16)
    return b


@settings(max_examples=20, deadline=None)
@given(heads=st.sampled_from([(4, 4), (4, 2), (6, 1), (9, 3)]), head_dim=st.sampled_from([16, 64]), **BATCH)
def test_a_bf16_cache_under_fp32_queries_is_exact_to_fp32(rows, block_size, heads, head_dim, pad):
    # the cache's values are exact in fp32, so only the float32 arithmetic's rounding remains: the
    # fp32 tolerance, not bf16's, and the fused write rounds k/v as torch's .to(bfloat16) does
    b = bf16_caches(make_batch(rows, block_size, heads[0], heads[1], head_dim, pad_tokens=pad))
    scale = head_dim**-0.5
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    got = kernels.paged_attention(
        b.q, kc, vc, b.block_tables, b.seq_lens, b.query_start_loc, scale, k=b.k, v=b.v, slot_mapping=b.slots
    )
    assert got.dtype == torch.float32
    reference.reshape_and_cache(b.k, b.v, b.k_cache, b.v_cache, b.slots)  # rounds through the assignment
    assert torch.equal(kc, b.k_cache) and torch.equal(vc, b.v_cache)
    want = naive_attention(b, scale)
    n = b.query_start_loc[-1].item()
    torch.testing.assert_close(got[:n].double(), want[:n], atol=1e-5, rtol=1e-5)
    assert torch.all(got[n:] == 0), "padding rows must be zero"
    portable = paged_attention_torch(
        b.q, None, None, b.k_cache, b.v_cache, None, b.block_tables, b.seq_lens, b.query_start_loc, scale
    )
    torch.testing.assert_close(got[:n], portable[:n], atol=1e-5, rtol=1e-5)


def test_a_cache_of_another_dtype_is_refused_by_name():
    b = make_batch([(4, 4)], 4, 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(KernelArgumentError, match="k_cache is torch.float32 under q of torch.bfloat16"):
        kernels.paged_attention(
            b.q, b.k_cache.float(), b.v_cache.float(), b.block_tables, b.seq_lens, b.query_start_loc, 1.0
        )
    with pytest.raises(KernelArgumentError, match="k_cache and v_cache must share a dtype"):
        kernels.paged_attention(b.q, b.k_cache, b.v_cache.float(), b.block_tables, b.seq_lens, b.query_start_loc, 1.0)
    f = make_batch([(4, 4)], 4, 4, 2, 8)
    with pytest.raises(KernelArgumentError, match="k and v must share a dtype"):
        kernels.reshape_and_cache(f.k, f.v.to(torch.bfloat16), f.k_cache, f.v_cache, f.slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, group", [(64, g) for g in range(1, 7)] + [(128, 1), (128, 2)])
def test_the_register_path_at_every_block_boundary(head_dim, group, dtype):
    # head_dim 64 and 128 with these groups take the fixed-shape kernel on AVX-512: scores are taken
    # 16 keys at a time, so key counts below, at and past a multiple of 16 each end a block differently
    rows = [(n, 1) for n in (1, 15, 16, 17, 31, 32, 33, 47)] + [(40, 3)]
    b = make_batch(rows, 16, 2 * group, 2, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    got = kernels.paged_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, scale)
    torch.testing.assert_close(got.double(), naive_attention(b, scale), atol=TOL[dtype], rtol=TOL[dtype])


@settings(max_examples=15, deadline=None)
@given(rows=st.lists(row_st, min_size=1, max_size=3), block_size=st.sampled_from([2, 8]), pad=st.integers(0, 2))
def test_fused_write_then_attend_equals_write_then_attend(rows, block_size, pad):
    b = make_batch(rows, block_size, 4, 2, 8, pad_tokens=pad)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    # k and v as a fused projection's output hands them: views whose tokens are a wider row apart
    t = b.k.shape[0]
    wide = torch.cat([b.k.reshape(t, -1), b.v.reshape(t, -1), torch.randn(t, 5)], dim=1)
    k_view, v_view = wide[:, :16].view(t, 2, 8), wide[:, 16:32].view(t, 2, 8)
    assert not k_view.is_contiguous() or t == 1
    fused = kernels.paged_attention(
        b.q, kc, vc, b.block_tables, b.seq_lens, b.query_start_loc, 0.3, k=k_view, v=v_view, slot_mapping=b.slots
    )
    kernels.reshape_and_cache(b.k, b.v, b.k_cache, b.v_cache, b.slots)
    split = kernels.paged_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.3)
    assert torch.equal(kc, b.k_cache) and torch.equal(vc, b.v_cache)
    torch.testing.assert_close(fused, split)


@pytest.mark.parametrize(
    "rows, block_size, heads, head_dim",
    [
        ([(37, 37), (20, 1), (50, 13), (9, 9)], 4, (8, 2), 16),
        # past one work item's keys (256 with SmolLM2's heads): a verify-like row (6 tokens at 300
        # keys), decode rows over two and three items, a prefill over one; each token's items merge
        # in key order whatever order they ran
        ([(300, 6), (260, 1), (600, 1), (140, 140)], 16, (9, 3), 64),
        # 8 KB of K/V a key: items of 128 keys (a chunk's K/V kept small enough for L2)
        ([(300, 3), (200, 1), (129, 129)], 16, (16, 8), 128),
    ],
)
def test_paged_equals_sdpa_over_contiguous_sequences(rows, block_size, heads, head_dim):
    h, hkv = heads
    b = make_batch(rows, block_size, h, hkv, head_dim)
    kernels.reshape_and_cache(b.k, b.v, b.k_cache, b.v_cache, b.slots)
    scale = head_dim**-0.5
    got = kernels.paged_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, scale)
    for r, (seq_len, q_len) in enumerate(rows):
        # the same sequence laid out contiguously: its K/V rows in position order
        slots = [b.block_tables[r, j // block_size].item() * block_size + j % block_size for j in range(seq_len)]
        keys = b.k_cache.reshape(-1, hkv, head_dim)[slots].transpose(0, 1)  # [Hkv, L, D]
        vals = b.v_cache.reshape(-1, hkv, head_dim)[slots].transpose(0, 1)
        start = b.query_start_loc[r].item()
        q = b.q[start : start + q_len].transpose(0, 1)
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)
        want = F.scaled_dot_product_attention(
            q, keys.repeat_interleave(h // hkv, 0), vals.repeat_interleave(h // hkv, 0), attn_mask=mask, scale=scale
        )
        torch.testing.assert_close(got[start : start + q_len], want.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_bad_arguments_name_the_argument():
    b = make_batch([(4, 4)], 4, 4, 2, 8)
    with pytest.raises(KernelArgumentError, match="q"):
        kernels.paged_attention(b.q[0], b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 1.0)
    with pytest.raises(KernelArgumentError, match="kv heads"):
        kernels.paged_attention(b.q[:, :3], b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 1.0)
    with pytest.raises(KernelArgumentError, match="seq_lens"):
        kernels.paged_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens.float(), b.query_start_loc, 1.0)
    with pytest.raises(KernelArgumentError, match="together"):
        kernels.paged_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 1.0, k=b.k)
