"""use_skinny_gemm: a projection over few rows → ``graphrt::linear``, the skinny GEMM.

Before (a decode graph of 4 rows, fp32)::

    qkv = torch._C._nn.linear(x, qkv_weight, qkv_bias)           # x: [4, 576]
    logits = torch._C._nn.linear(hidden[indices], embed_weight)   # [4, 576] → [4, 49152]

After::

    qkv = torch.ops.graphrt.linear(x, qkv_weight, qkv_bias)
    logits = torch.ops.graphrt.linear(hidden[indices], embed_weight, None)

A quantized weight (``kernels/quantized.py``) is spelled ``linear(x, dequantize(qweight, scales,
mins, dtype), bias)``; at most ``max_rows`` rows it becomes ``graphrt::linear_quantized(x, qweight,
scales, mins, bias)``, which reads the stored bytes and never builds the float matrix; a prefill
graph keeps the spelling (the matrix dequantised once, then aten's GEMM). Quantized tiles
(``kernels/quant_tiles.py``) are the same with ``dequantize_tiles(tiles, dtype)`` and
``graphrt::linear_tiles(x, tiles, bias)``.

Packed bf16 weights (``kernels/packed_bf16.py``) are spelled ``linear(x, unpack_bf16(packed),
bias)`` and become ``graphrt::linear_packed_bf16(x, packed, bias)`` at any row count: the tile
product over the packed matrix beat unpacking it for aten's GEMM at every size measured (an
Intel Xeon with AMX, SmolLM2's shapes: at 512 rows 1.65-1.97 TFLOP/s against aten's 1.68-1.84
on the row-major matrix, before the unpacking; at 32 and 128 rows 1.4-1.8× aten).

The choice is per projection, by its row count (the product of the input's leading dims, known
statically in a graph per key): at most ``max_rows`` rows is a stream over the weights, where
graphrt's kernel reads each weight byte once and aten's GEMM reaches a third of the memory's speed;
more rows (prefill) is a real GEMM, where aten/oneDNN's blocking wins, so those stay. An LM head
over a prefill graph's few logits rows is a skinny GEMM too. Only fp32/bf16 tensors with a
contiguous [N, K] weight are rewritten (the kernel's layout); anything else is left and counted
as unmatched. The op reads the weight in place: no copy per graph.
"""

from __future__ import annotations

import math

import torch

from graphrt.passes.base import GraphPass, PassResult
from graphrt.passes.matcher import emit, example_value

_DTYPES = (torch.float32, torch.bfloat16)


def _linear_args(n):
    """(x, weight, bias) of a linear call, or None when it is not one."""
    if n.op != "call_function" or n.target is not torch._C._nn.linear:
        return None
    names = ("input", "weight", "bias")
    args = list(n.args) + [n.kwargs[k] for k in names[len(n.args) :] if k in n.kwargs]
    if len(args) == 2:
        args.append(None)
    return tuple(args) if len(args) == 3 else None


# a stored layout's op that makes the float matrix → (its argument names, the product that reads
# the stored bytes instead, the matrix's ndim as stored)
_STORED = {
    "dequantize": (("qweight", "scales", "mins", "dtype"), "linear_quantized", 2),
    "dequantize_tiles": (("tiles", "dtype"), "linear_tiles", 3),
    "unpack_bf16": (("packed",), "linear_packed_bf16", 4),
}


def _stored(weight):
    """(product op, weight arguments, dtype, stored ndim) when ``weight`` is one of graphrt's
    spellings of a stored layout, else None; dtype None for packed bf16 (always bf16)."""
    if getattr(weight, "op", None) != "call_function":
        return None
    for name, (names, skinny, ndim) in _STORED.items():
        op = getattr(torch.ops.graphrt, name)
        if weight.target in (op.default, op):
            args = list(weight.args) + [weight.kwargs[k] for k in names[len(weight.args) :] if k in weight.kwargs]
            if len(args) != len(names):
                return None
            product = getattr(torch.ops.graphrt, skinny).default
            if names[-1] != "dtype":
                return product, tuple(args), torch.bfloat16, ndim
            return product, tuple(args[:-1]), args[-1], ndim
    return None


def _fits_stored(x, weight, bias, max_rows: int) -> bool:
    product, weight_args, dtype, ndim = _stored(weight)
    xv, qv = example_value(x), example_value(weight_args[0])
    if not isinstance(xv, torch.Tensor) or not isinstance(qv, torch.Tensor) or xv.ndim == 0:
        return False
    if qv.ndim != ndim:
        return False
    if xv.dtype not in _DTYPES or xv.dtype != dtype or xv.device.type != "cpu":
        return False
    if bias is not None and not isinstance(example_value(bias), torch.Tensor):
        return False
    if product is torch.ops.graphrt.linear_packed_bf16.default:
        return True  # any row count (see above)
    return math.prod(xv.shape[:-1]) <= max_rows


def _fits(x, weight, bias, max_rows: int) -> bool:
    if _stored(weight) is not None:
        return _fits_stored(x, weight, bias, max_rows)
    xv, wv = example_value(x), example_value(weight)
    bv = None if bias is None else example_value(bias)
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor) or xv.ndim == 0:
        return False
    if bias is not None and not isinstance(bv, torch.Tensor):
        return False
    if xv.dtype not in _DTYPES or wv.dtype not in _DTYPES or wv.ndim != 2 or not wv.is_contiguous():
        return False
    if xv.device.type != "cpu" or wv.device.type != "cpu":
        return False
    return math.prod(xv.shape[:-1]) <= max_rows


class UseSkinnyGemm(GraphPass):
    name = "use_skinny_gemm"

    def __init__(self, max_rows: int = 64) -> None:
        super().__init__(max_rows=max_rows)
        self.max_rows = max_rows

    def __call__(self, graph) -> PassResult:
        result = PassResult()
        for n in list(graph.nodes):
            args = _linear_args(n)
            if args is None:
                continue
            if not _fits(*args, self.max_rows):
                result.unmatched += 1
                continue
            x, weight, bias = args
            stored = _stored(weight)
            with graph.inserting_before(n):
                if stored is None:
                    (new,) = emit(graph, torch.ops.graphrt.linear.default, args)
                else:
                    skinny, weight_args, _, _ = stored
                    (new,) = emit(graph, skinny, (x, *weight_args, bias))
            n.replace_all_uses_with(new)
            graph.erase_node(n)
            if stored is not None and not weight.users:
                graph.erase_node(weight)
            result.matched += 1
        return result
