"""``graphrt bench startup``: a cold start (empty graph, weights and Inductor caches) against the
warm start after it (the caches the cold run filled), each in a fresh process, in one run.

Both runs use a per-user cache of their own (the native kernel library is copied into it: it is
built once per installation, not per start); ``--graph-cache DIR`` measures a shipped cache instead."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import graphrt
from graphrt.runner.graph_cache import CaptureSizes
model, cache, dtype = (None if sys.argv[1] == "-" else sys.argv[1]), sys.argv[2], sys.argv[3]
llm = graphrt.LLM(model, dtype=dtype, graph_cache=None if cache == "-" else cache, max_num_seqs=1,
                  max_num_batched_tokens=64, max_model_len=256, progress=False,
                  capture_sizes=CaptureSizes(decode=(1,), mixed=(64,)))
prompt = list(range(100, 132))
first = llm.generate([prompt], graphrt.SamplingParams(max_tokens=1, temperature=0))
ttft = time.perf_counter() - t0
llm.generate([prompt], graphrt.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
total = time.perf_counter() - t0
from torch._dynamo.utils import counters  # after the clock: importing it costs a warm start a second
print(json.dumps({"ttft_s": ttft, "total_s": total, "compiles": llm.stats()["compiles"],
                  "dynamo_graphs": counters["stats"]["unique_graphs"], "how": [r.how for r in llm.capture_report()],
                  "token": first[0].token_ids, "startup": llm.engine.startup_seconds}))
"""


def _run(model: str | None, cache: str, dtype: str, user_cache: str) -> dict:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="graphrt-inductor-"),
        "GRAPHRT_CACHE_DIR": user_cache,
    }
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
    from graphrt.user_cache import cache_root

    user_cache = tempfile.mkdtemp(prefix="graphrt-user-cache-")
    if (cache_root() / "native").is_dir():
        shutil.copytree(cache_root() / "native", os.path.join(user_cache, "native"))
    cold = _run(model, cache or "-", dtype, user_cache)  # nothing cached: converts and compiles
    warm = _run(model, cache or "-", dtype, user_cache)  # what the cold run left; a fresh Inductor cache
    result = {
        "cold": cold,
        "warm": warm,
        "graph_cache": cache or os.path.join(user_cache, "graphs"),
        "ttft_ratio": warm["ttft_s"] / cold["ttft_s"],
        "total_ratio": warm["total_s"] / cold["total_s"],
    }
    for name in ("cold", "warm"):
        r = result[name]
        print(
            f"{name}: first token {r['ttft_s']:.2f} s, total {r['total_s']:.2f} s, process {r['process_s']:.2f} s, "
            f"compiles {r['compiles']}, dynamo graphs {r['dynamo_graphs']}, graphs {r['how']}; start-up: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in r["startup"].items())
        )
    print(
        f"warm/cold: first token {100 * result['ttft_ratio']:.1f}%, total {100 * result['total_ratio']:.1f}%, "
        f"same first token: {cold['token'] == warm['token']}"
    )
    return result
