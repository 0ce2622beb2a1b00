"""``graphrt bench startup``: cold start (empty compile caches) against warm start from a
precompiled graph cache, each in a fresh process, measured in one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import graphrt
from graphrt.runner.graph_cache import CaptureSizes
from torch._dynamo.utils import counters
model, cache, dtype = (None if sys.argv[1] == "-" else sys.argv[1]), sys.argv[2], sys.argv[3]
llm = graphrt.LLM(model, dtype=dtype, graph_cache=cache, max_num_seqs=1, max_num_batched_tokens=64,
                  max_model_len=256, progress=False, capture_sizes=CaptureSizes(decode=(1,), mixed=(64,)))
prompt = list(range(100, 132))
first = llm.generate([prompt], graphrt.SamplingParams(max_tokens=1, temperature=0))
ttft = time.perf_counter() - t0
llm.generate([prompt], graphrt.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
print(json.dumps({"ttft_s": ttft, "total_s": time.perf_counter() - t0, "compiles": llm.stats()["compiles"],
                  "dynamo_graphs": counters["stats"]["unique_graphs"], "how": [r.how for r in llm.capture_report()],
                  "token": first[0].token_ids}))
"""


def _run(model: str | None, cache: str, dtype: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="graphrt-inductor-")}
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model or "-", cache, dtype], capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(f"start-up child failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    return result


def bench_startup(model: str | None, dtype: str, cache: str | None = None) -> dict:
    cache = cache or tempfile.mkdtemp(prefix="graphrt-graphs-")
    cold = _run(model, cache, dtype)  # empty graph cache, empty Inductor cache: compiles
    warm = _run(model, cache, dtype)  # the graph cache it wrote, a fresh empty Inductor cache
    result = {
        "cold": cold,
        "warm": warm,
        "graph_cache": cache,
        "ttft_ratio": warm["ttft_s"] / cold["ttft_s"],
        "total_ratio": warm["total_s"] / cold["total_s"],
    }
    for name in ("cold", "warm"):
        r = result[name]
        print(
            f"{name}: first token {r['ttft_s']:.2f} s, total {r['total_s']:.2f} s, process {r['process_s']:.2f} s, "
            f"compiles {r['compiles']}, dynamo graphs {r['dynamo_graphs']}, graphs {r['how']}"
        )
    print(
        f"warm/cold: first token {100 * result['ttft_ratio']:.1f}%, total {100 * result['total_ratio']:.1f}%, "
        f"same first token: {cold['token'] == warm['token']}"
    )
    return result
