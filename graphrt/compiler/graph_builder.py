"""Build the graph behind one key: load it from the graph cache, or capture and compile it (and,
with a graph cache, store it there first)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from graphrt.artifacts.cache_key import environment, weights_fingerprint
from graphrt.artifacts.store import ArtifactError, ArtifactStore
from graphrt.compiler import aoti
from graphrt.compiler.capture import capture
from graphrt.passes import PassManager
from graphrt.runner.graph_key import GraphKey
from graphrt.runner.input_buffers import ARG_NAMES, InputBuffers


def describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)}:{t.dtype}"


@dataclass
class LoadedGraph:
    """A graph from the graph cache, bound to its inputs (checked against the key once)."""

    name: str
    fn: object
    inputs: list[torch.Tensor]

    def __call__(self):
        return self.fn(*self.inputs)


class GraphBuilder:
    def __init__(
        self,
        step: torch.nn.Module,
        kv_caches,
        passes: PassManager,
        backend: str,
        store: ArtifactStore | None,
        model_key: dict,
    ) -> None:
        self.step, self.kv_caches, self.passes, self.backend = step, kv_caches, passes, backend
        self.store = store if backend == "inductor" else None  # eager / torchair keep no artifacts
        self.model_key = model_key
        self.weights = dict([*step.named_parameters(), *step.named_buffers()])

    def signature(self, bufs: InputBuffers) -> dict:
        return {
            "args": {n: describe(t) for n, t in zip(ARG_NAMES, bufs.args())},
            "kv_caches": [describe(self.kv_caches[0][0]), len(self.kv_caches)],
            "weights": {n: describe(t) for n, t in self.weights.items()},
        }

    def cache_key(self, key: GraphKey, bufs: InputBuffers) -> dict:
        key = {
            "graph": key.name,
            "model": self.model_key,
            "passes": self.passes.uuid(),
            "inputs": self.signature(bufs),
            **environment(),
        }
        return json.loads(json.dumps(key, sort_keys=True, default=str))  # the form the manifest keeps

    def build(self, key: GraphKey, bufs: InputBuffers):
        """Returns (graph, "compiled" | "loaded", seconds)."""
        start = time.perf_counter()
        if self.store is None:
            graph = capture(self.step, bufs.args(), self.kv_caches, self.passes, self.backend, key.name)
            return graph, "compiled", time.perf_counter() - start
        ckey = self.cache_key(key, bufs)
        hit = self.store.lookup(ckey)
        how = "loaded"
        if hit is None:
            graph = capture(self.step, bufs.args(), self.kv_caches, self.passes, "eager", key.name)
            extra = {"sources": graph.sources, "kv_num_blocks": int(self.kv_caches[0][0].shape[0])}
            hit = self.store.put(ckey, lambda tmp: aoti.build_package(graph.gm, graph.inputs, tmp), extra)
            how = "compiled"
        path, entry = hit
        inputs = [self.resolve(tuple(s), bufs) for s in entry["sources"]]
        return LoadedGraph(key.name, aoti.load_package(path), inputs), how, time.perf_counter() - start

    def resolve(self, source: tuple, bufs: InputBuffers) -> torch.Tensor:
        kind = source[0]
        if kind == "arg":
            return bufs.args()[source[1]]
        if kind == "kv":
            return self.kv_caches[source[1]][source[2]]
        if kind == "param" and source[1] in self.weights:
            return self.weights[source[1]]
        raise ArtifactError(f"graph cache entry names an input {source} this model does not have")


def model_key(config_dict: dict, dtype: torch.dtype, model: torch.nn.Module, block_size: int) -> dict:
    key = {"config": config_dict, "dtype": str(dtype), "weights": weights_fingerprint(model), "block_size": block_size}
    return json.loads(json.dumps(key, sort_keys=True, default=str))
