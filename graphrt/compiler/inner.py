"""Inner backends: what compiles the graph once graphrt's passes have rewritten it.

Each takes the rewritten torch-level GraphModule and its example inputs and returns a callable
over the flat inputs. The NPU backend plugs in here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

CompiledFn = Callable[..., tuple]


def inductor(gm: fx.GraphModule, example_inputs: list) -> CompiledFn:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def eager(gm: fx.GraphModule, example_inputs: list) -> CompiledFn:
    """Run the rewritten graph as Python: for debugging passes and for tests."""
    return gm.forward


def torchair(gm: fx.GraphModule, example_inputs: list) -> CompiledFn:
    """Ascend NPU through TorchAir (GE graph). Unverified here: it needs torch_npu and CANN."""
    import torch_npu  # noqa: F401  (lazy: importing it without CANN breaks torch)
    from torch_npu.dynamo import torchair as tng

    from graphrt.kernels.npu import register_npu_kernels

    register_npu_kernels()
    config = tng.CompilerConfig()
    return tng.get_npu_backend(compiler_config=config)(gm, example_inputs)


INNER_BACKENDS: dict[str, Callable[[fx.GraphModule, list], CompiledFn]] = {
    "inductor": inductor,
    "eager": eager,
    "torchair": torchair,
}


def get_inner_backend(name: str) -> Callable[[fx.GraphModule, list], CompiledFn]:
    if name not in INNER_BACKENDS:
        raise ValueError(f"backend {name!r} is not known; backends: {list(INNER_BACKENDS)}")
    return INNER_BACKENDS[name]
