"""graphrt::linear (the skinny GEMM) against aten, over the shapes decode meets and the ones that
are not multiples of any vector width; and its argument errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrt import kernels
from graphrt.kernels import KernelArgumentError
from graphrt.kernels.linear import linear_torch

SIZES = [1, 7, 16, 33, 64, 577]


def reference(x, w, b):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def assert_close(got, want, dtype):
    # fp32: 1e-5 relative to the output's scale; bf16: one rounding of the output (2^-8) plus slack
    scale = want.abs().max().clamp(min=1.0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = (got.double() - want).abs().max() / scale
    assert err <= tol, f"relative error {err:.2e} > {tol}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", list(range(1, 17)) + [31])
def test_every_row_count_matches_aten(m, bias, dtype):
    g = torch.Generator().manual_seed(m)
    # (37, 1541): six or more rows' activations past 48 KiB, which AMD's fp32 tiles walk a chunk
    # of K at a time, with a K tail and a partial row block
    for n, k in [(577, 33), (7, 577), (64, 64), (1, 1), (33, 7), (37, 1541)]:
        x = torch.randn(m, k, generator=g).to(dtype)
        w = torch.randn(n, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if bias else None
        got = kernels.linear(x, w, b)
        assert got.shape == (m, n) and got.dtype == dtype
        assert_close(got, reference(x, w, b), dtype)


@settings(max_examples=40, deadline=None)
@given(
    lead=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    n=st.sampled_from(SIZES),
    k=st.sampled_from(SIZES),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    w_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    bias=st.booleans(),
)
def test_sweep_against_aten_and_the_torch_body(lead, n, k, dtype, w_dtype, bias):
    x = torch.randn(*lead, k).to(dtype)
    w = torch.randn(n, k).to(w_dtype)
    b = torch.randn(n).to(dtype) if bias else None
    got = kernels.linear(x, w, b)
    assert got.shape == (*lead, n) and got.dtype == dtype
    want = reference(x.reshape(-1, k), w, b).reshape(*lead, n)
    assert_close(got, want, dtype)
    assert_close(linear_torch(x, w, b), want, dtype)


def test_the_weight_is_read_in_place_and_left_unchanged():
    w = torch.randn(40, 24)
    before = w.clone()
    kernels.linear(torch.randn(3, 24), w)
    assert torch.equal(w, before)


def test_bad_arguments_name_the_argument():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(KernelArgumentError, match="x has size 9"):
        kernels.linear(torch.randn(2, 9), w)
    with pytest.raises(KernelArgumentError, match="weight must be float32 or bfloat16, got torch.float16"):
        kernels.linear(x, w.half())
    with pytest.raises(KernelArgumentError, match="x must be float32 or bfloat16, got torch.float64"):
        kernels.linear(x.double(), w)
    with pytest.raises(KernelArgumentError, match="x must be a floating-point tensor, got torch.int64"):
        kernels.linear(x.long(), w)
    with pytest.raises(KernelArgumentError, match="weight must be contiguous"):
        kernels.linear(x, torch.randn(8, 4).T)
    with pytest.raises(KernelArgumentError, match="weight must be .*2-D"):
        kernels.linear(x, torch.randn(32))
    with pytest.raises(KernelArgumentError, match="bias has size 3"):
        kernels.linear(x, w, torch.randn(3))
