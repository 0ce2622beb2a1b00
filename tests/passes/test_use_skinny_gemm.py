"""use_skinny_gemm in four beats (tiny module, recording backend, op counts, numerics), with the
cases it must leave alone: too many rows, a non-contiguous weight, a dtype the kernel lacks."""

import pytest
import torch
from torch import nn

from graphrt.passes import PassManager
from tests.passes.recording import RecordingBackend, count

OP = torch.ops.graphrt.linear.default
LINEAR = torch._C._nn.linear


class Mlp(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.up = nn.Linear(33, 70, bias=True).to(dtype)
        self.down = nn.Linear(70, 33, bias=False).to(dtype)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projections_of_few_rows_become_the_skinny_gemm(rows, dtype):
    model = Mlp(dtype)
    x = torch.randn(rows, 33, dtype=dtype)
    rec = RecordingBackend()
    with torch.no_grad():
        got = rec.compile(model)(x)
        want = model(x)
    assert count(rec.before, LINEAR) == 2 and count(rec.before, OP) == 0
    assert count(rec.after, LINEAR) == 0 and count(rec.after, OP) == 2
    assert rec.results["use_skinny_gemm"].matched == 2
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)


def test_rows_are_counted_over_every_leading_dim():
    model = Mlp()
    x = torch.randn(2, 8, 33)  # 16 rows: rewritten
    rec = RecordingBackend()
    with torch.no_grad():
        torch.testing.assert_close(rec.compile(model)(x), model(x), rtol=1e-5, atol=1e-5)
    assert count(rec.after, OP) == 2


def test_prefill_sized_projections_stay_with_aten():
    model = Mlp()
    x = torch.randn(65, 33)
    rec = RecordingBackend()
    with torch.no_grad():
        got = rec.compile(model)(x)
        torch.testing.assert_close(got, model(x))
    assert count(rec.after, OP) == 0 and count(rec.after, LINEAR) == 2
    assert rec.results["use_skinny_gemm"].unmatched == 2


def transposed_weight(x, w):
    return torch.nn.functional.linear(x, w.t())  # a strided weight: not the kernel's layout


def test_a_non_contiguous_weight_or_float64_is_left_alone():
    rec = RecordingBackend()
    x, w = torch.randn(2, 8), torch.randn(8, 6)
    torch.testing.assert_close(rec.compile(transposed_weight)(x, w), transposed_weight(x, w))
    assert count(rec.after, OP) == 0 and rec.results["use_skinny_gemm"].unmatched == 1
    model = Mlp().double()
    rec64 = RecordingBackend()
    with torch.no_grad():
        rec64.compile(model)(torch.randn(2, 33, dtype=torch.float64))
    assert count(rec64.after, OP) == 0


def test_disabled_pass_keeps_aten_and_the_threshold_is_in_the_identity():
    model = Mlp()
    rec = RecordingBackend(disabled=("use_skinny_gemm",))
    with torch.no_grad():
        rec.compile(model)(torch.randn(1, 33))
    assert count(rec.after, OP) == 0 and count(rec.after, LINEAR) == 2
    from graphrt.passes.use_skinny_gemm import UseSkinnyGemm

    assert UseSkinnyGemm(max_rows=16).uuid() != UseSkinnyGemm(max_rows=8).uuid()
    assert "use_skinny_gemm" not in [p.name for p in PassManager("torchair").passes]


QOP = torch.ops.graphrt.linear_quantized.default
DIGITS_TOL = 4e-4  # QuantizedMlp's output, relative: see the test below


def dequantizes(graph) -> int:
    """Dynamo records the op as its packet, a pass may emit the overload: count both."""
    return count(graph, torch.ops.graphrt.dequantize) + count(graph, torch.ops.graphrt.dequantize.default)


class QuantizedMlp(nn.Module):
    """Mlp with int4 up and int8 down projections (the layouts quantize-at-load produces)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        from graphrt.kernels.quantized import quantize_int4, quantize_int8
        from graphrt.models.quantized import QuantizedLinear

        self.up = QuantizedLinear(64, 96, 4, bias=True)
        self.down = QuantizedLinear(96, 64, 8, bias=False)
        self.up.qweight, self.up.scales, self.up.mins = quantize_int4(torch.randn(96, 64))
        self.up.bias = nn.Parameter(torch.randn(96).to(dtype))
        self.down.qweight, self.down.scales = quantize_int8(torch.randn(64, 96))

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_projections_of_few_rows_read_the_quantized_bytes(dtype):
    torch.manual_seed(0)
    model = QuantizedMlp(dtype)
    x = torch.randn(4, 64, dtype=dtype)
    rec = RecordingBackend()
    with torch.no_grad():
        got = rec.compile(model)(x)
        want = model(x)  # eager: the spelling as written (a whole float matrix per call)
    assert dequantizes(rec.before) == 2 and count(rec.before, LINEAR) == 2 and count(rec.before, QOP) == 0
    assert count(rec.after, QOP) == 2 and dequantizes(rec.after) == 0 and count(rec.after, LINEAR) == 0
    assert rec.results["use_skinny_gemm"].matched == 2
    # bf16: eager rounds the dequantised weights to bf16, the kernel keeps them fp32: compare
    # relative to the output's scale. fp32: on VNNI CPUs the 4 rows' activations go into an
    # integer product as two int8 digits a block, within 2^-15 of its largest (test_quantized.py
    # bounds that per element). Through the two projections that is at most 1.9e-4 of the output's
    # scale over 300 seeded draws (median 5.8e-5); a lost digit is about 5e-3 here.
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err <= (DIGITS_TOL if dtype == torch.float32 else 2e-2), err


def test_quantized_prefill_keeps_the_dequantize_spelling_and_a_disabled_pass_changes_nothing():
    model = QuantizedMlp()
    x = torch.randn(65, 64)
    rec = RecordingBackend()
    with torch.no_grad():
        torch.testing.assert_close(rec.compile(model)(x), model(x))
    assert count(rec.after, QOP) == 0 and dequantizes(rec.after) == 2 and count(rec.after, LINEAR) == 2
    assert rec.results["use_skinny_gemm"].unmatched == 2
    off = RecordingBackend(disabled=("use_skinny_gemm",))
    with torch.no_grad():
        torch.testing.assert_close(off.compile(model)(x[:3]), model(x[:3]))
    assert count(off.after, QOP) == 0 and dequantizes(off.after) == 2


TOP = torch.ops.graphrt.linear_tiles.default


def tile_dequantizes(graph) -> int:
    return count(graph, torch.ops.graphrt.dequantize_tiles) + count(graph, torch.ops.graphrt.dequantize_tiles.default)


@pytest.mark.parametrize("rows", [1, 4, 65])
def test_tiles_read_their_bytes_at_few_rows_and_prefill_keeps_the_spelling(rows):
    from graphrt.models.quantized import use_quant_tiles

    torch.manual_seed(1)
    model = QuantizedMlp()
    x = torch.randn(rows, 64)
    with torch.no_grad():
        plain = model(x)
    assert use_quant_tiles(model) == 2  # the int4 up projection and the int8 down one
    rec = RecordingBackend()
    with torch.no_grad():
        got = rec.compile(model)(x)
        want = model(x)
    torch.testing.assert_close(want, plain)  # eager: the tiles' float matrices are the plain ones'
    assert tile_dequantizes(rec.before) == 2 and dequantizes(rec.before) == 0
    if rows <= 64:
        assert count(rec.after, TOP) == 2 and count(rec.after, QOP) == 0 and tile_dequantizes(rec.after) == 0
        assert rec.results["use_skinny_gemm"].matched == 2
    else:
        assert count(rec.after, TOP) == 0 and tile_dequantizes(rec.after) == 2 and count(rec.after, LINEAR) == 2
        assert rec.results["use_skinny_gemm"].unmatched == 2
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= DIGITS_TOL, err


POP = torch.ops.graphrt.linear_packed_bf16.default


def unpacks(graph) -> int:
    return count(graph, torch.ops.graphrt.unpack_bf16) + count(graph, torch.ops.graphrt.unpack_bf16.default)


class PackableMlp(nn.Module):
    """A bf16 Mlp whose up and down projections pack (64 x 96 and 96 x 64) and a third that does
    not (96 inputs, 40 outputs: not a whole block)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 96, bias=True).bfloat16()
        self.down = nn.Linear(96, 64, bias=False).bfloat16()
        self.side = nn.Linear(96, 40, bias=False).bfloat16()

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.down(h), self.side(h)


@pytest.mark.parametrize("rows", [1, 8, 65])
def test_packed_projections_read_the_packed_matrix_at_any_row_count(rows):
    from graphrt.models.packed import PackedLinear, use_packed_bf16

    torch.manual_seed(2)
    model = PackableMlp()
    x = torch.randn(rows, 64).bfloat16()
    with torch.no_grad():
        plain = model(x)
    assert use_packed_bf16(model) == 2 and isinstance(model.up, PackedLinear) and type(model.side) is nn.Linear
    rec = RecordingBackend()
    with torch.no_grad():
        got = rec.compile(model)(x)
        want = model(x)
    for w, p in zip(want, plain):  # eager: the packed product of the same numbers (another sum order)
        torch.testing.assert_close(w, p, rtol=2e-2, atol=2e-2)
    assert unpacks(rec.before) == 2 and count(rec.before, POP) == 0
    assert count(rec.after, POP) == 2 and unpacks(rec.after) == 0
    # the projection that did not pack is a plain one: the skinny GEMM at few rows, aten at 65
    assert count(rec.after, OP) == (1 if rows <= 64 else 0)
    for g, w in zip(got, want):
        err = ((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
        assert err <= 2e-2, err


def test_a_disabled_pass_keeps_the_unpack_spelling():
    from graphrt.models.packed import use_packed_bf16

    model = PackableMlp()
    use_packed_bf16(model)
    x = torch.randn(4, 64).bfloat16()
    rec = RecordingBackend(disabled=("use_skinny_gemm",))
    with torch.no_grad():
        got = rec.compile(model)(x)
        want = model(x)
    assert unpacks(rec.after) == 2 and count(rec.after, POP) == 0 and count(rec.after, OP) == 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
