"""``graphrt bench decode | kernels | startup | roofline | grammar | spec | serve | quality``."""

from __future__ import annotations

import argparse

from graphrt.bench.common import machine_facts, print_facts, write_json


def _sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return n


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: decode, kernels, startup, roofline, grammar, spec, serve")
    kinds = p.add_subparsers(dest="bench", required=True)
    for name, help_ in (
        ("decode", "decode tokens/s against transformers"),
        ("kernels", "the skinny GEMM against aten's linear, cold weights, against the read bandwidth"),
        ("startup", "cold vs warm start"),
        ("roofline", "bandwidth and the fraction of it decode reaches"),
        ("grammar", "constrained vs unconstrained step time"),
        ("spec", "plain decoding against n-gram (or MTP) speculative decoding, side by side"),
        ("serve", "graphrt serve under concurrent streaming clients against offline LLM.generate"),
        ("quality", "perplexity and greedy agreement of fp32, bf16, int8 and int4 weights, one model"),
    ):
        k = kinds.add_parser(name, help=help_)
        k.add_argument("--json", default=None, help="write the results as JSON here")
        if name != "kernels":  # the kernel benchmark runs on synthetic weights of SmolLM2's shapes
            k.add_argument("--model", default=None)
            k.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
            k.add_argument("--graph-cache", default=None)
        if name in ("decode", "roofline"):
            k.add_argument("--batch-sizes", type=_sizes, default=[1, 8] if name == "roofline" else [1, 2, 4, 8])
            k.add_argument("--prompt-len", type=int, default=128)
            k.add_argument("--gen-len", type=int, default=128)
            k.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
            k.add_argument(
                "--huge-pages",
                action=argparse.BooleanOptionalAction,
                default=True,
                help="graphrt's weights and KV caches in 2 MiB pages, as graphrt serve runs (default: on)",
            )
            k.add_argument(
                "--kv-cache-dtype",
                default="auto",
                choices=["auto", "float32", "bfloat16"],
                help="graphrt's KV caches: auto (the model's dtype; bfloat16 under int4/int8 weights), float32, or "
                "bfloat16 under float32 weights",
            )
        if name == "decode":
            k.add_argument("--plot", default=None, help="draw throughput against batch size into this PNG")
            k.add_argument("--no-transformers", action="store_true")
            k.add_argument(
                "--lora",
                type=int,
                default=0,
                metavar="N",
                help="instead: decode with N LoRA adapters (rank 16) spread over the largest batch, against the base",
            )
            k.add_argument(
                "--lora-targets", default="all", choices=["all", "attn", "qv"], help="the modules LoRA is served on"
            )
            k.add_argument(
                "--quantization",
                default="",
                help="also run these weight formats side by side (int4,int8): int4 of a Q4 GGUF is the file as "
                "stored, otherwise the float model quantized at load",
            )
            k.add_argument(
                "--vs-llamacpp",
                action="store_true",
                help="run llama.cpp (llama-cpp-python) at batch 1 on an F32/F16 copy of the GGUF, interleaved",
            )
            k.add_argument(
                "--profile",
                default=None,
                help="write a torch.profiler table of graphrt's compiled decode at the first batch size",
            )
            k.add_argument(
                "--fresh-kv-pages",
                action="store_true",
                help="measure with the KV caches' pages untouched (a fresh process's first pass: a page fault per "
                "4 KiB of new K/V); by default every page is touched first, as in a long-running server",
            )
        if name == "kernels":
            k.add_argument("--rows", type=_sizes, default=[1, 2, 4, 8, 16], help="activation row counts, e.g. 1,8")
            k.add_argument(
                "--dtypes",
                default="float32,bfloat16",
                help="weight dtypes, comma-separated: float32, bfloat16, int8, int4 (fp32 activations)",
            )
            k.add_argument(
                "--huge-pages",
                action=argparse.BooleanOptionalAction,
                default=True,
                help="the matrices and the bandwidth's reads in 2 MiB pages, as an engine places its weights "
                "(default: on)",
            )
        if name == "spec":
            k.add_argument("--batch-sizes", type=_sizes, default=[1, 8])
            k.add_argument("--ks", type=_sizes, default=None, help="num_speculative_tokens values (3,5; MTP: 1,3)")
            k.add_argument("--gen-len", type=int, default=128)
            k.add_argument("--method", default="ngram", choices=["ngram", "mtp"])
            k.add_argument(
                "--backend", default="inductor", choices=["inductor", "eager"], help="ngram: the graphs' inner backend"
            )
            k.add_argument(
                "--layers", type=int, default=8, help="mtp without --model: layers of the random DeepSeek-V3"
            )
            k.add_argument(
                "--rounds",
                type=_positive,
                default=None,
                help="interleaved runs of every engine, medians taken (2; mtp: 5)",
            )
        if name == "serve":
            k.add_argument("--requests", type=int, default=64, help="requests in all")
            k.add_argument("--concurrency", type=int, default=16, help="clients streaming at once")
            k.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
            k.add_argument("--max-num-seqs", type=int, default=16)
            k.add_argument("--time-limit", type=float, default=600, help="seconds the load may take at most")
            k.add_argument("--port", type=int, default=8123)
            k.add_argument("--rounds", type=int, default=3, help="offline and served passes, alternated")
        if name == "quality":
            k.add_argument(
                "--formats",
                default="float32,float32-bf16kv,bfloat16,int8,int8-f32kv,int4,int4-f32kv",
                help="weight formats, comma-separated (float32-bf16kv: fp32 weights over a bf16 KV cache; int8 and "
                "int4 over their default bf16 one, int8-f32kv and int4-f32kv over a float32 one)",
            )
            k.add_argument("--gen-len", type=int, default=128, help="greedy tokens compared with fp32's")
            k.add_argument(
                "--backend",
                default="eager",
                choices=["eager", "inductor", "none"],
                help="graphs' inner backend (eager: rewritten graphs without Inductor compiles); none: no graphs",
            )
        if name == "grammar":
            k.add_argument("--batch", type=int, default=4)
            k.add_argument("--no-compile", action="store_true")
        k.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.bench == "decode" and args.lora:
        from graphrt.bench.lora import bench_lora

        result = bench_lora(
            args.model, args.dtype, args.lora, max(args.batch_sizes), args.prompt_len, args.gen_len,
            args.graph_cache, args.lora_targets,
        )  # fmt: skip
    elif args.bench in ("decode", "roofline"):
        from graphrt.bench.decode import bench_decode, plot

        roofline_only = args.bench == "roofline"  # the same run, without transformers
        result = bench_decode(
            args.model,
            args.dtype,
            args.batch_sizes,
            args.prompt_len,
            args.gen_len,
            args.graph_cache,
            with_transformers=not roofline_only and not args.no_transformers,
            backend=args.backend,
            profile=None if roofline_only else args.profile,
            vs_llamacpp=not roofline_only and args.vs_llamacpp,
            quantizations=tuple(q for q in getattr(args, "quantization", "").split(",") if q),
            fresh_kv_pages=getattr(args, "fresh_kv_pages", False),
            huge_pages=args.huge_pages,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        if not roofline_only and args.plot:
            plot(result, args.plot)
        if roofline_only:
            print(f"bandwidth {result['bandwidth_gb_s']:.1f} GB/s (streaming read, {result['bandwidth_pages']} pages)")
    elif args.bench == "quality":
        from graphrt.bench.quality import bench_quality

        result = bench_quality(args.model, tuple(args.formats.split(",")), args.gen_len, args.backend)
    elif args.bench == "kernels":
        from graphrt.bench.kernels import bench_kernels

        print_facts(machine_facts(args.dtypes))
        result = bench_kernels(args.dtypes.split(","), args.rows, huge_pages=args.huge_pages)
    elif args.bench == "spec":
        print_facts(machine_facts(args.dtype))
        if args.method == "mtp":
            from graphrt.bench.mtp import bench_mtp

            result = bench_mtp(
                args.model, args.dtype, args.batch_sizes, args.ks or [1, 3], args.gen_len, args.layers, args.rounds or 5
            )
        else:
            from graphrt.bench.spec import bench_spec

            result = bench_spec(
                args.model,
                args.dtype,
                args.batch_sizes,
                args.ks or [3, 5],
                args.gen_len,
                args.rounds or 2,
                backend=args.backend,
            )
    elif args.bench == "serve":
        from graphrt.bench.serve import bench_serve

        print_facts(machine_facts(args.dtype))
        result = bench_serve(
            args.model,
            args.dtype,
            args.graph_cache,
            args.requests,
            args.concurrency,
            args.max_tokens,
            args.max_num_seqs,
            args.time_limit,
            args.port,
            args.rounds,
        )
    elif args.bench == "startup":
        from graphrt.bench.startup import bench_startup

        print_facts(machine_facts(args.dtype))
        result = bench_startup(args.model, args.dtype, args.graph_cache)
    else:
        from graphrt.bench.grammar import bench_grammar
        from graphrt.llm import LLM
        from graphrt.runner.graph_cache import CaptureSizes

        print_facts(machine_facts(args.dtype))
        llm = LLM(
            args.model,
            dtype=args.dtype,
            max_num_seqs=args.batch,
            max_num_batched_tokens=64,
            compile=not args.no_compile,
            graph_cache=args.graph_cache,
            capture_sizes=CaptureSizes(decode=(args.batch,), mixed=(64,)),
        )
        result = bench_grammar(llm, args.batch)
    write_json(args.json, result)
    return 0
