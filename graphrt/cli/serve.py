"""``graphrt serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from graphrt.cli.common import add_model_args, llm_kwargs
from graphrt.cli.generate import parse_lora


def on_a_thread_that_ends(fn):
    """``fn()`` run on a thread of its own that ends with it; its result, or its exception raised.

    The server steps its engine on the engine loop's thread, so start-up's torch work must not
    leave an OpenMP pool behind on the main thread. libgomp keeps one pool of worker threads per
    thread that starts parallel regions; with two pools (start-up's and the steps') a 2-core
    process has more of its threads than CPUs, and the workers then stop spinning between
    regions. Every region of a step paid a wake-up: SmolLM2 int4 at 16 rows, 31.5 ms a graph in
    the server against 16.9 offline. A pool goes with the thread that made it."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised on the calling thread
            box["error"] = e

    thread = threading.Thread(target=run, name="graphrt-start-up", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_args(p)
    p.set_defaults(huge_pages=True)  # a server runs long enough to earn the pages' first touch back
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("GRAPHRT_API_KEY"), help="require 'Authorization: Bearer KEY'")
    p.add_argument("--max-queued", type=int, default=128, help="waiting requests beyond this get HTTP 429")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="larger request bodies get HTTP 413")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: from --model)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--grammar-backend", default="in-graph", choices=["in-graph", "xgrammar-cpu"])
    p.add_argument(
        "--prefault-kv-cache",
        action="store_true",
        help="fault in every page of the KV cache from start-up, on a thread, so that the server reaches "
        "its steady speed once that is done (default: only the pages just ahead of the blocks in use)",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve this PEFT LoRA adapter as model NAME (repeatable)",
    )
    p.add_argument("--max-loras", type=int, default=4, help="adapter slots: distinct adapters in one step")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument(
        "--lora-target-modules",
        default=None,
        help="comma-separated PEFT modules adapters may target (default: q/k/v/o and gate/up/down)",
    )
    p.set_defaults(func=run)


def model_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model)).removesuffix(".gguf")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from graphrt.llm import LLM
    from graphrt.server.app import build_app

    if args.max_queued < 1:
        raise ValueError(f"--max-queued={args.max_queued} is invalid: it must be at least 1")
    kwargs = llm_kwargs(args)
    kwargs["grammar_backend"] = args.grammar_backend
    kwargs["progress"] = False
    loras = [parse_lora(text, i + 1) for i, text in enumerate(args.lora)]
    if loras:
        kwargs.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
        if args.lora_target_modules:
            kwargs["lora_target_modules"] = [m for m in args.lora_target_modules.split(",") if m]

    def start():
        llm = LLM(**kwargs)
        for lora in loras:  # a bad adapter stops the server before it serves
            llm.engine.register_lora(lora)
        return llm

    llm = on_a_thread_that_ends(start)
    name = args.served_model_name or model_name(args.model)
    app = build_app(
        llm.engine,
        name,
        api_key=args.api_key,
        max_queued=args.max_queued,
        max_body_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
        loras={lora.lora_name: lora for lora in loras},
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = uvicorn.Server(config)
    print(f"[graphrt] serving {name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal it shut down on once it has finished; a handler of our own
    # takes it, so that a graceful SIGTERM / Ctrl-C shutdown exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    server.run()
    return 0 if server.started else 1
