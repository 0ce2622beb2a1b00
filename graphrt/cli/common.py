"""Options shared by the subcommands."""

from __future__ import annotations

import argparse
import json


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    unset = "default: a shipped graph cache's setting, else "
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help=unset + "float32")
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "none"],
        help="int8/int4: quantize a float checkpoint at load; none: dequantise a quantized GGUF "
        "(default: weights as stored, a Q4/Q8 GGUF stays quantized)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help=unset + "8")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help=unset + "256")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["auto", "float32", "bfloat16"],
        help=unset + "auto (the model's dtype; bfloat16 under int4/int8 weights); float32; bfloat16 under a "
        "float32 model halves the KV cache",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--huge-pages",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="weights and KV caches in 2 MiB pages: faster steps, slower start (default: on for serve, "
        "off for a one-off generate)",
    )
    p.add_argument("--no-compile", action="store_true", help="run eagerly, without compiled graphs")
    p.add_argument("--backend", default="inductor", choices=["inductor", "eager", "torchair"])
    p.add_argument(
        "--torchair-mode",
        default="max-autotune",
        choices=["max-autotune", "reduce-overhead"],
        help="with --backend torchair: one GE graph per key, or captured ACL graphs",
    )
    p.add_argument("--passes-disabled", default="", help="comma-separated pass names to switch off")
    p.add_argument(
        "--graph-cache",
        default=None,
        help="directory of precompiled graphs (graphrt precompile); default: the per-user graph cache",
    )
    p.add_argument("--no-graph-cache", action="store_true", help="keep no compiled graphs on disk")
    p.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'',
    )
    p.add_argument(
        "--rebuild-graph-cache",
        action="store_true",
        help="build the graphs a shipped graph cache lacks for settings other than its own",
    )
    p.add_argument(
        "--strict-graph-cache",
        action="store_true",
        help="refuse a stale or tampered graph cache entry instead of rebuilding it",
    )


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def llm_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
        compile=not args.no_compile,
        backend=args.backend,
        torchair_mode=args.torchair_mode,
        passes_disabled=[p for p in args.passes_disabled.split(",") if p],
        graph_cache=False if args.no_graph_cache else args.graph_cache,
        strict_graph_cache=args.strict_graph_cache,
        rebuild_graph_cache=args.rebuild_graph_cache,
        speculative_config=args.speculative_config,
        huge_pages=args.huge_pages,
        prefault_kv_cache=getattr(args, "prefault_kv_cache", False),  # graphrt serve's
    )
