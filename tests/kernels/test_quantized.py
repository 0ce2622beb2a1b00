"""The quantized ops against a reference built from the ``gguf`` package's own quantizer and
dequantizer: GGUF blocks (Q4_0, Q4_1, Q8_0) split into graphrt's layout, then
``graphrt::linear_quantized`` / ``graphrt::dequantize`` compared with gguf's float matrix times x.
Also the quantize-at-load packers (round trip within half a step), and every argument error."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from graphrt import kernels
from graphrt.kernels import KernelArgumentError
from graphrt.kernels.quantized import dequantize_torch, linear_quantized_torch, quantize_int4, quantize_int8
from graphrt.loader.quantization import from_gguf_blocks

KINDS = ("Q4_0", "Q4_1", "Q8_0")


def gguf_matrix(n: int, k: int, kind: str, seed: int):
    """(graphrt's quantized layout, gguf's own dequantised float64 matrix) of a random [n, k]."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = gguf_quantize(w, GGML[kind])
    q = from_gguf_blocks(blocks, kind, (n, k))
    return q, torch.from_numpy(gguf_dequantize(blocks, GGML[kind]).astype(np.float64))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp(min=1.0)).item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_quantized_matches_gguf_dequantised_matmul(kind, dtype):
    # N: odd, vector-width and block multiples; K: one block, odd block counts, SmolLM2's widths
    for n, k in [(1, 32), (7, 96), (33, 576), (64, 224), (577, 1536)]:
        q, w = gguf_matrix(n, k, kind, seed=n + k)
        for m in (1, 2, 3, 5, 8, 9, 16, 17, 64):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            bias = torch.randn(n).to(dtype) if m % 2 else None
            want = x.double() @ w.T + (0 if bias is None else bias.double())
            got = kernels.linear_quantized(x, q.qweight, q.scales, q.mins, bias)
            assert got.shape == (m, n) and got.dtype == dtype
            # fp32: the weights are exactly gguf's (one fused rounding apart), sums reordered;
            # bf16: one rounding of the output (2^-8) plus slack. Where the activations go into
            # an integer product as int8 digits: bounded per element below instead.
            if dtype == torch.float32 and carries_digits(kind, m):
                bound = digit_bound(x, w, integer_part(q, w)) + (0 if bias is None else bias.abs().double() * 2.0**-23)
                assert ((got.double() - want).abs() <= bound).all(), (kind, n, k, m)
                continue
            tol = 2e-5 if dtype == torch.float32 else 1e-2
            assert rel_err(got, want) <= tol, (kind, n, k, m, rel_err(got, want))


def block_max(x: torch.Tensor) -> torch.Tensor:
    """Each activation's block-of-32 largest magnitude, [m, k] (k a multiple of 32)."""
    blocks = x.double().abs().reshape(x.shape[0], -1, 32).amax(-1, keepdim=True)
    return blocks.expand(-1, -1, 32).reshape(x.shape)


def carries_digits(kind: str, m: int) -> bool:
    """Whether m activation rows times `kind` weights reach an integer product on this CPU, each
    block of 32 activations as two int8 digits: on AVX512-VNNI (vnni_quant_gemm.h) 1-16 rows, or
    1-5 where AMX tiles take 6-8 (int8 weights there on int8 tiles, amx_int8_gemm.h). Elsewhere the
    products are fp32."""
    isa = kernels.NATIVE_ISA
    if isa == "vnni":
        return m <= 16
    return isa == "amx" and (m <= 5 or (kind == "Q8_0" and 6 <= m <= 8))


def integer_part(q, w: torch.Tensor) -> torch.Tensor:
    """q * scale of each weight: the part the digits multiply (int4's mins meet exact fp32 sums)."""
    if q.mins is None:
        return w
    return w - q.mins.double().repeat_interleave(32, dim=1)


def digit_bound(x: torch.Tensor, w: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """What the outputs may differ from the exact product by where the activations are int8
    digits: each activation within 2^-15 of its block's largest (2^-15.9 on AMX tiles), times the
    weights' integer part qs, plus the fp32 sums' K * 2^-23 * sum |x| (|w| + |qs|)."""
    k = x.shape[-1]
    magnitude = x.double().abs() @ (w.abs() + qs.abs()).T
    return block_max(x) @ qs.abs().T * 2.0**-15 + magnitude * k * 2.0**-23


def one_digit(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The product with each block of activations as one int8 digit (llama.cpp's int8 activations)."""
    scale = block_max(x) / 127
    return torch.where(scale > 0, torch.round(x.double() / torch.where(scale > 0, scale, 1)) * scale, 0.0) @ w.T


@pytest.mark.parametrize("kind", ("Q4_0", "Q4_1"))
def test_six_to_eight_int4_rows_keep_sixteen_bits_of_each_activation(kind):
    # On AMX CPUs 6-8 rows of int4 run on bf16 tiles with each activation as two bf16 parts
    # (within 2^-17 of it); without VNNI the vector kernel's fp32. Either way every output is
    # within 2^-16 * sum|w x| (the parts) + K * 2^-23 * sum|w x| (fp32 sums) of the exact product,
    # and activations spanning 2^-20..2^20 keep their small members: one bf16 part alone (2^-9)
    # breaks the bound, as does a lost part or a misplaced block order. On VNNI CPUs without AMX
    # the rows are int8 digits, held to digit_bound, which one digit alone breaks.
    for n, k in [(35, 576), (577, 1536), (16, 96)]:
        q, w = gguf_matrix(n, k, kind, seed=n)
        for m in (6, 7, 8):
            x = spread_activations(m, k)
            got = kernels.linear_quantized(x, q.qweight, q.scales, q.mins, None).double()
            magnitude = x.double().abs() @ w.abs().T
            exact = x.double() @ w.T
            bound = magnitude * (2.0**-16 + k * 2.0**-23)
            if carries_digits(kind, m):  # VNNI without AMX: int8 digits, the bound of the test below
                bound = digit_bound(x, w, integer_part(q, w))
            assert ((got - exact).abs() <= bound).all(), (kind, n, k, m, ((got - exact).abs() / magnitude).max())
            # and the bound is tight enough to see a bf16 rounding of the activations (one digit
            # where the activations are digits)
            rounded = one_digit(x, w) if carries_digits(kind, m) else x.bfloat16().double() @ w.T
            assert ((rounded - exact).abs() > bound).any()


@pytest.mark.parametrize("kind", KINDS)
def test_up_to_sixteen_rows_keep_fifteen_bits_of_each_blocks_largest_activation(kind):
    # On AVX512-VNNI CPUs 1-16 rows of quantized weights (1-5 where AMX tiles take 6-8) run on the
    # integer dot product with each block of 32 activations as two int8 digits (within 2^-15 of
    # the block's largest); AMX tiles and the vector kernel keep at least as much. Either way every
    # output is within digit_bound of the exact product, over activations spanning 2^-20..2^20, an
    # all-zero block and one below 2^-100, with block counts that fill a group of blocks and ones
    # that leave it ragged, and row counts that fill a register tile of 8 rows, leave it short and
    # take a second one. One digit alone breaks the bound, as does a lost digit, a misplaced
    # nibble, a block's wrong scale or a second tile's rows written over the first's.
    for n, k in [(35, 576), (577, 1536), (16, 96), (9, 160)]:
        q, w = gguf_matrix(n, k, kind, seed=n)
        for m in (1, 2, 3, 4, 5, 6, 8, 9, 16):
            x = spread_activations(m, k)
            x[0, :32] = 0.0  # an all-zero block
            x[-1, 32:64] = torch.randn(32) * 2.0**-115  # below 2^-100: an absolute error under 2^-116
            got = kernels.linear_quantized(x, q.qweight, q.scales, q.mins, None).double()
            exact = x.double() @ w.T
            bound = digit_bound(x, w, integer_part(q, w))
            assert ((got - exact).abs() <= bound).all(), (kind, n, k, m, ((got - exact).abs() - bound).max())
            assert ((one_digit(x, w) - exact).abs() > bound).any()


def test_six_to_eight_int8_rows_keep_sixteen_bits_of_each_blocks_largest_activation():
    # On AMX CPUs 6-8 rows of int8 run on int8 tiles with each block of 32 activations as two
    # int8 slices (within 2^-15.9 of the block's largest); elsewhere the vector kernel's fp32.
    # Either way every output is within digit_bound of the exact product, over activations
    # spanning 2^-20..2^20 and blocks of tiny, zero and mixed-sign values. One slice alone (int8
    # activations, as llama.cpp's) breaks the bound, as does a lost slice or a misplaced quad.
    for n, k in [(35, 576), (577, 1536), (16, 96)]:
        q, w = gguf_matrix(n, k, "Q8_0", seed=n)
        for m in (6, 7, 8):
            x = spread_activations(m, k)
            x[0, :32] = 0.0  # an all-zero block
            x[1, 32:64] *= 2.0**-130  # a block below the normal range's slices
            got = kernels.linear_quantized(x, q.qweight, q.scales, q.mins, None).double()
            exact = x.double() @ w.T
            bound = digit_bound(x, w, w)
            assert ((got - exact).abs() <= bound).all(), (n, k, m, ((got - exact).abs() - bound).max())
            assert ((one_digit(x, w) - exact).abs() > bound).any()


@pytest.mark.parametrize("kind", ("Q4_1", "Q8_0"))
@pytest.mark.parametrize("m", [1, 3, 8])
def test_rows_carry_non_finite_activations_to_their_own_row(kind, m):
    # A NaN or an infinity in one activation row makes that row's outputs NaN (fp32 would give NaN
    # or an infinity); the other rows are untouched.
    q, w = gguf_matrix(48, 96, kind, seed=3)
    bad_row = m // 2
    for bad in (float("nan"), float("inf")):
        x = torch.randn(m, 96, generator=torch.Generator().manual_seed(2))
        x[bad_row, 40] = bad
        got = kernels.linear_quantized(x, q.qweight, q.scales, q.mins, None).double()
        assert not torch.isfinite(got[bad_row]).any()
        rows = [r for r in range(m) if r != bad_row]
        if rows:
            bound = digit_bound(x[rows], w, integer_part(q, w))
            assert ((got[rows] - x[rows].double() @ w.T).abs() <= bound).all()


def spread_activations(m: int, k: int) -> torch.Tensor:
    """[m, k] normals times powers of two in 2^-20..2^20: small members beside large ones."""
    g = torch.Generator().manual_seed(m + k)
    return torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-20, 21, (m, k), generator=g).float())


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_equals_gguf_and_the_torch_body(kind):
    q, w = gguf_matrix(65, 320, kind, seed=1)
    got = kernels.dequantize(q.qweight, q.scales, q.mins, torch.float32)
    torch.testing.assert_close(got.double(), w, atol=1e-6, rtol=1e-6)
    assert torch.equal(dequantize_torch(q.qweight, q.scales, q.mins, torch.float32).double(), w)
    rows = torch.tensor([3, 0, 64, 3])  # an embedding lookup: only the gathered rows
    mins = None if q.mins is None else q.mins[rows]
    picked = kernels.dequantize(q.qweight[rows], q.scales[rows], mins, torch.bfloat16)
    assert picked.dtype == torch.bfloat16
    torch.testing.assert_close(picked.double(), w[rows].bfloat16().double())


def test_the_native_op_and_the_portable_body_agree_on_3d_inputs():
    g = torch.Generator().manual_seed(0)
    q = quantize_int4(torch.randn(40, 64, generator=g))
    x = torch.randn(2, 3, 64, generator=g)
    got = kernels.linear_quantized(x, *q)
    assert got.shape == (2, 3, 40)
    # six rows: on AMX CPUs the tiles, whose activations keep 16 bits (the bound of the test above),
    # on other VNNI CPUs int8 digits
    w = dequantize_torch(*q, torch.float64)
    x2 = x.reshape(6, 64)
    bound = (x2.double().abs() @ w.abs().T) * (2.0**-16 + 64 * 2.0**-23)
    if carries_digits("Q4_1", 6):
        bound = digit_bound(x2, w, w - q[2].double().repeat_interleave(32, dim=1))
    want = linear_quantized_torch(x, *q, None).double().reshape(6, 40)
    assert ((got.double().reshape(6, 40) - want).abs() <= bound).all()


def test_quantize_at_load_round_trips_within_half_a_step():
    w = torch.randn(48, 128) * torch.linspace(0.01, 3, 48)[:, None]
    w[5] = 0  # an all-zero block has scale 0: values stay 0, no division by zero
    q8, s8 = quantize_int8(w)
    back8 = dequantize_torch(q8, s8, None, torch.float32)
    step8 = s8.float().repeat_interleave(32, dim=1)
    assert ((back8 - w).abs() <= step8 / 2 + 1e-3 * w.abs()).all()
    q4, s4, m4 = quantize_int4(w)
    back4 = dequantize_torch(q4, s4, m4, torch.float32)
    step4 = s4.float().repeat_interleave(32, dim=1)
    # float16 scales and mins add a rounding of their own to the half step
    assert ((back4 - w).abs() <= step4 / 2 + 2e-3 * w.abs().amax(dim=1, keepdim=True)).all()
    assert torch.equal(back4[5], torch.zeros(128)) and torch.equal(back8[5], torch.zeros(128))


def test_bad_arguments_are_named():
    q, s, m = quantize_int4(torch.randn(8, 64))
    x = torch.randn(2, 64)
    with pytest.raises(KernelArgumentError, match="qweight must be uint8 .* or int8"):
        kernels.linear_quantized(x, q.to(torch.int32), s, m)
    with pytest.raises(KernelArgumentError, match="scales must be float16, got torch.float32"):
        kernels.linear_quantized(x, q, s.float(), m)
    with pytest.raises(KernelArgumentError, match=r"scales must have shape \(8, 2\)"):
        kernels.linear_quantized(x, q, s[:, :1].contiguous(), m)
    with pytest.raises(KernelArgumentError, match="mins is required for int4"):
        kernels.linear_quantized(x, q, s, None)
    with pytest.raises(KernelArgumentError, match="mins must be None for int8"):
        kernels.linear_quantized(x, *quantize_int8(torch.randn(8, 64)), m)
    with pytest.raises(KernelArgumentError, match="x has size 32 in dim 1, expected 64"):
        kernels.linear_quantized(torch.randn(2, 32), q, s, m)
    with pytest.raises(KernelArgumentError, match="x must be float32 or bfloat16"):
        kernels.linear_quantized(x.half(), q, s, m)
    with pytest.raises(KernelArgumentError, match="qweight must be contiguous"):
        wide = torch.zeros(8, 64, dtype=torch.uint8)
        kernels.linear_quantized(x, wide[:, :32], s, m)
    with pytest.raises(KernelArgumentError, match="not a whole number of 32-value blocks"):
        kernels.dequantize(torch.zeros(4, 40, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.float16))
    with pytest.raises(KernelArgumentError, match=r"bias has size 3 in dim 0, expected 8"):
        kernels.linear_quantized(x, q, s, m, torch.randn(3))
    with pytest.raises(KernelArgumentError, match="not a multiple of the 32-value block"):
        quantize_int4(torch.randn(4, 48))
