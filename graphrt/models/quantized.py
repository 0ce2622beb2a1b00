"""Projections and embeddings over weight-only quantized matrices (``kernels/quantized.py``).

``QuantizedLinear`` replaces an ``nn.Linear`` and ``QuantizedEmbedding`` an ``nn.Embedding`` (whose
table a tied LM head shares): each holds ``qweight``, ``scales`` and, for int4, ``mins`` as
buffers, and computes with the canonical spelling

    F.linear(x, graphrt.dequantize(qweight, scales, mins, dtype), bias)

which eager mode runs as written (a whole float matrix per call) and ``use_skinny_gemm`` turns into
``graphrt::linear_quantized`` in decode-sized graphs (the bytes read as they are stored). An
embedding lookup dequantises only the rows it gathers.

On a CPU whose products read int4 tiles faster (``kernels/quant_tiles.py``), ``use_int4_tiles``
regroups each int4 projection into one ``tiles`` buffer after loading; the spelling is then
``F.linear(x, graphrt.dequantize_tiles(tiles, dtype), bias)``. Embedding tables keep the plain
layout: a lookup reads whole rows.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrt.kernels import quant_tiles
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
        self.register_buffer("tiles", None)  # int4 tiles, once use_tiles has regrouped the three
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def use_tiles(self) -> bool:
        """Regroup an int4 matrix of whole 16-row groups into tiles (its plain buffers go);
        True when it is (or already was) tiles."""
        if self.tiles is not None:
            return True
        if self.bits != 4 or not quant_tiles.tileable(self.qweight):
            return False
        self.tiles = quant_tiles.to_tiles(self.qweight, self.scales, self.mins)
        self.qweight = self.scales = self.mins = None
        return True

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


def use_int4_tiles(model: nn.Module) -> int:
    """Every int4 projection of ``model`` as tiles (``QuantizedLinear.use_tiles``); returns how many
    are tiles now."""
    return sum(m.use_tiles() for m in model.modules() if isinstance(m, QuantizedLinear))


def dense_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A projection's weight matrix as the graph should read it: a float weight as it is, a
    quantized one through the canonical ``dequantize`` (which decode graphs never materialise)."""
    if isinstance(module, QuantizedLinear) and module.tiles is not None:
        return torch.ops.graphrt.dequantize_tiles(module.tiles, dtype)
    if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
        return torch.ops.graphrt.dequantize(module.qweight, module.scales, module.mins, dtype)
    return module.weight
