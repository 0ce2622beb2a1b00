"""noop_elimination: drop casts to a tensor's own dtype and reshapes to its own shape.

Before (float32 model)::

    float_3 = einsum.float()          # already float32
    probs = softmax.to(torch.float32) # already float32

After: users read ``einsum`` and ``softmax`` directly.

It runs after the fusions: their patterns are traced from source that spells these casts, and
they must see the graph as the model wrote it.
"""

from __future__ import annotations

import torch

from graphrt.passes.base import GraphPass, PassResult
from graphrt.passes.matcher import example_value

_CASTS = {"float": torch.float32, "double": torch.float64, "long": torch.int64}


def _is_noop(n) -> bool:
    if n.op != "call_method" or not n.args or not hasattr(n.args[0], "meta"):
        return False
    src, out = example_value(n.args[0]), example_value(n)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if n.target in _CASTS and not n.kwargs:
        return src.dtype == _CASTS[n.target]
    if n.target == "to" and len(n.args) == 2 and not n.kwargs and isinstance(n.args[1], torch.dtype):
        return src.dtype == n.args[1]
    if n.target in ("reshape", "view") and not n.kwargs:
        return tuple(src.shape) == tuple(out.shape) and src.dtype == out.dtype
    return False


class NoopElimination(GraphPass):
    name = "noop_elimination"

    def __call__(self, graph) -> PassResult:
        result = PassResult()
        for n in list(graph.nodes):
            if _is_noop(n):
                n.replace_all_uses_with(n.args[0])
                graph.erase_node(n)
                result.matched += 1
        return result
