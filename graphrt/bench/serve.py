"""``graphrt bench serve``: a load test of ``graphrt serve`` on loopback against offline
``LLM.generate`` throughput on the same prompts, in the same run.

The server runs in its own process (as deployed), started with the same engine settings and the
per-user graph cache this process has just filled, so it starts warm. Clients are asyncio
streams in this process: ``--concurrency`` of them keep the server busy until ``--requests``
requests are done (or ``--time-limit`` seconds pass). Offline throughput is measured before and
after the load, and their mean is the reference (the machine drifts between runs).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx

from graphrt.bench.common import median

DATA = os.path.join(os.path.dirname(__file__), "data", "repeat_snippet.txt")


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _prompts(tokenizer, count: int, lengths=(32, 64, 96, 128)) -> list[list[int]]:
    with open(DATA) as f:
        ids = tokenizer.encode(f.read())
    while len(ids) < 1024:
        ids = ids + ids
    return [ids[(37 * i) % 512 :][: lengths[i % len(lengths)]] for i in range(count)]


def _start_server(settings: dict, port: int, model: str | None, dtype: str, graph_cache: str | None):
    args = [sys.executable, "-m", "graphrt.cli", "serve", "--port", str(port), "--dtype", dtype]
    args += ["--max-queued", "4096", "--served-model-name", "bench"]
    if model:
        args += ["--model", model]
    if graph_cache:
        args += ["--graph-cache", graph_cache]
    for name, value in settings.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"graphrt serve exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("graphrt serve did not start within 600 s")


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    times, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    return {
        "ttft": times[0] - sent if times else float("nan"),
        "gaps": [b - a for a, b in zip(times, times[1:])],
        "tokens": tokens,
    }


async def _load(url: str, prompts, max_tokens: int, concurrency: int, time_limit: float) -> dict:
    queue = list(reversed(prompts))
    results = []
    deadline = time.perf_counter() + time_limit

    async def worker(client):
        while queue and time.perf_counter() < deadline:
            results.append(await _one(client, url, queue.pop(), max_tokens))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=time_limit, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft"] for r in results]
    out_tokens = sum(r["tokens"] for r in results)
    return {
        "requests": len(results),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "output_tokens_per_s": out_tokens / wall,
        "ttft_p50_ms": 1e3 * median(ttfts),
        "ttft_p99_ms": 1e3 * _percentile(ttfts, 0.99),
        "itl_p50_ms": 1e3 * median(gaps),
        "itl_p99_ms": 1e3 * _percentile(gaps, 0.99),
    }


def _offline(llm, prompts, max_tokens: int) -> float:
    from graphrt.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def bench_serve(
    model: str | None,
    dtype: str,
    graph_cache: str | None,
    requests: int,
    concurrency: int,
    max_tokens: int,
    max_num_seqs: int,
    time_limit: float,
    port: int,
) -> dict:
    from graphrt.llm import LLM

    settings = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 256}
    llm = LLM(model, dtype=dtype, graph_cache=graph_cache, progress=False, **settings)  # compiles what is missing
    prompts = _prompts(llm.tokenizer, requests)
    # Each side first runs the whole workload once: the KV cache is allocated untouched (calloc),
    # and the first pass over its pages pays their page faults (measured: 20-30% of a pass).
    _offline(llm, prompts, max_tokens)
    before = _offline(llm, prompts, max_tokens)
    proc, url = _start_server(settings, port, model, dtype, graph_cache)
    try:
        asyncio.run(_load(url, prompts, max_tokens, concurrency, time_limit))
        served = asyncio.run(_load(url, prompts, max_tokens, concurrency, time_limit))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    after = _offline(llm, prompts, max_tokens)
    offline = (before + after) / 2
    result = {
        "requests": requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "max_num_seqs": max_num_seqs,
        "offline_tokens_per_s": offline,
        "offline_runs": [before, after],
        "server": served,
        "server_over_offline": served["output_tokens_per_s"] / offline,
    }
    s = served
    print(
        f"{requests} requests, {concurrency} concurrent clients, {max_tokens} tokens each, max_num_seqs={max_num_seqs}"
    )
    print(f"  offline LLM.generate : {offline:7.1f} output tokens/s  (runs {before:.1f}, {after:.1f})")
    print(
        f"  graphrt serve        : {s['output_tokens_per_s']:7.1f} output tokens/s, "
        f"{s['requests_per_s']:.2f} requests/s  ({result['server_over_offline']:.1%} of offline; "
        f"{s['requests']} requests done)"
    )
    print(f"  time to first token  : p50 {s['ttft_p50_ms']:.0f} ms, p99 {s['ttft_p99_ms']:.0f} ms")
    print(f"  inter-token latency  : p50 {s['itl_p50_ms']:.1f} ms, p99 {s['itl_p99_ms']:.1f} ms")
    return result
