"""Projections and embeddings over packed bf16 matrices (``kernels/packed_bf16.py``).

On a CPU whose tile product reads packed weights faster (``packed_bf16.wanted``), an engine that
compiles its graphs calls ``use_packed_bf16`` after loading: every bf16 ``nn.Linear`` whose matrix
packs (both dimensions multiples of 32) becomes a ``PackedLinear``, every such ``nn.Embedding`` a
``PackedEmbedding``. A projection is then spelled

    F.linear(x, graphrt.unpack_bf16(packed), bias)

which ``use_skinny_gemm`` turns into ``graphrt::linear_packed_bf16`` in every graph; run eagerly
(an engine without graphs sharing the model, as ``graphrt bench decode``'s), a projection calls
that product itself rather than put the whole matrix back each call (SmolLM2 bf16, batch 1: 10.6
tok/s that way, against 21.7 over the row-major matrices). An embedding lookup gathers only its
rows (``packed_bf16.rows``); a tied LM head reads the embedding's packed matrix: still one copy.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrt.kernels import packed_bf16


class _Packed(nn.Module):
    """What both modules share: the packed matrix, and its row-major spelling for a graph."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("packed", packed_bf16.to_packed(weight))

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.ops.graphrt.unpack_bf16(self.packed)


class PackedLinear(_Packed):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # eager: the product itself, not a whole matrix per call
            return torch.ops.graphrt.linear_packed_bf16(x, self.packed, self.bias)
        return nn.functional.linear(x, self.dense_weight(x.dtype), self.bias)


class PackedEmbedding(_Packed):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__(embedding.weight)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return packed_bf16.rows(self.packed, ids)


def use_packed_bf16(model: nn.Module) -> int:
    """Every packable bf16 projection and embedding table of ``model`` packed (the row-major
    matrices go); returns how many are packed now. A module marked ``packable = False`` (a matrix
    the model reads whole, such as DeepSeek-V3's ``kv_b_proj``) stays as it is."""
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if not getattr(child, "packable", True):
                continue
            if type(child) is nn.Linear and packed_bf16.packable(child.weight):
                swaps.append((parent, name, PackedLinear))
            elif type(child) is nn.Embedding and packed_bf16.packable(child.weight):
                swaps.append((parent, name, PackedEmbedding))
    packed: dict[int, nn.Module] = {}  # a module held by two parents is packed once, for both
    for parent, name, kind in swaps:  # one at a time: each row-major matrix goes as its copy comes
        child = getattr(parent, name)
        if id(child) not in packed:
            packed[id(child)] = kind(child)
        setattr(parent, name, packed[id(child)])
    return sum(isinstance(m, _Packed) for m in model.modules())
