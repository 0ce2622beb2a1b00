"""``graphrt bench decode``: graphrt compiled, graphrt eager and transformers, interleaved per
batch size on the same weights, prompts and greedy settings."""

from __future__ import annotations

import os
import time

import torch

from graphrt.bench.common import machine_facts, median, p90, print_facts, write_json
from graphrt.bench.roofline import decode_step_bytes, measure_bandwidth, pages_name, streaming_reads, weight_bytes
from graphrt.bench.steal import StealMeter, steal_note


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def run_graphrt(llm, prompts: list[list[int]], gen_len: int, loras: list | None = None) -> dict:
    """``loras``: a LoRARequest (or None) per prompt."""
    from graphrt import SamplingParams

    engine = llm.engine
    inside = []
    real_run = engine.graphs.run

    def timed_run(*a, **kw):
        t = time.perf_counter()
        out = real_run(*a, **kw)
        inside.append(time.perf_counter() - t)
        return out

    engine.graphs.run = timed_run
    try:
        params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
        loras = loras or [None] * len(prompts)
        ids = [engine.add_request(p, params, lora_request=lr) for p, lr in zip(prompts, loras)]
        steps, graph_s, ttft = [], [], None
        start = time.perf_counter()
        with StealMeter() as meter:
            while engine.has_unfinished():
                inside.clear()
                made = [len(engine.output(r).token_ids) for r in ids]
                t = time.perf_counter()
                engine.step()
                dt = time.perf_counter() - t
                if ttft is None:
                    if all(engine.output(r).token_ids for r in ids):
                        ttft = time.perf_counter() - start
                else:  # a decode burst's time shared by its decode steps (tokens a row)
                    n = max(len(engine.output(r).token_ids) - m for r, m in zip(ids, made)) or 1
                    steps += [dt / n] * n
                    graph_s += [sum(inside) / n] * n
        total = time.perf_counter() - start
        tokens = sum(len(engine.output(r).token_ids) for r in ids)
        outputs = [engine.output(r).token_ids for r in ids]
        for r in ids:
            engine.release(r)
    finally:
        engine.graphs.run = real_run
    decode_tokens = tokens - len(ids)
    return {
        "decode_tok_s": decode_tokens / (total - ttft),
        "step_ms_median": 1e3 * median(steps),
        "step_ms_p90": 1e3 * p90(steps),
        "step_ms_max": 1e3 * max(steps, default=float("nan")),
        "ttft_s": ttft,
        "overhead_frac": 1 - sum(graph_s) / sum(steps) if steps else float("nan"),
        "steal_frac": meter.fraction,
        "tokens": outputs,
    }


def run_transformers(hf_model, prompts: list[list[int]], gen_len: int) -> dict:
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad(), StealMeter() as meter:
        # eos_token_id=None: like graphrt's ignore_eos, EOS may be drawn and does not stop (min_new_tokens
        # would forbid EOS instead, and change the greedy tokens wherever EOS is the argmax)
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=gen_len,
            eos_token_id=None,
            do_sample=False,
            logits_processor=LogitsProcessorList([Stamp()]),
            pad_token_id=0,
        )
    total = time.perf_counter() - start
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    ttft = stamps[0] - start
    return {
        "decode_tok_s": len(prompts) * (gen_len - 1) / (total - ttft),
        "step_ms_median": 1e3 * median(steps),
        "step_ms_p90": 1e3 * p90(steps),
        "step_ms_max": 1e3 * max(steps, default=float("nan")),
        "ttft_s": ttft,
        "overhead_frac": float("nan"),
        "steal_frac": meter.fraction,
        "tokens": out[:, ids.shape[1] :].tolist(),
    }


def load_transformers(model_path: str | None, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from graphrt.loader import default_model_path

    path = model_path or default_model_path()
    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
        ).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def bench_decode(
    model: str | None,
    dtype: str,
    batch_sizes: list[int],
    prompt_len: int,
    gen_len: int,
    graph_cache: str | None,
    with_transformers: bool = True,
    backend: str = "inductor",
    profile: str | None = None,
    vs_llamacpp: bool = False,
    quantizations: tuple[str, ...] = (),
    fresh_kv_pages: bool = False,
    huge_pages: bool = True,
    kv_cache_dtype: str = "auto",
) -> dict:
    from graphrt.bench.llamacpp import start_llamacpp, start_llamacpp_quantized
    from graphrt.llm import LLM
    from graphrt.runner.graph_cache import CaptureSizes
    from graphrt.runner.kv_cache import fault_in_pages

    llamacpp = start_llamacpp(model, dtype, prompt_len + gen_len + 16) if vs_llamacpp else None
    # the quantized file itself, beside graphrt's int4 engine (which runs the same file as stored)
    llamacpp_q = start_llamacpp_quantized(model, prompt_len + gen_len + 16) if vs_llamacpp and quantizations else None

    facts = machine_facts(dtype)
    print_facts(facts)
    budget = max(batch_sizes) * prompt_len
    common = dict(
        dtype=dtype,
        max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=budget,
        max_model_len=prompt_len + gen_len + 16,
        kv_cache_memory=None,
        kv_cache_dtype=kv_cache_dtype,
        progress=True,
    )
    steady = dict(huge_pages=huge_pages)  # graphrt's engines: a long-running server's placement
    sizes = CaptureSizes(
        decode=tuple(sorted(set(batch_sizes))), mixed=tuple(sorted({b * prompt_len for b in batch_sizes}))
    )
    # graphrt's float path: a quantized GGUF dequantised at load, as transformers reads it
    compiled = LLM(
        model, capture_sizes=sizes, graph_cache=graph_cache, backend=backend, quantization="none", **common, **steady
    )
    eager = LLM(compiled.engine.loaded.model, compile=False, **common)
    sources = {q: quantized_source(model, q, compiled.engine.loaded.model) for q in quantizations}
    quantized = {
        q: LLM(
            source,
            quantization=quantization,
            capture_sizes=sizes,
            graph_cache=graph_cache,
            backend=backend,
            **common,
            **steady,
        )
        for q, (source, quantization) in sources.items()
    }
    if not fresh_kv_pages:  # steady state: a server has touched its cache's pages long ago
        for llm in (compiled, eager, *quantized.values()):
            fault_in_pages(llm.engine.kv_caches)
    hf = load_transformers(model, compiled.engine.dtype) if with_transformers else None
    cfg = compiled.engine.loaded.config
    reads = streaming_reads(huge_pages=huge_pages)
    bandwidth = max(reads.values())
    print(
        f"roofline: the faster of two streaming reads of 1 GiB in {pages_name(huge_pages)} pages (those of graphrt's "
        f"weights): sum {reads['sum'] / 1e9:.1f} GB/s, graphrt's one-row product {reads['product'] / 1e9:.1f} GB/s"
    )
    shares = None
    if profile:
        shares = write_profile(compiled, random_prompts(batch_sizes[0], prompt_len, cfg.vocab_size, seed=0), profile)
    rows = []
    for b in batch_sizes:
        prompts = random_prompts(b, prompt_len, cfg.vocab_size, seed=b)
        run_graphrt(compiled, prompts, 4)  # warm-up at this size
        # The machine's bandwidth drifts within minutes (shared hosts): the roofline of this row
        # takes the mean of a measurement just before and just after graphrt's own run.
        before = measure_bandwidth(huge_pages=huge_pages)
        row = {"batch": b, "graphrt": run_graphrt(compiled, prompts, gen_len)}
        row["bandwidth_gb_s"] = (before + measure_bandwidth(huge_pages=huge_pages)) / 2e9
        row["graphrt_eager"] = run_graphrt(eager, prompts, gen_len)
        for q, llm in quantized.items():
            run_graphrt(llm, prompts, 4)
            qrow = row.setdefault("quantized", {})[q] = run_graphrt(llm, prompts, gen_len)
            if llamacpp_q is not None and b == 1 and sources[q][1] is None:  # the file as stored
                llamacpp_q.run(prompts[0], 4)
                qrow["llamacpp"] = llamacpp_q.run(prompts[0], gen_len)
                qrow["ratio_vs_llamacpp"] = qrow["decode_tok_s"] / qrow["llamacpp"]["decode_tok_s"]
                qrow["same_tokens_as_llamacpp"] = qrow["tokens"][0] == qrow["llamacpp"].pop("tokens")
            q_bytes = decode_step_bytes(llm.engine.loaded.model, cfg, b, prompt_len + gen_len // 2, llm.engine.kv_dtype)
            qrow["weight_bytes"] = weight_bytes(llm.engine.loaded.model)
            qrow["kv_cache_dtype"] = str(llm.engine.kv_dtype).removeprefix("torch.")
            qrow["roofline_tok_s"] = b * row["bandwidth_gb_s"] * 1e9 / q_bytes
            qrow["roofline_frac"] = qrow["decode_tok_s"] / qrow["roofline_tok_s"]
            qrow["vs_fp32"] = qrow["decode_tok_s"] / row["graphrt"]["decode_tok_s"]
            qrow["same_tokens_as_fp32"] = sum(a == b for a, b in zip(qrow.pop("tokens"), row["graphrt"]["tokens"]))
        if llamacpp is not None and b == 1:  # llama.cpp's Python API runs one sequence
            llamacpp.run(prompts[0], 4)
            row["llamacpp"] = llamacpp.run(prompts[0], gen_len)
            row["ratio_vs_llamacpp"] = row["graphrt"]["decode_tok_s"] / row["llamacpp"]["decode_tok_s"]
            row["same_tokens_as_llamacpp"] = row["graphrt"]["tokens"][0] == row["llamacpp"]["tokens"]
        if hf is not None:
            run_transformers(hf, prompts, 4)
            row["transformers"] = run_transformers(hf, prompts, gen_len)
            row["ratio_vs_transformers"] = row["graphrt"]["decode_tok_s"] / row["transformers"]["decode_tok_s"]
            row["same_tokens_as_transformers"] = row["graphrt"]["tokens"] == row["transformers"]["tokens"]
        step_bytes = decode_step_bytes(
            compiled.engine.loaded.model, cfg, b, prompt_len + gen_len // 2, compiled.engine.kv_dtype
        )
        row["roofline_tok_s"] = b * row["bandwidth_gb_s"] * 1e9 / step_bytes
        row["roofline_frac"] = row["graphrt"]["decode_tok_s"] / row["roofline_tok_s"]
        for engine in ("graphrt", "graphrt_eager", "transformers", "llamacpp"):
            row.get(engine, {}).pop("tokens", None)
        rows.append(row)
        print_row(row)
    return {
        "machine": facts,
        "bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_reads_gb_s": {name: r / 1e9 for name, r in reads.items()},
        "prompt_len": prompt_len,
        "gen_len": gen_len,
        "kv_pages": "fresh" if fresh_kv_pages else "touched",
        "kv_cache_dtype": str(compiled.engine.kv_dtype).removeprefix("torch."),
        "huge_pages": huge_pages,
        "bandwidth_pages": pages_name(huge_pages),  # the roofline's reads use the pages the weights sit in
        "rows": rows,
        "capture": [(r.key.name, r.how, round(r.seconds, 1)) for r in compiled.capture_report()],
        "profile_shares": shares,
    }


def quantized_source(model: str | None, quantization: str, float_model) -> tuple:
    """(model, quantization) for LLM: "int4" of a Q4 GGUF is the file as stored (its Q8_0
    embedding included); anything else is the float model quantized at load."""
    from graphrt.loader import default_model_path
    from graphrt.loader.gguf_file import GGUFCheckpoint

    path = model or default_model_path()
    if quantization == "int4" and path.endswith(".gguf"):
        kinds = {t.tensor_type.name for t in GGUFCheckpoint(path).reader.tensors}
        if kinds & {"Q4_0", "Q4_1"}:
            return path, None
    return float_model, quantization


def write_profile(llm, prompts: list[list[int]], path: str, gen_len: int = 32) -> dict[str, float]:
    """A torch.profiler table of the decode steps of ``gen_len`` tokens (the prefill runs before
    the profiler starts), and each graphrt op's (and aten GEMM's) share of the profiled wall time."""
    from torch.profiler import ProfilerActivity, profile

    from graphrt import SamplingParams

    engine = llm.engine
    run_graphrt(llm, prompts, 4)
    ids = [engine.add_request(p, SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)) for p in prompts]
    while not all(engine.output(r).token_ids for r in ids):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        wall = time.perf_counter() - start
    for r in ids:
        engine.release(r)
    averages = prof.key_averages()
    shares = {
        e.key: e.self_cpu_time_total / 1e6 / wall
        for e in averages
        if e.key.startswith("graphrt::") or e.key in ("aten::mm", "aten::addmm", "aten::linear")
    }
    with open(path, "w") as f:
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=25))
        f.write(f"\nshare of the profiled wall time ({wall:.3f} s: {len(prompts)} rows, {gen_len - 1} decode steps):\n")
        for key, share in sorted(shares.items(), key=lambda kv: -kv[1]):
            f.write(f"  {key:<32} {100 * share:5.1f}%\n")
    for key, share in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"profile: {key:<32} {100 * share:5.1f}% of the step")
    print(f"wrote {path}")
    return shares


def print_row(row: dict) -> None:
    b = row["batch"]
    for name in ("graphrt", "graphrt_eager", "transformers", "llamacpp"):
        r = row.get(name)
        if r is None:
            continue
        if name == "llamacpp":
            print(
                f"batch {b:>3}  {name:<14} {r['decode_tok_s']:8.1f} tok/s  (its own counters: {r['n_eval']} "
                f"decode evals in {r['decode_ms']:.0f} ms)  graphrt/llama.cpp {row['ratio_vs_llamacpp']:.2f}x, "
                f"same tokens: {row['same_tokens_as_llamacpp']}"
            )
            continue
        extra = f"  overhead {100 * r['overhead_frac']:.1f}%" if name == "graphrt" else ""
        print(
            f"batch {b:>3}  {name:<14} {r['decode_tok_s']:8.1f} tok/s  step {r['step_ms_median']:7.2f} ms "
            f"(p90 {r['step_ms_p90']:7.2f}, max {r['step_ms_max']:7.1f})  ttft {r['ttft_s']:6.3f} s"
            f"{extra}{steal_note(r.get('steal_frac'))}"
        )
    for q, r in row.get("quantized", {}).items():
        print(
            f"batch {b:>3}  graphrt {q:<6} {r['decode_tok_s']:8.1f} tok/s  step {r['step_ms_median']:7.2f} ms  "
            f"{r['vs_fp32']:.2f}x graphrt fp32, roofline {r['roofline_tok_s']:.1f} tok/s "
            f"({100 * r['roofline_frac']:.0f}% reached, {r['weight_bytes'] / 1e6:.0f} MB of weights, "
            f"{r['kv_cache_dtype']} K/V), "
            f"{r['same_tokens_as_fp32']}/{b} rows with fp32's tokens{steal_note(r.get('steal_frac'))}"
        )
        if "llamacpp" in r:
            print(
                f"batch {b:>3}  llama.cpp {q} file {r['llamacpp']['decode_tok_s']:8.1f} tok/s  graphrt/llama.cpp "
                f"{r['ratio_vs_llamacpp']:.2f}x, same tokens: {r['same_tokens_as_llamacpp']}"
            )
    if "ratio_vs_transformers" in row:
        print(
            f"batch {b:>3}  graphrt/transformers {row['ratio_vs_transformers']:.2f}x, "
            f"same tokens: {row['same_tokens_as_transformers']}, "
            f"roofline {row['roofline_tok_s']:.1f} tok/s at {row['bandwidth_gb_s']:.1f} GB/s "
            f"({100 * row['roofline_frac']:.0f}% reached)"
        )


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    bs = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("graphrt", "graphrt_eager", "transformers"):
        if name in rows[0]:
            ax.plot(bs, [r[name]["decode_tok_s"] for r in rows], marker="o", label=name)
    ax.plot(bs, [r["roofline_tok_s"] for r in rows], linestyle="--", label="memory roofline")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"decode throughput ({result['machine']['dtype']}, {result['machine']['threads']} threads)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


__all__ = ["bench_decode", "plot", "write_json"]
