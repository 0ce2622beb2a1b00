"""A recording torch.compile backend for pass tests: keeps the graph before and after the passes
and runs the rewritten graph eagerly, so numerics can be compared with plain eager."""

from __future__ import annotations

import collections
import copy

import torch
import torch.fx as fx

from graphrt.passes import PassManager


class RecordingBackend:
    def __init__(self, disabled=(), backend: str = "eager") -> None:
        self.passes = PassManager(backend, disabled)
        self.before: fx.GraphModule | None = None
        self.after: fx.GraphModule | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs):
        self.before = copy.deepcopy(gm)
        self.results = self.passes(gm.graph, "test")
        gm.recompile()
        self.after = gm
        return gm.forward

    def compile(self, fn):
        torch._dynamo.reset()
        return torch.compile(fn, backend=self, fullgraph=True, dynamic=False)


def count(gm: fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method") and n.target == target)


def targets(gm: fx.GraphModule) -> collections.Counter:
    return collections.Counter(n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
