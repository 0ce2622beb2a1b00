"""Quantized tiles (kernels/quant_tiles.py, int4 and int8): the layout holds the plain one's
numbers regrouped (round trip, one value, scale and minimum found where the layout says, an
embedding lookup's rows), and ``graphrt::linear_tiles`` / ``graphrt::dequantize_tiles`` against
gguf's own dequantised matrix times x, under the same bounds as the plain layout's kernels
(tests/kernels/test_quantized.py); every argument error."""

import pytest
import torch

from graphrt import kernels
from graphrt.kernels import KernelArgumentError
from graphrt.kernels.quant_tiles import (
    dequantize_tiles_torch,
    from_tiles,
    linear_tiles_torch,
    rows,
    tileable,
    to_tiles,
    wanted,
)
from graphrt.kernels.quantized import dequantize_torch, quantize_int4, quantize_int8
from tests.kernels.test_quantized import (
    KINDS,
    digit_bound,
    gguf_matrix,
    integer_part,
    one_digit,
    rel_err,
    spread_activations,
)


def tiles_of(q) -> torch.Tensor:
    return to_tiles(q.qweight, q.scales, q.mins)


def carries_digits(m: int) -> bool:
    """Whether m activation rows reach the tiles' integer product (1-16 rows on AVX512-VNNI, with
    or without AMX); more rows, or a CPU without VNNI, take fp32 products."""
    return kernels.NATIVE_ISA in ("vnni", "amx") and m <= 16


def test_tiles_are_the_plain_layouts_numbers_regrouped():
    q, s, m = quantize_int4(torch.randn(48, 96))
    tiles = to_tiles(q, s, m)
    assert tiles.shape == (3, 3, 320) and tiles.dtype == torch.uint8
    back = from_tiles(tiles)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, s, m)))
    # row 16g + r, block b: stored byte 4c + j at 64c + 4r + j; scale at 256 + 2r; min at 288 + 2r
    g, b, c, r, j = 2, 1, 3, 5, 2
    assert tiles[g, b, 64 * c + 4 * r + j] == q[16 * g + r, 16 * b + 4 * c + j]
    assert tiles[g, b, 256:288].view(torch.float16)[r] == s[16 * g + r, b]
    assert tiles[g, b, 288:320].view(torch.float16)[r] == m[16 * g + r, b]
    # int8: value 4c + j as q + 128 at 64c + 4r + j (c in 0..7); scale at 512 + 2r
    q8, s8 = quantize_int8(torch.randn(32, 64))
    q8[21, 32 + 4 * 6 + 3] = -128  # the format's whole range survives the offset
    tiles8 = to_tiles(q8, s8, None)
    assert tiles8.shape == (2, 2, 544)
    assert tiles8[1, 1, 64 * 6 + 4 * 5 + 3] == 0 and tiles8[0, 0, 4 * 5] == int(q8[5, 0]) + 128
    assert tiles8[1, 0, 512:544].view(torch.float16)[3] == s8[19, 0]
    back8 = from_tiles(tiles8)
    assert torch.equal(back8[0], q8) and torch.equal(back8[1], s8) and back8[2] is None
    assert tileable(q) and not tileable(q[:40]) and tileable(q8) and not tileable(torch.zeros(16, 8, dtype=torch.int32))


@pytest.mark.parametrize("kind", KINDS)
def test_an_embedding_lookup_gathers_its_rows_back(kind):
    q, _ = gguf_matrix(80, 64, kind, seed=5)
    tiles = tiles_of(q)
    ids = torch.tensor([[3, 79, 16], [0, 15, 3]])  # any shape, repeats, the edges of a group
    got = rows(tiles, ids)
    assert torch.equal(got[0], q.qweight[ids]) and torch.equal(got[1], q.scales[ids])
    assert (got[2] is None) == (q.mins is None) and (q.mins is None or torch.equal(got[2], q.mins[ids]))


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_tiles_equals_gguf_and_the_torch_body(kind):
    q, w = gguf_matrix(48, 320, kind, seed=4)
    tiles = tiles_of(q)
    assert torch.equal(kernels.dequantize_tiles(tiles).double(), w)
    assert torch.equal(dequantize_tiles_torch(tiles, torch.float32).double(), w)
    got = kernels.dequantize_tiles(tiles, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, w.float().bfloat16())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_tiles_matches_gguf_dequantised_matmul(kind, dtype):
    # N: one group, three, SmolLM2's; K: one block, odd block counts, SmolLM2's widths. Rows: the
    # register tile of 4 full, short, repeated; 16 (the digits' last); beyond (fp32 products).
    for n, k in [(16, 32), (48, 96), (576, 576), (64, 1536)]:
        q, w = gguf_matrix(n, k, kind, seed=n + k)
        tiles = tiles_of(q)
        for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            bias = torch.randn(n).to(dtype) if m % 2 else None
            want = x.double() @ w.T + (0 if bias is None else bias.double())
            got = kernels.linear_tiles(x, tiles, bias)
            assert got.shape == (m, n) and got.dtype == dtype
            if dtype == torch.float32 and carries_digits(m):
                bound = digit_bound(x, w, integer_part(q, w)) + (0 if bias is None else bias.abs().double() * 2.0**-23)
                assert ((got.double() - want).abs() <= bound).all(), (kind, n, k, m)
                continue
            tol = 2e-5 if dtype == torch.float32 else 1e-2
            assert rel_err(got, want) <= tol, (kind, n, k, m, rel_err(got, want))


@pytest.mark.parametrize("kind", ("Q4_1", "Q8_0"))
def test_the_digits_keep_fifteen_bits_of_each_blocks_largest_activation(kind):
    # The bound above over activations spanning 2^-20..2^20, an all-zero block and one below
    # 2^-100; one digit alone breaks it, as would a lost digit, a misplaced value, a wrong offset
    # correction or a scale or minimum of the wrong row or block.
    q, w = gguf_matrix(48, 576, kind, seed=7)
    tiles = tiles_of(q)
    for m in (1, 3, 4, 6, 16):
        x = spread_activations(m, 576)
        x[0, :32] = 0.0
        x[-1, 32:64] = torch.randn(32) * 2.0**-115
        got = kernels.linear_tiles(x, tiles).double()
        exact = x.double() @ w.T
        bound = digit_bound(x, w, integer_part(q, w))
        assert ((got - exact).abs() <= bound).all(), (m, ((got - exact).abs() - bound).max())
        if carries_digits(m):
            assert ((one_digit(x, w) - exact).abs() > bound).any()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 5, 20])
@pytest.mark.parametrize("k", [96, 576])  # three blocks packed one at a time; 18, sixteen of them together
def test_a_non_finite_activation_stays_in_its_row(m, bits, k):
    w = torch.randn(32, k, generator=torch.Generator().manual_seed(1))
    q = quantize_int4(w) if bits == 4 else (*quantize_int8(w), None)
    tiles = to_tiles(*q)
    w = dequantize_torch(*q, torch.float64)
    bad_row = m // 2
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
        x[bad_row, 40] = bad
        got = kernels.linear_tiles(x, tiles).double()
        assert not torch.isfinite(got[bad_row]).all()
        rows = [r for r in range(m) if r != bad_row]
        if rows:
            assert rel_err(got[rows], x[rows].double() @ w.T) <= 1e-3


def test_leading_dims_and_the_portable_body():
    q, s, m = quantize_int4(torch.randn(32, 64, generator=torch.Generator().manual_seed(3)))
    tiles = to_tiles(q, s, m)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(32)
    got = kernels.linear_tiles(x, tiles, bias)
    assert got.shape == (2, 3, 32)
    assert rel_err(got, linear_tiles_torch(x, tiles, bias).double()) <= 1e-3
    assert rel_err(got, kernels.linear_quantized(x, q, s, m, bias).double()) <= 1e-3


def test_the_tiles_switch(monkeypatch):
    monkeypatch.delenv("GRAPHRT_QUANT_TILES", raising=False)
    assert wanted("vnni") and wanted("amx") and not wanted("avx512") and not wanted("avx2") and not wanted(None)
    monkeypatch.setenv("GRAPHRT_QUANT_TILES", "0")
    assert not wanted("vnni")
    monkeypatch.setenv("GRAPHRT_QUANT_TILES", "1")
    assert wanted("avx2")


def test_bad_arguments_are_named():
    q, s, m = quantize_int4(torch.randn(32, 64))
    tiles = to_tiles(q, s, m)
    x = torch.randn(2, 64)
    with pytest.raises(KernelArgumentError, match="tiles must be uint8"):
        kernels.linear_tiles(x, tiles.to(torch.int8))
    with pytest.raises(
        KernelArgumentError,
        match=r"tiles must be \[N / 16, K / 32, 320 \(int4\) or 544 \(int8\)\], got shape \(2, 2, 256\)",
    ):
        kernels.linear_tiles(x, tiles[..., :256].contiguous())
    with pytest.raises(KernelArgumentError, match="tiles must be contiguous"):
        kernels.dequantize_tiles(torch.zeros(2, 4, 320, dtype=torch.uint8)[:, ::2])
    with pytest.raises(KernelArgumentError, match="x has size 32 in dim 1, expected 64"):
        kernels.linear_tiles(torch.randn(2, 32), tiles)
    with pytest.raises(KernelArgumentError, match="x must be float32 or bfloat16"):
        kernels.linear_tiles(x.half(), tiles)
    with pytest.raises(KernelArgumentError, match=r"bias has size 3 in dim 0, expected 32"):
        kernels.linear_tiles(x, tiles, torch.randn(3))
    with pytest.raises(KernelArgumentError, match="dtype must be float32 or bfloat16"):
        kernels.dequantize_tiles(tiles, torch.float16)
    with pytest.raises(KernelArgumentError, match=r"N a multiple of 16; got torch.uint8 of shape \(40, 32\)"):
        to_tiles(*quantize_int4(torch.randn(40, 64)))
