"""Build the graph behind one key: load it from the graph cache, or capture and compile it (and,
with a graph cache, store it there first)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import torch

from graphrt.artifacts.cache_key import environment, weights_fingerprint
from graphrt.artifacts.store import ArtifactError, ArtifactStore
from graphrt.compiler import aoti
from graphrt.compiler.capture import CapturedGraph, capture
from graphrt.passes import PassManager
from graphrt.runner.graph_key import GraphKey
from graphrt.runner.input_buffers import InputBuffers

log = logging.getLogger("graphrt.compiler")


def describe(t: torch.Tensor, free: dict[int, str] | None = None) -> str:
    free = free or {}
    shape = ",".join("*" if d in free else str(n) for d, n in enumerate(t.shape))
    return f"({shape}):{t.dtype}"


@dataclass
class LoadedGraph:
    """A graph from the graph cache, bound to its inputs (checked against the key once)."""

    name: str
    fn: object
    inputs: list[torch.Tensor]
    gm: torch.fx.GraphModule | None = None  # the rewritten graph, when this process built it

    def __call__(self):
        return self.fn(*self.inputs)


@dataclass
class PendingGraph:
    """A graph whose package a worker process is building."""

    key: GraphKey
    bufs: InputBuffers
    ckey: dict
    tmp: str
    build: aoti.PackageBuild
    graph: CapturedGraph
    start: float


class GraphBuilder:
    def __init__(
        self,
        step: torch.nn.Module,
        kv_caches,
        passes: PassManager,
        backend: str,
        store: ArtifactStore | None,
        model_key: dict,
        inner_options: dict | None = None,
    ) -> None:
        # one module per step kind ("main", "verify"); they share the model and its weights
        self.steps = step if isinstance(step, dict) else {"main": step}
        self.step = self.steps["main"]
        self.kv_caches, self.passes, self.backend = kv_caches, passes, backend
        self.store = store if backend in ("inductor", "torchair") else None  # the eager backend keeps none
        self.model_key = model_key
        self.inner_options = inner_options or {}  # the inner backend's settings (torchair_mode)
        self.weights = dict([*self.step.named_parameters(), *self.step.named_buffers()])

    def signature(self, bufs: InputBuffers, free: bool) -> dict:
        """Shapes and dtypes of every input; with ``free``, the sizes a package leaves free are *."""
        kv = self.kv_caches[0][0]
        width = bufs.block_tables.shape[1]
        arg_free = {"block_tables": {1: "max_blocks"}} if free and width >= 2 else {}
        return {
            "args": {n: describe(t, arg_free.get(n)) for n, t in zip(bufs.names, bufs.args())},
            "kv_caches": [describe(kv, {0: "num_blocks"} if free and kv.shape[0] >= 2 else None), len(self.kv_caches)],
            "weights": {n: describe(t) for n, t in self.weights.items()},
        }

    def cache_key(self, key: GraphKey, bufs: InputBuffers, free: bool = True) -> dict:
        key = {
            "graph": key.name,
            "step": step_variant(self.steps[key.kind]),
            "model": self.model_key,
            "passes": self.passes.uuid(),
            "inner": self.inner_options,
            "inputs": self.signature(bufs, free),
            **environment(),
        }
        return json.loads(json.dumps(key, sort_keys=True, default=str))  # the form the manifest keeps

    def cached(self, key: GraphKey, bufs: InputBuffers) -> tuple[str, dict] | None:
        """The verified entry for this key: one with free sizes, else one built for these sizes."""
        for free in (True, False):
            hit = self.store.lookup(self.cache_key(key, bufs, free), quiet=True)
            if hit is not None:
                return hit
        self.store.explain_miss(self.cache_key(key, bufs, True))
        return None

    def build(self, key: GraphKey, bufs: InputBuffers):
        """Returns (graph, "compiled" | "loaded", seconds), waiting for a build if one is needed."""
        out = self.start(key, bufs)
        return self.finish(out) if isinstance(out, PendingGraph) else out

    def start(self, key: GraphKey, bufs: InputBuffers):
        """(graph, how, seconds) when the graph is ready now; a PendingGraph when its package is
        being built in a worker process (``finish`` waits for it)."""
        start = time.perf_counter()
        if self.store is None:
            step = self.steps[key.kind]
            graph = capture(step, bufs.args(), self.kv_caches, self.passes, self.backend, key.name, self.inner_options)
            return graph, "compiled", time.perf_counter() - start
        if self.backend == "torchair":
            return self.start_torchair(key, bufs, start)
        hit = self.cached(key, bufs)
        if hit is not None:
            return self.load(key, bufs, hit), "loaded", time.perf_counter() - start
        graph = capture(self.steps[key.kind], bufs.args(), self.kv_caches, self.passes, "eager", key.name)
        free = aoti.free_dims(graph.sources, graph.inputs, bufs.names.index("block_tables"))
        try:  # a graph whose code came to depend on those sizes (an unfused spelling) keeps them
            exported, ckey = aoti.export(graph.gm, graph.sources, graph.inputs, free), self.cache_key(key, bufs, True)
        except Exception as e:
            log.warning("graph %s: KV and block-table sizes cannot stay free (%s); built for these sizes", key.name, e)
            exported, ckey = aoti.export(graph.gm, graph.sources, graph.inputs), self.cache_key(key, bufs, False)
        tmp = self.store.reserve(ckey)
        try:
            build = aoti.PackageBuild(exported, aoti.split_inputs(graph.sources, graph.inputs)[0], tmp)
        except BaseException:
            self.store.discard(tmp)
            raise
        return PendingGraph(key, bufs, ckey, tmp, build, graph, start)

    def start_torchair(self, key: GraphKey, bufs: InputBuffers, start: float):
        """TorchAir graphs in the graph cache: TorchAir's generated code holding the GE graph
        (max-autotune), converted wherever TorchAir imports and loaded on an NPU. Off the NPU a
        cached graph cannot run: the step is converted again for the eager replay, and the entry
        stays as it is."""
        from graphrt.npu import backend as npu_backend
        from graphrt.npu import torchair_package

        hit = self.cached(key, bufs)
        if hit is not None and torchair_package.has_torch_npu():
            path, entry = hit
            inputs = [self.resolve(tuple(s), bufs) for s in entry["sources"]]
            graph = LoadedGraph(key.name, npu_backend.load_artifact(path), inputs)
            return graph, "loaded", time.perf_counter() - start
        options = {**self.inner_options, "ship": hit is None}
        step = self.steps[key.kind]
        graph = capture(step, bufs.args(), self.kv_caches, self.passes, self.backend, key.name, options)
        code = getattr(graph.fn, "artifact", None)
        if hit is None and code is not None:

            def write(tmp: str) -> None:
                with open(tmp, "w") as f:
                    f.write(code)

            self.store.put(self.cache_key(key, bufs, free=False), write, {"sources": graph.sources})
        return graph, "compiled", time.perf_counter() - start

    def finish(self, pending: PendingGraph):
        try:
            pending.build.wait()
        except BaseException:
            self.store.discard(pending.tmp)
            raise
        extra = {"sources": pending.graph.sources, "kv_num_blocks": int(self.kv_caches[0][0].shape[0])}
        hit = self.store.publish(pending.ckey, pending.tmp, extra)
        graph = self.load(pending.key, pending.bufs, hit, pending.graph.gm)
        return graph, "compiled", time.perf_counter() - pending.start

    def load(self, key: GraphKey, bufs: InputBuffers, hit: tuple[str, dict], gm=None) -> LoadedGraph:
        path, entry = hit
        sources = [tuple(s) for s in entry["sources"]]
        inputs, weights = aoti.split_inputs(sources, [self.resolve(s, bufs) for s in sources])
        return LoadedGraph(key.name, aoti.load_package(path, weights), inputs, gm)

    def resolve(self, source: tuple, bufs: InputBuffers) -> torch.Tensor:
        kind = source[0]
        if kind == "arg":
            return bufs.args()[source[1]]
        if kind == "kv":
            return self.kv_caches[source[1]][source[2]]
        if kind == "param" and source[1] in self.weights:
            return self.weights[source[1]]
        raise ArtifactError(f"graph cache entry names an input {source} this model does not have")


def step_variant(step: torch.nn.Module) -> dict:
    """What a step module computes beyond its inputs' shapes: hidden states returned (an MTP
    engine's main and verify graphs), the drafts an MTP graph chains, verification by draft
    distributions."""
    return {
        "hidden_out": bool(getattr(step, "return_hidden", False)),
        "k": int(getattr(step, "k", 0)),
        "draft_probs": bool(getattr(step, "draft_probs", False)),
    }


def model_key(config_dict: dict, dtype: torch.dtype, model: torch.nn.Module, block_size: int) -> dict:
    key = {"config": config_dict, "dtype": str(dtype), "weights": weights_fingerprint(model), "block_size": block_size}
    return json.loads(json.dumps(key, sort_keys=True, default=str))
