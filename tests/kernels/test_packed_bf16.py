"""Packed bf16 weights (kernels/packed_bf16.py): the layout holds the row-major matrix's numbers
(round trip, one value found where the layout says, an embedding lookup's rows), and
``graphrt::linear_packed_bf16`` / ``graphrt::unpack_bf16`` against the fp32 product of the same
bf16 numbers over decode and prefill row counts; every argument error."""

import pytest
import torch

from graphrt import kernels
from graphrt.kernels import KernelArgumentError
from graphrt.kernels.packed_bf16 import (
    linear_packed_bf16,
    linear_packed_bf16_torch,
    packable,
    rows,
    to_packed,
    unpack_bf16,
    unpack_torch,
    wanted,
)


def bf16(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).bfloat16()


def test_the_packed_matrix_holds_the_row_major_numbers():
    w = bf16(96, 64)
    p = to_packed(w)
    assert p.shape == (3, 2, 32, 32) and p.dtype == torch.bfloat16 and p.is_contiguous()
    # w[32b + 16h + c, 32s + 2p + e] at [b, s, 16h + p, 2c + e]
    b, s, h, pp, c, e = 2, 1, 1, 7, 11, 1
    assert p[b, s, 16 * h + pp, 2 * c + e] == w[32 * b + 16 * h + c, 32 * s + 2 * pp + e]
    assert torch.equal(unpack_torch(p), w)
    assert torch.equal(unpack_bf16(p), w)  # the native body where it loaded
    assert sorted(p.flatten().tolist()) == sorted(w.flatten().tolist())


def test_rows_gathers_an_embedding_lookup():
    w = bf16(64, 96, seed=1)
    ids = torch.tensor([[0, 17, 63], [32, 31, 17]])
    assert torch.equal(rows(to_packed(w), ids), w[ids])
    assert rows(to_packed(w), torch.tensor([5])).shape == (1, 96)


def test_only_bf16_matrices_of_whole_blocks_pack():
    assert packable(bf16(32, 64)) and not packable(bf16(33, 64)) and not packable(bf16(32, 48))
    assert not packable(torch.randn(32, 64)) and not packable(bf16(2, 32, 64))
    with pytest.raises(KernelArgumentError, match=r"multiples of 32; got torch.bfloat16 of shape \(32, 577\)"):
        to_packed(bf16(32, 577))
    with pytest.raises(KernelArgumentError, match="got torch.float32"):
        to_packed(torch.randn(32, 32))


def reference(x, w, bias):
    y = x.float() @ w.float().T
    return y if bias is None else y + bias.float()


# decode rows (1-16), a tile's remainder (17, 33) and prefill rows (100); shapes of one block, of
# SmolLM2 (576, 1536) and blocks that a thread's share splits unevenly (96 x 1536)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 33, 100])
@pytest.mark.parametrize("n,k", [(32, 32), (64, 96), (576, 576), (96, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_packed_against_the_fp32_product(m, n, k, with_bias):
    w, x = bf16(n, k, seed=m), bf16(m, k, seed=n + k)
    bias = bf16(n, seed=3) if with_bias else None
    want = reference(x, w, bias)
    got = linear_packed_bf16(x, to_packed(w), bias)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # fp32 sums rounded once to bf16: within one bf16 rounding of the exact product (plus the
    # sums' own order, far smaller)
    tol = want.abs() * 2.0**-8 + 1e-3 * want.abs().max()
    assert ((got.float() - want).abs() <= tol).all(), (got.float() - want).abs().max()
    body = linear_packed_bf16_torch(x, to_packed(w), bias)
    assert ((body.float() - want).abs() <= tol).all()


def test_leading_dims_and_zero_rows():
    w = bf16(64, 64)
    x = bf16(2, 3, 64, seed=5)
    got = linear_packed_bf16(x, to_packed(w))
    assert got.shape == (2, 3, 64)
    torch.testing.assert_close(got, linear_packed_bf16(x.reshape(6, 64), to_packed(w)).reshape(2, 3, 64))
    assert linear_packed_bf16(bf16(0, 64), to_packed(w)).shape == (0, 64)


def test_a_nan_stays_in_its_row():
    w, x = bf16(64, 64), bf16(3, 64, seed=2)
    x[1, 5] = float("nan")
    got = linear_packed_bf16(x, to_packed(w))
    assert got[1].isnan().all() and not got[0].isnan().any() and not got[2].isnan().any()


def test_packing_is_wanted_where_the_library_multiplies_packed_blocks_and_can_be_forced(monkeypatch):
    monkeypatch.delenv("GRAPHRT_PACKED_BF16", raising=False)
    assert wanted(True) and not wanted(False)
    monkeypatch.setenv("GRAPHRT_PACKED_BF16", "0")
    assert not wanted(True)
    monkeypatch.setenv("GRAPHRT_PACKED_BF16", "1")
    assert wanted(False)



def test_argument_errors_name_the_argument():
    p = to_packed(bf16(64, 64))
    with pytest.raises(KernelArgumentError, match="x must be bfloat16 .*got torch.float32"):
        linear_packed_bf16(torch.randn(2, 64), p)
    with pytest.raises(KernelArgumentError, match="x.*64"):
        linear_packed_bf16(bf16(2, 32), p)
    with pytest.raises(KernelArgumentError, match="bias"):
        linear_packed_bf16(bf16(2, 64), p, bf16(32))
    with pytest.raises(KernelArgumentError, match="packed must be bfloat16.*got torch.float32"):
        linear_packed_bf16(bf16(2, 64), p.float())
    with pytest.raises(KernelArgumentError, match=r"packed must be \[N / 32, K / 32, 32, 32\], got shape \(64, 64\)"):
        linear_packed_bf16(bf16(2, 64), bf16(64, 64))
    with pytest.raises(KernelArgumentError, match="packed must be contiguous"):
        unpack_bf16(p.transpose(0, 1))
    with pytest.raises(KernelArgumentError, match="scalar"):
        linear_packed_bf16(torch.tensor(1.0).bfloat16(), p)


@pytest.mark.skipif(kernels.NATIVE_ISA is None, reason="the native library's own checks")
def test_the_native_ops_check_their_raw_pointers():
    p = to_packed(bf16(64, 64))
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        torch.ops.graphrt.linear_packed_bf16(torch.randn(2, 64), p, None)
    with pytest.raises(RuntimeError, match="packed must be contiguous bfloat16"):
        torch.ops.graphrt.unpack_bf16(p.float())
