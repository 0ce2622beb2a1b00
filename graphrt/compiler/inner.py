"""Inner backends: what compiles the graph once graphrt's passes have rewritten it.

Each takes the rewritten torch-level GraphModule and its example inputs and returns a callable
over the flat inputs. The NPU backend plugs in here and nowhere else.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch.fx as fx

CompiledFn = Callable[..., tuple]

# Inductor settings every CPU graph is built with (in process and in AOTInductor packages).
# min_chunk_size: a C++ kernel runs on one thread unless each thread gets this many elements
# (Inductor's default, 512, forks both threads for a batch-8 decode step's norms and rotary over
# 8 x 576 values: microseconds of work against a fork and join each; 4096 keeps them on one
# thread and leaves prefill's kernels parallel). A batch-8 int8 decode step, 8192 against 512,
# three interleaved pairs on an Intel Xeon: 563 / 529 / 502 against 525 / 513 / 497 tokens/s.
# 4096 against 8192 splits the SiLU over 8 x 1536 values, the one kernel between them (18 us a
# layer on one thread, its exp and division): a batch-8 bf16 step on an AMD EPYC 10.60-11.86
# against 11.14-12.02 ms (two processes each, alternated), fp32 the same within 1%.
INDUCTOR_OPTIONS = {"cpp.min_chunk_size": 4096}


class InnerBackendError(RuntimeError):
    """An inner backend could not compile a graph, for a reason it states itself."""


def inductor(gm: fx.GraphModule, example_inputs: list) -> CompiledFn:
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    with inductor_config.patch(INDUCTOR_OPTIONS):
        return compile_fx(gm, example_inputs)


def eager(gm: fx.GraphModule, example_inputs: list) -> CompiledFn:
    """Run the rewritten graph as Python: for debugging passes and for tests."""
    return gm.forward


def torchair(
    gm: fx.GraphModule, example_inputs: list, torchair_mode: str = "max-autotune", ship: bool = False
) -> CompiledFn:
    """Ascend NPU through TorchAir (graphrt.npu.backend); without an NPU, converted and replayed.
    ``ship``: keep the graph's shippable form for the graph cache."""
    from graphrt.npu.backend import compile_step

    return compile_step(gm, example_inputs, torchair_mode, ship)


INNER_BACKENDS: dict[str, Callable[..., CompiledFn]] = {
    "inductor": inductor,
    "eager": eager,
    "torchair": torchair,
}


def get_inner_backend(name: str, **options) -> Callable[[fx.GraphModule, list], CompiledFn]:
    """The backend called ``name``; ``options`` go to the backends that take them (torchair_mode)."""
    if name not in INNER_BACKENDS:
        raise ValueError(f"backend {name!r} is not known; backends: {list(INNER_BACKENDS)}")
    if name == "torchair" and options:
        return functools.partial(torchair, **options)
    return INNER_BACKENDS[name]
