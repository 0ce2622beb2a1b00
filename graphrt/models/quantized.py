"""Projections and embeddings over weight-only quantized matrices (``kernels/quantized.py``).

``QuantizedLinear`` replaces an ``nn.Linear`` and ``QuantizedEmbedding`` an ``nn.Embedding`` (whose
table a tied LM head shares): each holds ``qweight``, ``scales`` and, for int4, ``mins`` as
buffers, and computes with the canonical spelling

    F.linear(x, graphrt.dequantize(qweight, scales, mins, dtype), bias)

which eager mode runs as written (a whole float matrix per call) and ``use_skinny_gemm`` turns into
``graphrt::linear_quantized`` in decode-sized graphs (the bytes read as they are stored). An
embedding lookup dequantises only the rows it gathers.

On a CPU whose products read tiles faster (``kernels/quant_tiles.py``), ``use_quant_tiles``
regroups each quantized matrix into one ``tiles`` buffer after loading; the spelling is then
``F.linear(x, graphrt.dequantize_tiles(tiles, dtype), bias)``, and an embedding lookup gathers
its rows back into the plain layout (``quant_tiles.rows``) before ``dequantize``. A tied LM head
reads the embedding's tiles: still one copy.
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
    module.register_buffer("tiles", None)  # the three regrouped, once use_tiles has run


class _Quantized(nn.Module):
    """What both modules share: the plain buffers, or the tiles they became."""

    def use_tiles(self) -> bool:
        """Regroup a matrix of whole 16-row groups into tiles (its plain buffers go); True when
        it is (or already was) tiles."""
        if self.tiles is not None:
            return True
        if not quant_tiles.tileable(self.qweight):
            return False
        self.tiles = quant_tiles.to_tiles(self.qweight, self.scales, self.mins)
        self.qweight = self.scales = self.mins = None
        return True


class QuantizedLinear(_Quantized):
    def __init__(self, in_features: int, out_features: int, bits: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        _register(self, bits, out_features, in_features)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, dense_weight(self, x.dtype), self.bias)


class QuantizedEmbedding(_Quantized):
    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.bits = num_embeddings, embedding_dim, bits
        self.dtype = dtype  # of the activations it returns
        _register(self, bits, num_embeddings, embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None:
            return torch.ops.graphrt.dequantize(*quant_tiles.rows(self.tiles, ids), self.dtype)
        mins = None if self.mins is None else self.mins[ids]
        return torch.ops.graphrt.dequantize(self.qweight[ids], self.scales[ids], mins, self.dtype)


def is_quantized(model: nn.Module) -> bool:
    """Whether any of the model's projections holds int4 or int8 weights."""
    return any(isinstance(m, QuantizedLinear) for m in model.modules())


def use_quant_tiles(model: nn.Module) -> int:
    """Every quantized matrix of ``model`` as tiles (``use_tiles``); returns how many are tiles now."""
    return sum(m.use_tiles() for m in model.modules() if isinstance(m, _Quantized))


def dense_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A projection's weight matrix as the graph should read it: a float weight as it is, a
    quantized one through the canonical ``dequantize`` (which decode graphs never materialise), a
    packed one (``models/packed.py``) through ``unpack_bf16`` (which compiled graphs never run)."""
    if hasattr(module, "dense_weight"):
        return module.dense_weight(dtype)
    if isinstance(module, _Quantized):
        if module.tiles is not None:
            return torch.ops.graphrt.dequantize_tiles(module.tiles, dtype)
        return torch.ops.graphrt.dequantize(module.qweight, module.scales, module.mins, dtype)
    return module.weight
