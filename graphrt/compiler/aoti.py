"""Graphs that start without compiling: torch.export + AOTInductor packages.

A package is built from the graph graphrt's passes rewrote (so the fused ops are in it) and takes
the same flat inputs: the key's buffers, the KV caches and the weights, which it reads in place
(one copy of the weights serves every graph; the caches are written in place). Loading goes
through the package loader directly: no Dynamo, no compiler.

Two input sizes are left free in a package: the number of KV blocks (dim 0 of every cache) and
the block-table width (dim 1 of ``block_tables``, set by max_model_len). Only graphrt's ops read
those tensors, so the code does not depend on them, and one package serves any KV budget and any
max_model_len: a deployment's graphs do not go stale when the free memory or the context length
changes.
"""

from __future__ import annotations

import torch
import torch.fx as fx

BLOCK_TABLES_ARG = 3  # position of block_tables among the step's arguments (input_buffers.ARG_NAMES)


def free_dims(sources: list[tuple], inputs: list[torch.Tensor]) -> dict[int, dict[int, str]]:
    """Which dims of which flat inputs a package leaves free: {input index: {dim: name}}.

    A dim whose example size is below 2 stays fixed (export specialises sizes 0 and 1)."""
    dims: dict[int, dict[int, str]] = {}
    for i, (source, t) in enumerate(zip(sources, inputs)):
        if source[0] == "kv" and t.shape[0] >= 2:
            dims[i] = {0: "num_blocks"}
        elif tuple(source) == ("arg", BLOCK_TABLES_ARG) and t.shape[1] >= 2:
            dims[i] = {1: "max_blocks"}
    return dims


def build_package(gm: fx.GraphModule, example_inputs: list, path: str, free: dict | None = None) -> None:
    free = free or {}
    names = {n for d in free.values() for n in d.values()}
    dim = {n: torch.export.Dim(n, min=2) for n in names}
    shapes = tuple({d: dim[n] for d, n in free[i].items()} if i in free else None for i in range(len(example_inputs)))
    exported = torch.export.export(gm, tuple(example_inputs), dynamic_shapes=shapes if free else None, strict=False)
    # The wrapper's -O1 (Inductor's default) is kept: -O0 builds a SmolLM2 decode graph in 18 s
    # instead of 25 s but steps 2-3% slower, and a graph is built once per machine.
    torch._inductor.aoti_compile_and_package(exported, package_path=path)


class PackagedGraph:
    """A loaded package, called with its flat inputs (the order the step graph was traced in).

    The loader is called directly: no pytree specs parsed per call, and loading imports neither
    torch.export nor Dynamo (a second of start-up)."""

    def __init__(self, path: str) -> None:
        import graphrt.kernels  # noqa: F401  (the package calls graphrt:: ops: register them first)

        self.loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.loader.boxed_run(list(inputs)))  # boxed_run empties the list it is given


def load_package(path: str) -> PackagedGraph:
    return PackagedGraph(path)
