"""Run graphrt's TorchAir backend on tiny models and print what it built, as JSON.

Run in its own process by tests/npu (TorchAir's import sets process-wide state: signal
handlers, an exit hook, its converter registry), so that no other test runs beside it.
Usage: python -m tests.npu.torchair_run ROOT MODEL [MODEL ...]
"""

from __future__ import annotations

import json
import math
import sys

import torch

import graphrt
from graphrt import SamplingParams
from graphrt.cli.precompile import graph_operators
from graphrt.runner.graph_cache import CaptureSizes
from tests.oracle import random_prompts
from tests.tiny_models import save_tiny, save_tiny_with_mtp

SIZES = CaptureSizes(decode=(4,), mixed=(16,))
OPTS = dict(
    dtype=torch.bfloat16, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory=2_000_000,
    capture_sizes=SIZES, graph_cache=False, progress=False,
)  # fmt: skip
PROMPTS = random_prompts([3, 21, 9], seed=20)  # 21 > 16: a chunked prefill too
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
SEEDED = [SamplingParams(max_tokens=6, temperature=0.8, top_k=20, top_p=0.9, seed=i, ignore_eos=True) for i in range(3)]


def outputs(llm) -> dict:
    greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return {
        "greedy": [o.token_ids for o in greedy],
        "logprobs": [o.logprobs for o in greedy],
        "seeded": [o.token_ids for o in llm.generate(PROMPTS, SEEDED, use_tqdm=False)],
    }


def same_outputs(a: dict, b: dict) -> bool:
    """The same tokens, and log-probabilities equal to float32 rounding: on the CPU the eager
    backend's greedy log-probabilities come from the native one-pass kernel, a TorchAir graph's
    from the sampler's aten body (log_softmax), summed in another order."""
    close = all(
        math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6)
        for rows_a, rows_b in zip(a["logprobs"], b["logprobs"], strict=True)
        for x, y in zip(rows_a, rows_b, strict=True)
    )
    return a["greedy"] == b["greedy"] and a["seeded"] == b["seeded"] and close


# each model's speculative method: its verify (and MTP) graphs convert too
SPEC = {
    "llama_gqa": {"method": "ngram", "num_speculative_tokens": 2},
    "deepseek_v3": {"method": "mtp", "num_speculative_tokens": 1},
}


def run(root: str, name: str, with_tokens: bool) -> dict:
    path = save_tiny_with_mtp(root) if name == "deepseek_v3" else save_tiny(name, root)
    opts = dict(OPTS, speculative_config=SPEC.get(name))
    out: dict = {}
    llm = graphrt.LLM(path, backend="torchair", **opts)
    out["ops"] = {key: dict(ops) for key, ops in graph_operators(llm).items()}
    out["stats"] = llm.stats()
    if with_tokens:
        out["max-autotune"] = outputs(llm)
        del llm
        # (without drafts: n-gram speculation emits plain decoding's tokens, greedy and seeded alike)
        out["reduce-overhead"] = outputs(graphrt.LLM(path, backend="torchair", torchair_mode="reduce-overhead", **OPTS))
        out["eager"] = outputs(graphrt.LLM(path, backend="eager", **OPTS))
    return out


def unconvertible() -> str:
    """The error for a graph holding an op TorchAir cannot lower."""
    from graphrt.npu.backend import compile_step

    def f(x):
        return torch.logcumsumexp(x * 2, dim=0)

    try:
        torch.compile(f, backend=compile_step, fullgraph=True)(torch.randn(4, dtype=torch.bfloat16))
    except Exception as e:  # noqa: BLE001  (reported to the test as text)
        inner = getattr(e, "inner_exception", e)
        return f"{type(inner).__name__}: {inner}"
    return "converted"


def shipped(root: str) -> dict:
    """A graph cache of TorchAir builds made off the NPU: one entry per graph, each loads and
    refuses to run here; a second engine converts again and leaves the entries as they are."""
    import os

    from graphrt.artifacts.store import ArtifactStore
    from graphrt.npu.backend import load_artifact
    from graphrt.npu.standins import NoNPU

    path = save_tiny("llama_gqa", root)
    cache = os.path.join(root, "torchair-graphs")
    opts = dict(OPTS, graph_cache=cache)
    first = graphrt.LLM(path, backend="torchair", **opts)
    entries = {e["key"]["graph"]: e for e in ArtifactStore(cache, strict=True).entries()}
    refused = []
    for key, graph in first.engine.graphs.graphs.items():
        kernel = load_artifact(os.path.join(cache, entries[key.name]["file"]))
        try:
            kernel(*graph.inputs)
            refused.append("ran")
        except NoNPU as e:
            refused.append(str(e))
    second = graphrt.LLM(path, backend="torchair", **opts)
    return {
        "graphs": sorted(k.name for k in first.engine.graphs.graphs),
        "entries": sorted(entries),
        "inner": [e["key"]["inner"] for e in entries.values()],
        "refused": refused,
        "second": [r.how for r in second.capture_report()],
        "entries_after": len(ArtifactStore(cache, strict=True).entries()),
        "same_tokens": same_outputs(outputs(second), outputs(graphrt.LLM(path, backend="eager", **OPTS))),
    }


if __name__ == "__main__":
    root, names = sys.argv[1], sys.argv[2:]
    result = {name.lstrip("+"): run(root, name.lstrip("+"), name.startswith("+")) for name in names}
    result["unconvertible"] = unconvertible()
    result["shipped"] = shipped(root)
    print("RESULT " + json.dumps(result))
