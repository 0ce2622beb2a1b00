"""Graphs that start without compiling: torch.export + AOTInductor packages.

A package is built from the graph graphrt's passes rewrote (so the fused ops are in it) and takes
the same flat inputs: the key's buffers, the KV caches and the weights, which it reads in place
(one copy of the weights serves every graph; the caches are written in place). Loading goes
through the package loader directly: no Dynamo, no compiler.
"""

from __future__ import annotations

import torch
import torch.fx as fx


def build_package(gm: fx.GraphModule, example_inputs: list, path: str) -> None:
    exported = torch.export.export(gm, tuple(example_inputs), strict=False)
    torch._inductor.aoti_compile_and_package(exported, package_path=path)


def load_package(path: str):
    from torch.export.pt2_archive._package import AOTICompiledModel

    import graphrt.kernels  # noqa: F401  (the package calls graphrt:: ops: register them first)

    loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
    return AOTICompiledModel(loader)
