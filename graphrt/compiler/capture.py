"""Capture one step graph per key: Dynamo traces the step, graphrt's passes rewrite it, the
inner backend compiles it, and the result is replayed directly over fixed inputs.

Dynamo runs only here. Its backend contract hands over the graph with its flat example inputs
(the key's input buffers, the KV caches and the model's weights, all persistent tensors), so a
captured graph is called with that same list every step: no guards, no re-trace, no copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graphrt.compiler.inner import CompiledFn, InnerBackendError, get_inner_backend
from graphrt.passes import PassManager


class CaptureError(RuntimeError):
    """A step could not be captured as one graph."""


@dataclass
class CapturedGraph:
    name: str
    fn: CompiledFn
    inputs: list[torch.Tensor]  # the flat inputs, in the graph's placeholder order
    sources: list[tuple]  # where each input comes from: ("arg", i), ("kv", layer, 0|1), ("param", name)
    gm: fx.GraphModule
    compile_s: float = 0.0
    notes: dict = field(default_factory=dict)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(*self.inputs)


class _Backend:
    """The torch.compile backend: passes, then the inner backend; keeps what it built."""

    def __init__(self, passes: PassManager, inner: str, name: str, options: dict | None = None) -> None:
        self.passes, self.inner, self.name = passes, get_inner_backend(inner, **(options or {})), name
        self.built: list[tuple[fx.GraphModule, list, CompiledFn]] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> CompiledFn:
        self.passes(gm.graph, self.name)
        gm.recompile()
        fn = self.inner(gm, example_inputs)
        self.built.append((gm, example_inputs, fn))
        return fn


def input_sources(step: torch.nn.Module, args: tuple, kv_caches, example_inputs: list) -> list[tuple]:
    where: dict[int, tuple] = {}
    for i, a in enumerate(args):
        where[id(a)] = ("arg", i)
    for layer, (k, v) in enumerate(kv_caches):
        where[id(k)] = ("kv", layer, 0)
        where[id(v)] = ("kv", layer, 1)
    for name, t in [*step.named_parameters(), *step.named_buffers()]:
        where.setdefault(id(t), ("param", name))
    sources = []
    for t in example_inputs:
        if id(t) not in where:
            raise CaptureError(
                f"graph input of shape {tuple(t.shape)} is neither a step input, a KV cache nor a weight"
            )
        sources.append(where[id(t)])
    return sources


def capture(
    step: torch.nn.Module,
    args: tuple,
    kv_caches,
    passes: PassManager,
    inner: str,
    name: str,
    options: dict | None = None,
) -> CapturedGraph:
    """``options``: the inner backend's settings (torchair_mode)."""
    backend = _Backend(passes, inner, name, options)
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    start = time.perf_counter()
    # Every key traces the same forward; keep Dynamo's per-function cache out of the way.
    with torch._dynamo.config.patch(cache_size_limit=1 << 16, accumulated_cache_size_limit=1 << 16), torch.no_grad():
        try:
            compiled(*args, kv_caches)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if isinstance(e.inner_exception, InnerBackendError):  # the inner backend's own words, unwrapped
                raise e.inner_exception from None
            raise
    elapsed = time.perf_counter() - start
    if len(backend.built) != 1:
        raise CaptureError(f"step {name} compiled into {len(backend.built)} graphs, expected one")
    gm, example_inputs, fn = backend.built[0]
    sources = input_sources(step, args, kv_caches, example_inputs)
    return CapturedGraph(name, fn, list(example_inputs), sources, gm, elapsed)
