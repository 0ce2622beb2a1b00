"""``graphrt bench quality``: what quantization costs in accuracy, measured on one model in one run.

For each weight format (fp32, bf16, int8, int4): the perplexity of a fixed public-domain passage
shipped with graphrt (the Declaration of Independence, about 1,700 SmolLM2 tokens; prompt
log-probabilities of the whole passage as one prompt), and the greedy tokens of 128 steps after
the passage's first sentence, compared position by position with fp32's. The formats come from
one checkpoint: a quantized GGUF is dequantised for fp32 and bf16; int8 is the fp32 model
quantized at load; int4 is a Q4 GGUF as stored (else the fp32 model quantized at load). One more
format is not a weight format: ``float32-bf16kv``, fp32 weights over a bf16 KV cache
(``kv_cache_dtype="bfloat16"``). int8 and int4 run over their default cache, bf16 (``"auto"``
under quantized weights); ``int8-f32kv`` and ``int4-f32kv`` keep theirs float32.
"""

from __future__ import annotations

import math
import os
import time

from graphrt.bench.common import machine_facts, print_facts

PASSAGE = os.path.join(os.path.dirname(__file__), "data", "declaration_of_independence.txt")
FORMATS = ("float32", "float32-bf16kv", "bfloat16", "int8", "int8-f32kv", "int4", "int4-f32kv")


def _engine_args(fmt: str, model, float_model) -> tuple[object, dict]:
    from graphrt.bench.decode import quantized_source

    if fmt == "float32-bf16kv":
        return model, dict(dtype="float32", quantization="none", kv_cache_dtype="bfloat16")
    if fmt in ("float32", "bfloat16"):
        return model, dict(dtype=fmt, quantization="none")
    weights, _, kv = fmt.partition("-")
    source, quantization = quantized_source(model, weights, float_model)
    return source, dict(dtype="float32", quantization=quantization, kv_cache_dtype="float32" if kv else "auto")


def bench_quality(model: str | None, formats: tuple[str, ...] = FORMATS, gen_len: int = 128, backend: str = "eager"):
    from graphrt import LLM, SamplingParams
    from graphrt.runner.graph_cache import CaptureSizes

    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r} is not one of {list(FORMATS)}")
    print_facts(machine_facts(",".join(formats)))
    with open(PASSAGE) as f:
        text = f.read()
    common = dict(
        max_num_seqs=1,
        max_num_batched_tokens=256,
        max_model_len=2560,
        kv_cache_memory=256 << 20,
        progress=False,
        compile=backend != "none",
        backend="eager" if backend == "none" else backend,
        capture_sizes=CaptureSizes(decode=(1,), mixed=(256,)),
        graph_cache=False,
    )
    reference = LLM(model, quantization="none", **common)  # fp32: the float model the others come from
    tok = reference.tokenizer
    passage = tok.encode(text)
    first_sentence = tok.encode(text.split("\n\n")[2].split(",")[0])
    float_model = reference.engine.loaded.model
    rows, fp32_tokens = [], None
    for fmt in formats:
        source, kwargs = _engine_args(fmt, model, float_model)
        llm = reference if fmt == "float32" else LLM(source, **{**common, **kwargs})
        t = time.perf_counter()
        scored = llm.generate([passage], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
        logprobs = [e[token] for token, e in zip(passage[1:], scored.prompt_logprobs[1:])]
        greedy = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
        tokens = llm.generate([first_sentence], greedy)[0].token_ids
        fp32_tokens = fp32_tokens if fp32_tokens is not None else tokens
        same = [a == b for a, b in zip(tokens, fp32_tokens)]
        row = {
            "format": fmt,
            "kv_cache_dtype": str(llm.engine.kv_dtype).removeprefix("torch."),
            "weight_mb": _weight_mb(llm.engine.loaded.model),
            "perplexity": math.exp(-sum(logprobs) / len(logprobs)),
            "greedy_agreement": sum(same) / len(same),
            "first_divergence": same.index(False) if False in same else None,
            "seconds": time.perf_counter() - t,
        }
        rows.append(row)
        if llm is not reference:
            del llm
    base = rows[[r["format"] for r in rows].index("float32")]["perplexity"] if "float32" in formats else None
    for row in rows:
        row["perplexity_vs_fp32"] = None if base is None else row["perplexity"] / base - 1
        vs = "" if base is None else f" ({100 * row['perplexity_vs_fp32']:+.2f}% vs fp32)"
        div = row["first_divergence"]
        print(
            f"{row['format']:>14}: {row['weight_mb']:6.0f} MB of weights, {row['kv_cache_dtype']} K/V, "
            f"perplexity {row['perplexity']:.4f}{vs} over "
            f"{len(passage) - 1} tokens; greedy agreement with fp32 {100 * row['greedy_agreement']:.1f}% of "
            f"{gen_len} tokens" + ("" if div is None else f" (first difference at token {div})")
        )
    return {"machine": machine_facts(",".join(formats)), "passage_tokens": len(passage), "rows": rows}


def _weight_mb(model) -> float:
    from graphrt.bench.roofline import weight_bytes

    return weight_bytes(model) / 1e6
