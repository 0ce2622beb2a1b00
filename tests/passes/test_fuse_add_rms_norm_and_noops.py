"""fuse_add_rms_norm and noop_elimination in four beats, with negative cases."""

import torch

from graphrt.kernels import canonical
from tests.passes.recording import RecordingBackend, count

OP = torch.ops.graphrt.fused_add_rms_norm.default


def add_norm(x, residual, weight):
    normed, new_residual = canonical.add_rms_norm(x, residual, weight, 1e-6)
    return normed * 2, new_residual * 3


def sub_norm(x, residual, weight):
    return canonical.rms_norm(x - residual, weight, 1e-6) * 2  # a subtraction: not a residual add


def test_add_then_norm_becomes_one_op():
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    rec = RecordingBackend()
    got = rec.compile(add_norm)(x, r, w)
    assert count(rec.before, torch.rsqrt) == 1 and count(rec.after, OP) == 1
    assert count(rec.after, torch.rsqrt) == 0
    for a, b in zip(got, add_norm(x, r, w)):
        torch.testing.assert_close(a, b)


def test_norm_of_a_difference_is_not_fused():
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    rec = RecordingBackend()
    got = rec.compile(sub_norm)(x, r, w)
    assert count(rec.after, OP) == 0 and rec.results["fuse_add_rms_norm"].matched == 0
    torch.testing.assert_close(got, sub_norm(x, r, w))


def casts(x):
    return (x.float() * 2).to(torch.float32).reshape(4, 8) + x.double().sum()


def test_noop_casts_are_removed_and_real_casts_kept():
    x = torch.randn(4, 8)
    rec = RecordingBackend()
    got = rec.compile(casts)(x)
    assert count(rec.before, "float") == 1 and count(rec.before, "to") == 1 and count(rec.before, "reshape") == 1
    assert count(rec.after, "float") == 0 and count(rec.after, "to") == 0 and count(rec.after, "reshape") == 0
    assert count(rec.after, "double") == 1  # float32 → float64 is a real cast
    torch.testing.assert_close(got, casts(x))
    rec_bf16 = RecordingBackend()
    xb = x.bfloat16()
    rec_bf16.compile(casts)(xb)
    assert count(rec_bf16.after, "float") == 1  # bf16 → float32 is a real cast
