"""Projections and embeddings over weight-only quantized matrices (``kernels/quantized.py``).

``QuantizedLinear`` replaces an ``nn.Linear`` and ``QuantizedEmbedding`` an ``nn.Embedding`` (whose
table a tied LM head shares): each holds ``qweight``, ``scales`` and, for int4, ``mins`` as
buffers, and computes with the canonical spelling

    F.linear(x, graphrt.dequantize(qweight, scales, mins, dtype), bias)

which eager mode runs as written (a whole float matrix per call) and ``use_skinny_gemm`` turns into
``graphrt::linear_quantized`` in decode-sized graphs (the bytes read as they are stored). An
embedding lookup dequantises only the rows it gathers.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrt.kernels.quantized import BLOCK


def _register(module: nn.Module, bits: int, rows: int, in_features: int) -> None:
    if bits == 4:
        module.register_buffer("qweight", torch.empty(rows, in_features // 2, dtype=torch.uint8))
        module.register_buffer("mins", torch.empty(rows, in_features // BLOCK, dtype=torch.float16))
    else:
        module.register_buffer("qweight", torch.empty(rows, in_features, dtype=torch.int8))
        module.mins = None
    module.register_buffer("scales", torch.empty(rows, in_features // BLOCK, dtype=torch.float16))


class QuantizedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bits: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        _register(self, bits, out_features, in_features)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, dense_weight(self, x.dtype), self.bias)


class QuantizedEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.bits = num_embeddings, embedding_dim, bits
        self.dtype = dtype  # of the activations it returns
        _register(self, bits, num_embeddings, embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mins = None if self.mins is None else self.mins[ids]
        return torch.ops.graphrt.dequantize(self.qweight[ids], self.scales[ids], mins, self.dtype)


def dense_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A projection's weight matrix as the graph should read it: a float weight as it is, a
    quantized one through the canonical ``dequantize`` (which decode graphs never materialise)."""
    if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
        return torch.ops.graphrt.dequantize(module.qweight, module.scales, module.mins, dtype)
    return module.weight
