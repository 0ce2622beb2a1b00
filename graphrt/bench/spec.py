"""``graphrt bench spec``: plain decoding against n-gram speculation (k = 3, 5), side by side.

Two prompt sets: *repetitive* (a 100-line code snippet shipped with graphrt, twice, then the start
of a third copy: the continuation repeats the input, the case prompt lookup is for) and *ordinary*
chat prompts. Batch 1 and 8, greedy, every engine on the same prompts in one run, interleaved;
greedy outputs are compared token for token. Speeds are decode tokens/s: from the moment every
request has its first token to the end (prefill is the same work with or without drafts). Also
the cost of one verify step against one main step (their graphs replayed at each batch size).
"""

from __future__ import annotations

import time
from importlib import resources

from graphrt.bench.common import median

CHAT = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for learning to cook.",
    "What is a hash table?",
    "Describe a sunset over the mountains.",
    "Why is the sky blue?",
    "List four planets of the solar system.",
]


def repetitive_prompt(lines: int = 100) -> str:
    """The snippet, a copy of it, and the first lines of another copy: the continuation is the
    rest of that copy (a small model copies a text it has seen repeated, not one seen once)."""
    snippet = "\n".join(
        resources.files("graphrt.bench").joinpath("data/repeat_snippet.txt").read_text().split("\n")[:lines]
    )
    head = "\n".join(snippet.split("\n")[:2])
    return f"{snippet}\n\n\n{snippet}\n\n\n{head}\n"


def fitting_repetitive_prompt(llm, gen_len: int) -> str:
    """The 100-line prompt, or fewer lines for a model with a shorter context."""
    for lines in (100, 75, 50, 25, 12):
        prompt = repetitive_prompt(lines)
        if len(llm.tokenizer.encode(prompt)) + gen_len < llm.engine.max_model_len:
            return prompt
    return repetitive_prompt(4)


def _engines(model, dtype: str, batch_sizes: list[int], ks: list[int], budget: int, backend: str = "inductor"):
    from graphrt.llm import LLM
    from graphrt.loader import load_model
    from graphrt.runner.graph_cache import CaptureSizes

    limit = load_model(model, dtype).config.max_position_embeddings
    common = dict(
        dtype=dtype,
        max_model_len=min(4096, limit),  # the repetitive prompt holds the snippet twice: ~2,100 tokens
        max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=budget,
        capture_sizes=CaptureSizes(decode=tuple(sorted(set(batch_sizes))), mixed=(budget,)),
        progress=False,
        backend=backend,
    )
    engines = {"plain": LLM(model, **common)}
    for k in ks:
        config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
        engines[f"ngram k={k}"] = LLM(model, speculative_config=config, **common)
    return engines


def _timed(llm, prompts, params, chat: bool) -> tuple[list[list[int]], float]:
    """Every request's tokens, and the seconds from the moment every request has its first token
    (prefill done) to the end: decode time, which speculation changes and prefill does not."""
    tokens = [[] for _ in prompts]
    first = None
    for ev in llm.generate_stream(prompts, params, chat=chat):
        tokens[ev.index].extend(ev.token_ids)
        if first is None and all(tokens):
            first = time.perf_counter()
    return tokens, time.perf_counter() - first


def _step_costs(llm, k: int, rows: int, repeats: int = 30) -> dict:
    """Median seconds of one replay of the main graph and of the verify graph at ``rows`` rows."""
    out = {}
    for key, graph in llm.engine.graphs.graphs.items():
        if key.name in (f"main-t{rows}-r{rows}", f"verify-t{rows * (k + 1)}-r{rows}"):
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                graph()
                times.append(time.perf_counter() - t)
            out[key.kind] = median(times)
    return out


def bench_spec(
    model, dtype: str, batch_sizes: list[int], ks: list[int], gen_len: int, rounds: int = 2, backend: str = "inductor"
) -> dict:
    """``backend``: the graphs' inner backend (``eager`` replays the rewritten graphs as Python: a
    quick check of the plumbing, not a speed measurement)."""
    from graphrt.sampling_params import SamplingParams

    budget = 256
    engines = _engines(model, dtype, batch_sizes, ks, budget, backend)
    params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    sets = {"repetitive": ([fitting_repetitive_prompt(engines["plain"], gen_len)], False), "ordinary": (CHAT, True)}
    results, outputs = [], {}
    for set_name, (texts, chat) in sets.items():
        for batch in batch_sizes:
            prompts = [texts[i % len(texts)] for i in range(batch)]
            times: dict[str, list[float]] = {name: [] for name in engines}
            for _ in range(rounds):
                for name, llm in engines.items():  # interleaved: the machine's drift hits all alike
                    tokens, decode_s = _timed(llm, prompts, params, chat)
                    times[name].append(decode_s)
                    outputs[(set_name, batch, name)] = tokens
            base = median(times["plain"])
            for name in engines:
                tokens = sum(len(t) - 1 for t in outputs[(set_name, batch, name)])  # decode tokens
                row = {
                    "prompts": set_name,
                    "batch": batch,
                    "engine": name,
                    "tokens_per_s": tokens / median(times[name]),
                    "speedup": base / median(times[name]),
                    "same_output": outputs[(set_name, batch, name)] == outputs[(set_name, batch, "plain")],
                }
                if name != "plain":
                    stats = engines[name].stats()
                    row["acceptance"] = stats["spec_acceptance_rate"]
                    row["mean_accepted_length"] = stats["spec_mean_accepted_length"]
                results.append(row)
                print(
                    f"{set_name:<10} batch {batch}  {name:<10} {row['tokens_per_s']:7.1f} decode tok/s  "
                    f"{row['speedup']:.2f}x  same output: {row['same_output']}"
                    + (
                        f"  acceptance {row['acceptance']:.2f}, mean accepted length {row['mean_accepted_length']:.2f}"
                        if name != "plain"
                        else ""
                    )
                )
            for name in engines:  # stats per set and batch
                engines[name].engine.spec_stats.__init__()
    costs = {}
    for k in ks:
        for rows in batch_sizes:
            c = _step_costs(engines[f"ngram k={k}"], k, rows)
            if len(c) == 2:
                costs[f"k={k} rows={rows}"] = c["verify"] / c["main"]
                print(f"verify step ({rows} row(s), {k} drafts each) / main step: {c['verify'] / c['main']:.2f}")
    return {"results": results, "verify_over_main": costs, "gen_len": gen_len}
