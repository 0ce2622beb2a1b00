"""Graphs that start without compiling: torch.export + AOTInductor packages.

A package is built from the graph graphrt's passes rewrote (so the fused ops are in it). Its inputs
are the key's buffers and the KV caches (written in place); the weights are the package's
constants, left out of the package and handed to it at load as the engine's own tensors
(``user_managed``: the package reads them in place, so one copy of the weights serves every graph).
Weights as inputs cost a step the conversion of every one of them into a handle and back (about
500 tensors for SmolLM2 int4: 200 µs a call after a step's streams have evicted their metadata,
against 20 µs for a package with them as constants). Loading goes through the package loader
directly: no Dynamo, no compiler.

Two input sizes are left free in a package: the number of KV blocks (dim 0 of every cache) and
the block-table width (dim 1 of ``block_tables``, set by max_model_len). Only graphrt's ops read
those tensors, so the code does not depend on them, and one package serves any KV budget and any
max_model_len: a deployment's graphs do not go stale when the free memory or the context length
changes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator

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


def constant_name(source: tuple) -> str:
    """The package's name for the weight an input ``source`` names (a module attribute: no dots)."""
    return "w__" + source[1].replace(".", "__")


def split_inputs(sources: list[tuple], inputs: list) -> tuple[list, dict]:
    """The flat inputs → (the package's inputs, in order; {constant name: weight})."""
    runtime, constants = [], {}
    for source, t in zip(sources, inputs):
        if source[0] == "param":
            constants[constant_name(source)] = t
        else:
            runtime.append(t)
    return runtime, constants


class _WeightsAsConstants(torch.nn.Module):
    """The step graph with its weights as buffers: export lifts them as the package's constants."""

    def __init__(self, gm: fx.GraphModule, sources: list[tuple], inputs: list) -> None:
        super().__init__()
        self.gm = gm
        self.slots = []  # per flat input: the constant's name, or None (the next package input)
        for source, t in zip(sources, inputs):
            name = constant_name(source) if source[0] == "param" else None
            if name is not None:
                if hasattr(self, name):  # two weights' names differing only in "." against "__"
                    raise ValueError(f"weight {source[1]!r} has the package name {name!r} of another weight")
                self.register_buffer(name, t)
            self.slots.append(name)

    def forward(self, *xs):
        it = iter(xs)
        return self.gm(*[next(it) if name is None else getattr(self, name) for name in self.slots])


def export(
    gm: fx.GraphModule, sources: list[tuple], example_inputs: list, free: dict | None = None
) -> torch.export.ExportedProgram:
    """The rewritten step as an ExportedProgram over the non-weight inputs, the weights its
    constants, with the ``free`` dims (``free_dims``: flat input indices) symbolic."""
    free = free or {}
    names = {n for d in free.values() for n in d.values()}
    dim = {n: torch.export.Dim(n, min=2) for n in names}
    flat = [i for i, s in enumerate(sources) if s[0] != "param"]  # the package's inputs
    runtime = [example_inputs[i] for i in flat]
    shapes = tuple({d: dim[n] for d, n in free[i].items()} if i in free else None for i in flat)
    module = _WeightsAsConstants(gm, sources, example_inputs)
    return torch.export.export(module, tuple(runtime), dynamic_shapes=(shapes,) if free else None, strict=False)


def compile_package(exported: torch.export.ExportedProgram, path: str) -> None:
    """The wrapper's -O1 (Inductor's default) is kept: -O0 builds a SmolLM2 decode graph in 18 s
    instead of 25 s but steps 2-3% slower, and a graph is built once per machine. graphrt's native
    ops are called through their C entry points, not the proxy executor (``aoti_c_shims``)."""
    from graphrt.kernels.native_library import aoti_c_shims

    configs = {
        **INDUCTOR_OPTIONS,
        "aot_inductor.custom_ops_to_c_shims": aoti_c_shims(),
        "aot_inductor.package_constants_in_so": False,  # the weights come from the engine at load
        # A package is built over stand-in weights (the worker's empty tensors) and must not
        # depend on their values: Inductor would otherwise write a small weight's values into the
        # code (rotary's inverse frequencies) and replace one whose values are all equal by a constant
        "always_keep_tensor_constants": True,
        "joint_graph_constant_folding": False,
    }
    torch._inductor.aoti_compile_and_package(exported, package_path=path, inductor_configs=configs)


def _spec(t: torch.Tensor) -> list:
    return [list(t.shape), list(t.stride()), str(t.dtype).removeprefix("torch.")]


def _empty(spec: list) -> torch.Tensor:
    shape, stride, dtype = spec
    return torch.empty_strided(shape, stride, dtype=getattr(torch, dtype))


class PackageBuild:
    """An AOTInductor build running in a worker process, so that graphs build side by side: the
    C++ compile of one graph (single-threaded g++, half of a build) overlaps the next one.

    The worker gets the ExportedProgram without its example values or weights (they would be
    gigabytes) and their shapes, strides and dtypes to stand empty tensors in for them."""

    started = 0  # builds this process has started (tests and reports read it)

    def __init__(self, exported: torch.export.ExportedProgram, example_inputs: list, path: str) -> None:
        PackageBuild.started += 1
        self.path = path
        self.spec = f"{path}.inputs.json"
        weights, exported._example_inputs = exported.state_dict, None
        exported._state_dict = {n: torch.empty(0, dtype=t.dtype) for n, t in weights.items()}
        try:
            torch.export.save(exported, f"{path}.ep.pt2")
        finally:
            exported._state_dict = weights
        with open(self.spec, "w") as f:
            json.dump(
                {
                    "inputs": [_spec(t) for t in example_inputs],
                    "weights": {n: _spec(t) for n, t in weights.items()},
                },
                f,
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


@contextlib.contextmanager
def same_graph_lock(code: str, spec: str) -> Iterator[None]:
    """Builds of one graph (its code and its inputs' and weights' shapes), one at a time across
    processes; other graphs' builds go on beside them.

    Inductor writes a graph's files into its shared cache folder under its own lock, but archives
    them into the package after releasing it: a second process building the same graph could
    truncate a file (rewriting it) while the first archived it, and the first's package held an
    empty metadata JSON that no loader could read. The lock is a file lock, released by the kernel
    if a build dies."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    key = hashlib.sha256(f"{code}\0{spec}".encode()).hexdigest()[:32]
    folder = os.path.join(cache_dir(), "graphrt_build_locks")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{key}.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _worker(exported_path: str, spec_path: str, out: str) -> None:
    import graphrt.kernels  # noqa: F401  (the graph calls graphrt:: ops)

    exported = torch.export.load(exported_path)
    with open(spec_path) as f:
        spec_text = f.read()
    spec = json.loads(spec_text)
    exported._example_inputs = (tuple(_empty(s) for s in spec["inputs"]), {})
    exported._state_dict = {n: _empty(s) for n, s in spec["weights"].items()}
    with same_graph_lock(exported.graph_module.code, spec_text):
        compile_package(exported, out)


class PackagedGraph:
    """A loaded package over the engine's weights (``constants``: {name: tensor}, read in place),
    called with its inputs: the step graph's flat inputs less the weights, in the traced order.

    The loader is called directly: no pytree specs parsed per call, and loading imports neither
    torch.export nor Dynamo (a second of start-up)."""

    def __init__(self, path: str, constants: dict[str, torch.Tensor]) -> None:
        import graphrt.kernels  # noqa: F401  (the package calls graphrt:: ops: register them first)

        self.loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
        wanted = self.loader.get_constant_fqns()  # the weights the graph reads
        missing = [n for n in wanted if n not in constants]
        if missing:
            raise RuntimeError(f"package {path} reads weights this model does not have: {missing[:3]}")
        # user-managed: the package keeps these very tensors, no copy
        self.loader.load_constants({n: constants[n] for n in wanted}, False, True, True)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.loader.boxed_run(list(inputs)))  # boxed_run empties the list it is given


def load_package(path: str, constants: dict[str, torch.Tensor]) -> PackagedGraph:
    return PackagedGraph(path, constants)


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
