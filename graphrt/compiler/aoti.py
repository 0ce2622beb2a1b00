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

import json
import os
import subprocess
import sys

import torch
import torch.fx as fx

from graphrt.compiler.inner import INDUCTOR_OPTIONS


def free_dims(sources: list[tuple], inputs: list[torch.Tensor], block_tables_arg: int) -> dict[int, dict[int, str]]:
    """Which dims of which flat inputs a package leaves free: {input index: {dim: name}}
    (``block_tables_arg``: the position of block_tables among the step's arguments).

    A dim whose example size is below 2 stays fixed (export specialises sizes 0 and 1)."""
    dims: dict[int, dict[int, str]] = {}
    for i, (source, t) in enumerate(zip(sources, inputs)):
        if source[0] == "kv" and t.shape[0] >= 2:
            dims[i] = {0: "num_blocks"}
        elif tuple(source) == ("arg", block_tables_arg) and t.shape[1] >= 2:
            dims[i] = {1: "max_blocks"}
    return dims


def export(gm: fx.GraphModule, example_inputs: list, free: dict | None = None) -> torch.export.ExportedProgram:
    """The rewritten step as an ExportedProgram, with the ``free`` dims (``free_dims``) symbolic."""
    free = free or {}
    names = {n for d in free.values() for n in d.values()}
    dim = {n: torch.export.Dim(n, min=2) for n in names}
    shapes = tuple({d: dim[n] for d, n in free[i].items()} if i in free else None for i in range(len(example_inputs)))
    return torch.export.export(gm, tuple(example_inputs), dynamic_shapes=shapes if free else None, strict=False)


def compile_package(exported: torch.export.ExportedProgram, path: str) -> None:
    """The wrapper's -O1 (Inductor's default) is kept: -O0 builds a SmolLM2 decode graph in 18 s
    instead of 25 s but steps 2-3% slower, and a graph is built once per machine. graphrt's native
    ops are called through their C entry points, not the proxy executor (``aoti_c_shims``)."""
    from graphrt.kernels.native_library import aoti_c_shims

    configs = {**INDUCTOR_OPTIONS, "aot_inductor.custom_ops_to_c_shims": aoti_c_shims()}
    torch._inductor.aoti_compile_and_package(exported, package_path=path, inductor_configs=configs)


def build_package(gm: fx.GraphModule, example_inputs: list, path: str, free: dict | None = None) -> None:
    compile_package(export(gm, example_inputs, free), path)


class PackageBuild:
    """An AOTInductor build running in a worker process, so that graphs build side by side: the
    C++ compile of one graph (single-threaded g++, half of a build) overlaps the next one.

    The worker gets the ExportedProgram without its example values (weights and KV caches would
    be gigabytes) and the inputs' shapes, strides and dtypes to stand empty tensors in for them."""

    started = 0  # builds this process has started (tests and reports read it)

    def __init__(self, exported: torch.export.ExportedProgram, example_inputs: list, path: str) -> None:
        PackageBuild.started += 1
        self.path = path
        self.spec = f"{path}.inputs.json"
        exported._example_inputs = None
        torch.export.save(exported, f"{path}.ep.pt2")
        with open(self.spec, "w") as f:
            json.dump(
                [[list(t.shape), list(t.stride()), str(t.dtype).removeprefix("torch.")] for t in example_inputs], f
            )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "graphrt.compiler.aoti", f"{path}.ep.pt2", self.spec, path],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait(self) -> None:
        _, err = self.proc.communicate()
        for extra in (f"{self.path}.ep.pt2", self.spec):
            if os.path.exists(extra):
                os.remove(extra)
        if self.proc.returncode != 0:
            raise RuntimeError(f"AOTInductor build of {self.path} failed:\n{err[-4000:]}")


def _worker(exported_path: str, spec_path: str, out: str) -> None:
    import graphrt.kernels  # noqa: F401  (the graph calls graphrt:: ops)

    exported = torch.export.load(exported_path)
    with open(spec_path) as f:
        spec = json.load(f)
    exported._example_inputs = (tuple(torch.empty_strided(s, st, dtype=getattr(torch, d)) for s, st, d in spec), {})
    compile_package(exported, out)


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


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
