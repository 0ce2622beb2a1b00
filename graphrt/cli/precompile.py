"""``graphrt precompile``: build every graph of a deployment into a directory to ship."""

from __future__ import annotations

import argparse
import collections
import sys
import time

from graphrt.cli.common import add_model_args, llm_kwargs


def parse_sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def add_parser(sub) -> None:
    p = sub.add_parser("precompile", help="compile every graph into a graph cache directory")
    add_model_args(p)
    p.add_argument("--out", default=None, help="directory of the graph cache (created if needed)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build the graphs without writing them and print each graph's operators "
        "(with --backend torchair: the Ascend IR operators of its GE graph)",
    )
    p.add_argument(
        "--capture-sizes",
        type=parse_sizes,
        default=None,
        help="decode batch sizes to capture, e.g. 1,2,4,8 (default: powers of two)",
    )
    p.add_argument(
        "--mixed-sizes",
        type=parse_sizes,
        default=None,
        help="prefill/mixed token sizes to capture, e.g. 64,128 (default: powers of two)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from graphrt.llm import LLM
    from graphrt.runner.graph_cache import CaptureSizes

    if args.out is None and not args.dry_run:
        print("graphrt precompile: --out DIR is required (or --dry-run to only show the graphs)", file=sys.stderr)
        return 2
    kwargs = llm_kwargs(args)
    # precompile builds knowingly: whatever the directory held, it now holds these settings' graphs
    kwargs.update(graph_cache=False if args.dry_run else args.out, compile=True, rebuild_graph_cache=not args.dry_run)
    if args.capture_sizes is not None or args.mixed_sizes is not None:
        default = CaptureSizes.default(args.max_num_seqs or 8, args.max_num_batched_tokens or 256)
        kwargs["capture_sizes"] = CaptureSizes(
            decode=default.decode if args.capture_sizes is None else args.capture_sizes,
            mixed=default.mixed if args.mixed_sizes is None else args.mixed_sizes,
        )
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    if args.dry_run:
        for key, ops in graph_operators(llm).items():
            print(f"{key}: " + ", ".join(f"{name}×{n}" for name, n in ops.most_common()))
        return 0
    for rec in llm.capture_report():
        print(f"{rec.key.name}: {rec.how} in {rec.seconds:.1f} s", file=sys.stderr)
    print(
        f"[graphrt] {len(llm.capture_report())} graphs in {args.out} "
        f"({llm.stats()['compiles']} compiled) in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    return 0


def graph_operators(llm) -> dict[str, collections.Counter]:
    """Per graph key, its operators: a TorchAir GE graph's Ascend IR op types, else the FX graph's
    call targets after graphrt's passes."""
    out = {}
    for key, graph in llm.engine.graphs.graphs.items():
        ascend = getattr(graph.fn, "ascend_ops", None)
        if ascend:
            out[key.name] = ascend
        else:
            nodes = graph.gm.graph.nodes if graph.gm is not None else []
            out[key.name] = collections.Counter(str(n.target) for n in nodes if n.op == "call_function")
    return out
