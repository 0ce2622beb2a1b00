"""TorchAir as an inner backend: graphrt's rewritten step → one Ascend graph (GE, ``max-autotune``)
or one captured ACL graph (``reduce-overhead``) per graph key.

The configuration is the one LLM deployments of TorchAir use: weights as frozen parameters (not
re-checked per step), tiling scheduled once, static shapes (one graph per key, no dynamic dims:
the capture already runs ``dynamic=False``), and input mutations kept in the graph so the KV
caches are written in place. Without an NPU the graph is converted exactly as on one and then
replayed eagerly (``debug.run_eagerly``): the Ascend IR is real, its execution is not.
"""

from __future__ import annotations

import collections
import logging
import os
import pathlib
import re
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch.fx as fx

from graphrt.compiler.inner import InnerBackendError
from graphrt.npu import standins, torchair_package

log = logging.getLogger("graphrt.npu")

MODES = ("max-autotune", "reduce-overhead")


class TorchAirConversionError(InnerBackendError):
    """TorchAir could not convert a graphrt step graph (an op without an Ascend lowering)."""


@dataclass
class TorchAirGraph:
    """A step graph compiled by TorchAir, with the Ascend IR it became (GE mode)."""

    fn: object
    mode: str
    ascend_ops: collections.Counter = field(default_factory=collections.Counter)  # op type → count
    ir_text: str = ""  # the optimised GE graph as protobuf text
    context: Callable[[], AbstractContextManager] = nullcontext  # around every call
    artifact: str | None = None  # with ship=True: TorchAir's generated code holding the GE graph

    def __call__(self, *args):
        with self.context():
            return self.fn(*args)


def compiler_config(torchair, mode: str, dump_dir: str | None, on_npu: bool):
    if mode not in MODES:
        raise ValueError(f"torchair_mode {mode!r} is not known; modes: {list(MODES)}")
    cfg = torchair.CompilerConfig()
    cfg.mode = mode
    cfg.experimental_config.frozen_parameter = True
    cfg.experimental_config.tiling_schedule_optimize = True
    cfg.experimental_config.keep_inference_input_mutations = True
    if not on_npu:
        cfg.debug.run_eagerly = True
        # TorchAir's own pattern fusions rewrite aten chains into torch_npu ops, which have no
        # body off the NPU (graphrt's passes have fused what matters already)
        cfg.experimental_config.pattern_fusion_pass = False
    if dump_dir is not None:
        cfg.debug.graph_dump.type = "txt"  # the GraphDef in protobuf text format
        cfg.debug.graph_dump.path = dump_dir
    return cfg


def read_ir(dump_dir: pathlib.Path) -> tuple[collections.Counter, str]:
    """The op types of the optimised GE graph TorchAir dumped into ``dump_dir``."""
    dumps = sorted(dump_dir.glob("dynamo_optimized_*.txt")) or sorted(dump_dir.glob("*.txt"))
    if not dumps:
        return collections.Counter(), ""
    text = dumps[-1].read_text()
    from google.protobuf import text_format
    from torchair._ge_concrete_graph.ge_ir_pb2 import GraphDef

    graph = text_format.Parse(text, GraphDef())
    return collections.Counter(op.type for op in graph.op), text


def failing_op(e: BaseException) -> str:
    """The op TorchAir's error names (its converter's message, or the FX node it was converting)."""
    text = str(e)
    found = re.search(r"(torch\.ops\.[\w.]+) ge_converter", text) or re.search(r"target=([\w.]+)", text)
    if found is None:
        found = re.search(r"No AscendIR (\w+) was found", text)
    return f"op {found.group(1)}" if found else "an op"


def compile_shippable(torchair, gm: fx.GraphModule, example_inputs: list, cfg, decompositions: dict, on_npu: bool):
    """TorchAir's backend as ``get_npu_backend`` builds it, keeping what its own ``cache_compile``
    ships: the generated Python that holds the serialized GE graph. Off the NPU the graph then
    replays eagerly (its optimised FX graph), exactly as with ``debug.run_eagerly``."""
    from torchair.npu_fx_compiler import _compile_graph_with_aot, _get_merged_decompositions, get_compiler

    cfg.debug.run_eagerly = False  # the concrete GE graph, not its FX fallback, is what gets coded
    compiler = get_compiler(cfg)
    codes: list[str] = []

    def recording(fw_gm, fw_inputs):
        compiled = compiler(fw_gm, fw_inputs)
        codes.append(compiled.dump_artifacts().py_code)
        return compiled if on_npu else compiled.runner.fx_graph

    merged = _get_merged_decompositions(cfg, decompositions)
    fn = _compile_graph_with_aot(gm, recording, example_inputs, cfg, merged)
    return fn, codes[0]


def load_artifact(path: str):
    """The kernel of a shipped TorchAir graph (``compile_shippable``'s code): it loads anywhere
    TorchAir imports; calling it compiles and runs the GE graph, which needs an NPU."""
    from torchair.npu_fx_compiler import _compile_py_code

    torchair_package.load()
    with open(path) as f:
        return _compile_py_code(f.read()).kernel


def compile_step(
    gm: fx.GraphModule, example_inputs: list, mode: str = "max-autotune", ship: bool = False
) -> TorchAirGraph:
    """``ship``: also keep the graph's shippable form (max-autotune), for the graph cache."""
    torchair = torchair_package.load()
    from graphrt.kernels import npu_ge

    npu_ge.register_ge_converters(torchair)
    on_npu = torchair_package.has_torch_npu()
    if on_npu:
        from graphrt.kernels.npu import register_npu_kernels

        register_npu_kernels()
    # GE graphs are dumped (and their operators listed) off the NPU, where converting is the point,
    # and on an NPU when GRAPHRT_TORCHAIR_DUMP names a folder to keep the dumps in
    keep = os.environ.get("GRAPHRT_TORCHAIR_DUMP")
    with tempfile.TemporaryDirectory(prefix="graphrt-torchair-") as tmp:
        dump = keep or tmp
        if keep:
            os.makedirs(keep, exist_ok=True)
        listed = mode == "max-autotune" and (not on_npu or keep)
        cfg = compiler_config(torchair, mode, dump if listed else None, on_npu)
        decompositions = npu_ge.decompositions()
        # off the NPU, TorchAir's ACL path (and the code it generates) imports torch_npu even for an eager replay
        replay = standins.acl_replay_stand_ins if mode != "max-autotune" and not on_npu else nullcontext
        ship = ship and mode == "max-autotune"
        artifact = None
        try:
            with replay():
                if ship:
                    fn, artifact = compile_shippable(torchair, gm, example_inputs, cfg, decompositions, on_npu)
                else:
                    backend = torchair.get_npu_backend(compiler_config=cfg, custom_decompositions=decompositions)
                    fn = backend(gm, example_inputs)
        except standins.NoNPU:
            raise
        except (NotImplementedError, RuntimeError, TypeError) as e:
            raise TorchAirConversionError(f"{failing_op(e)} could not be lowered by TorchAir ({mode}): {e}") from e
        ops, text = read_ir(pathlib.Path(dump)) if listed else (collections.Counter(), "")
    return TorchAirGraph(fn, mode, ops, text, replay, artifact)
