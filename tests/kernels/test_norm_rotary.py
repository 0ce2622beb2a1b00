import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrt import kernels
from graphrt.kernels import KernelArgumentError, reference

dtypes = st.sampled_from([torch.float32, torch.bfloat16])


@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 9), hidden=st.sampled_from([8, 64, 96]), dtype=dtypes)
def test_rms_norms_match_naive_loop(tokens, hidden, dtype):
    x = torch.randn(tokens, hidden).to(dtype)
    res = torch.randn(tokens, hidden).to(dtype)
    w = torch.randn(hidden).to(dtype)
    want = torch.empty(tokens, hidden, dtype=dtype)
    for t in range(tokens):  # naive: one row at a time, float statistics
        row = x[t].float()
        want[t] = w * (row / math.sqrt(float((row * row).mean()) + 1e-6)).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), want, atol=tol, rtol=tol)
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    y, new_res = kernels.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(new_res, x + res)
    assert torch.equal(y, reference.rms_norm(x + res, w, 1e-6))


def naive_rotary(x, pos, inv_freq, is_neox):
    out = x.clone().double()
    rot = inv_freq.shape[0] * 2
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            for i in range(rot // 2):
                a, b = (i, i + rot // 2) if is_neox else (2 * i, 2 * i + 1)
                ang = pos[t].item() * inv_freq[i].item()
                x1, x2 = x[t, h, a].item(), x[t, h, b].item()
                out[t, h, a] = x1 * math.cos(ang) - x2 * math.sin(ang)
                out[t, h, b] = x2 * math.cos(ang) + x1 * math.sin(ang)
    return out


@settings(max_examples=15, deadline=None)
@given(
    tokens=st.integers(1, 5),
    head_dim=st.sampled_from([8, 16]),
    partial=st.sampled_from([1.0, 0.5]),
    is_neox=st.booleans(),
    dtype=dtypes,
)
def test_rotary_matches_naive_loop(tokens, head_dim, partial, is_neox, dtype):
    rot = int(head_dim * partial)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).double() / rot))
    angles = torch.arange(64).double()[:, None] * inv_freq[None]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
    pos = torch.randint(0, 64, (tokens,))
    q, k = torch.randn(tokens, 4, head_dim).to(dtype), torch.randn(tokens, 2, head_dim).to(dtype)
    q2, k2 = kernels.rotary_embedding(pos, q, k, cache, is_neox)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q2.double(), naive_rotary(q, pos, inv_freq, is_neox), atol=tol, rtol=tol)
    torch.testing.assert_close(k2.double(), naive_rotary(k, pos, inv_freq, is_neox), atol=tol, rtol=tol)
    rq, rk = reference.rotary_embedding(pos, q, k, cache, is_neox)
    assert torch.equal(q2, rq) and torch.equal(k2, rk)


def test_bad_arguments_name_the_argument():
    with pytest.raises(KernelArgumentError, match="weight"):
        kernels.rms_norm(torch.randn(2, 8), torch.randn(4), 1e-6)
    with pytest.raises(KernelArgumentError, match="residual"):
        kernels.fused_add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-6)
    with pytest.raises(KernelArgumentError, match="rotary_dim"):
        kernels.rotary_embedding(
            torch.zeros(1, dtype=torch.long), torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.randn(8, 6)
        )
