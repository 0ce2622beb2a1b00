"""``graphrt bench serve``: a load test of ``graphrt serve`` on loopback against offline
``LLM.generate`` throughput on the same prompts, in the same run.

The server runs in its own process (as deployed), started with the same engine settings and the
per-user graph cache this process has just filled, so it starts warm. Clients are asyncio
streams in this process: ``--concurrency`` of them keep the server busy until ``--requests``
requests are done (or ``--time-limit`` seconds pass). Offline and served passes over the same
prompts alternate, and their medians are compared (the machine drifts between runs).
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
    args += ["--max-queued", "4096", "--served-model-name", "bench", "--prefault-kv-cache"]
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


async def _one(host: str, port: int, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion over a plain asyncio connection: the load generator shares the
    machine's two cores with the server, so it parses no more than it must (an httpx client
    took about twice the CPU per chunk)."""
    body = json.dumps(
        {
            "model": "bench",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    sent = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(head + body)
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"graphrt serve answered {status.decode().strip()}: {(await reader.read()).decode()}")
    while (await reader.readline()) not in (b"\r\n", b""):
        pass  # headers
    times, tokens, pending = [], 0, b""
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)  # chunked transfer encoding
        if size == 0:
            break
        pending += (await reader.readexactly(size + 2))[:-2]
        now = time.perf_counter()
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: {"):
                continue
            chunk = json.loads(event[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(now)
    writer.close()
    return {
        "ttft": times[0] - sent if times else float("nan"),
        "gaps": [b - a for a, b in zip(times, times[1:])],
        "tokens": tokens,
    }


async def _load(url: str, prompts, max_tokens: int, concurrency: int, time_limit: float) -> dict:
    host, port = url.removeprefix("http://").split(":")
    queue = list(reversed(prompts))
    results = []
    deadline = time.perf_counter() + time_limit

    async def worker():
        while queue and time.perf_counter() < deadline:
            results.append(await asyncio.wait_for(_one(host, int(port), queue.pop(), max_tokens), time_limit))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
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
        "itl_max_ms": 1e3 * max(gaps, default=float("nan")),
    }


def _cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU seconds so far: the server process, its main thread (uvicorn's event loop) and this
    process (the load generator). Linux's /proc; NaN elsewhere."""
    import resource

    def proc_stat(path: str) -> float:
        try:
            with open(path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            return float("nan")

    me = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "server": proc_stat(f"/proc/{server_pid}/stat"),
        "event_loop": proc_stat(f"/proc/{server_pid}/task/{server_pid}/stat"),
        "load_generator": me.ru_utime + me.ru_stime,
    }


def _wait_warmed(stats, timeout: float = 600.0) -> None:
    """Until an engine's KV pages are all faulted in (``stats()`` without ``warmed_blocks``: the
    kernel lacks the advice, nothing to wait for)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = stats()
        if s.get("warmed_blocks") is None or s["warmed_blocks"] > s["total_blocks"]:  # the null block too
            return
        time.sleep(0.5)
    raise RuntimeError(f"the KV cache's pages were not faulted in within {timeout:.0f} s")


def _engine_stats(url: str) -> dict[str, float]:
    m = _scrape(url)
    return {"warmed_blocks": m.get("graphrt_kv_blocks_warmed"), "total_blocks": m.get("graphrt_kv_blocks_total")}


def _scrape(url: str) -> dict[str, float]:
    """The server's unlabelled Prometheus samples."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


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
    rounds: int = 3,
) -> dict:
    from graphrt.llm import LLM

    settings = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 256}
    # compiles what is missing
    llm = LLM(model, dtype=dtype, graph_cache=graph_cache, progress=False, prefault_kv_cache=True, **settings)
    prompts = _prompts(llm.tokenizer, requests)
    # Both sides measure a steady state: each KV cache is allocated untouched, and the block pool
    # hands out blocks never used before first, so until every page has been faulted in, each pass
    # pays faults on new pages (on a 2-vCPU VM, passes 2-4 of a server ran at 359-404 tokens/s
    # against 778 for a steady offline pass). Both fault in every page first (prefault_kv_cache),
    # and run the workload once. Then the two alternate, ``rounds`` times each, and the medians are
    # compared: this machine's speed drifts by 10-20% within minutes.
    _offline(llm, prompts, max_tokens)
    _wait_warmed(lambda: llm.engine.stats())
    offline_runs, served_runs = [], []
    proc, url = _start_server(settings, port, model, dtype, graph_cache)
    try:
        # a fresh server's first pass, kept apart: its pages are faulted in meanwhile (runner/page_warmer.py)
        first_pass = asyncio.run(_load(url, prompts, max_tokens, concurrency, time_limit))
        _wait_warmed(lambda: _engine_stats(url))
        for _ in range(rounds):
            offline_runs.append(_offline(llm, prompts, max_tokens))
            before = _cpu_seconds(proc.pid)
            served = asyncio.run(_load(url, prompts, max_tokens, concurrency, time_limit))
            served["cpu_s"] = {k: v - before[k] for k, v in _cpu_seconds(proc.pid).items()}
            served_runs.append(served)
        server_metrics = _scrape(url)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    offline_runs.append(_offline(llm, prompts, max_tokens))
    offline = median(offline_runs)
    served = sorted(served_runs, key=lambda r: r["output_tokens_per_s"])[len(served_runs) // 2]
    result = {
        "requests": requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "max_num_seqs": max_num_seqs,
        "offline_tokens_per_s": offline,
        "offline_runs": offline_runs,
        "server": served,
        "server_runs": [r["output_tokens_per_s"] for r in served_runs],
        "server_graph_hits": server_metrics.get("graphrt_graph_hits_total"),
        "server_graph_misses": server_metrics.get("graphrt_graph_misses_total"),
        "server_over_offline": served["output_tokens_per_s"] / offline,
        "server_first_pass": first_pass,
    }
    s = served
    print(
        f"{requests} requests, {concurrency} concurrent clients, {max_tokens} tokens each, max_num_seqs={max_num_seqs}"
    )
    runs = ", ".join(f"{x:.1f}" for x in offline_runs)
    print(f"  offline LLM.generate : {offline:7.1f} output tokens/s  (median of {runs})")
    print(
        f"  graphrt serve        : {s['output_tokens_per_s']:7.1f} output tokens/s, "
        f"{s['requests_per_s']:.2f} requests/s  ({result['server_over_offline']:.1%} of offline; "
        f"{s['requests']} requests done; the median of {', '.join(f'{x:.1f}' for x in result['server_runs'])})"
    )
    cpu = s["cpu_s"]
    print(
        f"  CPU in that pass     : server {cpu['server']:.1f} s (its event loop {cpu['event_loop']:.1f} s), "
        f"load generator {cpu['load_generator']:.1f} s, over {s['wall_s']:.1f} s on {os.cpu_count()} cores"
    )
    print(
        f"  server steps         : {result['server_graph_hits']:.0f} replayed by graphs, "
        f"{result['server_graph_misses']:.0f} misses (run eagerly)"
    )
    print(f"  time to first token  : p50 {s['ttft_p50_ms']:.0f} ms, p99 {s['ttft_p99_ms']:.0f} ms")
    print(
        f"  inter-token latency  : p50 {s['itl_p50_ms']:.1f} ms, p99 {s['itl_p99_ms']:.1f} ms, "
        f"max {s['itl_max_ms']:.0f} ms"
    )
    f = first_pass
    print(
        f"  the first pass       : {f['output_tokens_per_s']:7.1f} output tokens/s, inter-token p99 "
        f"{f['itl_p99_ms']:.1f} ms, max {f['itl_max_ms']:.0f} ms; first token p99 {f['ttft_p99_ms']:.0f} ms "
        "(a fresh server: its KV pages are faulted in meanwhile)"
    )
    return result
