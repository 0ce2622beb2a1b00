"""The native ops whose work is shared out by the thread count, on two threads, whatever count the
suite runs with (each pytest-xdist worker gets its share of the cores: tests/conftest.py):
attention's work items (a row's chunks split further for the threads), the products' and the
quantized tiles' per-thread activation packs, the packed bf16 products' blocks, the greedy
sampler's slices. The products compute each output on one thread, so one and two threads give the
same bits; attention and sampling against their references."""

import pytest
import torch
import torch.nn.functional as F

from graphrt import kernels
from graphrt.kernels import reference
from graphrt.kernels.packed_bf16 import to_packed
from graphrt.kernels.quant_tiles import to_tiles
from graphrt.kernels.quantized import quantize_int4, quantize_int8
from tests.kernels.paged_batch import make_batch
from tests.kernels.test_sampling import params


def on_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_attention_splits_rows_for_two_threads_and_merges_them_as_the_reference(dtype, tol):
    # 300, 75 and 40 keys: five chunks of at most 128, not a multiple of two threads, so the rows
    # of 64 keys or more split further (300 into six items, 75 into two). Of the eleven items each
    # thread takes five or six: the first token's six are on both threads (merged after the join),
    # the other four tokens' on the second alone (merged on that thread)
    b = make_batch([(300, 1), (75, 1), (40, 3)], 16, 9, 3, 64, dtype=dtype)
    args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.125)
    two = on_threads(2, lambda: kernels.paged_attention(*args))
    want = reference.paged_attention(
        b.q, None, None, b.k_cache, b.v_cache, None, b.block_tables, b.seq_lens, b.query_start_loc, 0.125
    )
    assert two.dtype == dtype
    torch.testing.assert_close(two.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 8])
def test_products_give_the_same_bits_on_one_and_two_threads(dtype, m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 576, generator=g).to(dtype)
    w = torch.randn(1031, 576, generator=g).to(dtype)  # 32 full AMX blocks and 7 rows past them
    one = on_threads(1, lambda: kernels.linear(x, w))
    two = on_threads(2, lambda: kernels.linear(x, w))
    assert torch.equal(one, two)
    torch.testing.assert_close(two.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("m", [1, 8, 11])
def test_packed_bf16_products_give_the_same_bits_on_one_and_two_threads(m):
    # 33 blocks of 32 columns: not a multiple of two threads; 11 rows: a pass of 8 and one of 3
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 576, generator=g).bfloat16(), torch.randn(1056, 576, generator=g).bfloat16()
    packed = to_packed(w)
    one = on_threads(1, lambda: kernels.linear_packed_bf16(x, packed))
    two = on_threads(2, lambda: kernels.linear_packed_bf16(x, packed))
    assert torch.equal(one, two)
    torch.testing.assert_close(two.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_quantized_tiles_give_the_same_bits_on_one_and_two_threads(bits, m):
    g = torch.Generator().manual_seed(bits + m)
    w = torch.randn(1040, 576, generator=g)
    q = quantize_int4(w) if bits == 4 else (*quantize_int8(w), None)
    tiles, x = to_tiles(*q), torch.randn(m, 576, generator=g)
    one = on_threads(1, lambda: kernels.linear_tiles(x, tiles))
    two = on_threads(2, lambda: kernels.linear_tiles(x, tiles))
    assert torch.equal(one, two)
    dense = kernels.dequantize_tiles(tiles, torch.float32)
    torch.testing.assert_close(two, F.linear(x, dense), atol=2e-2, rtol=2e-2)


def test_greedy_sampling_over_two_threads_is_argmax():
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(3))
    tokens, logprobs = on_threads(2, lambda: kernels.sample(logits, **params(4, temperature=0.0)))
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])
